"""Two real Unix users, real kernels, one machine's books: what each can and cannot do.

The books exist so that two people on one machine are not both granted card
0, and they are only worth having if the second person cannot forge, stall,
cancel or read the first one's share. So every test here runs kernels as two
real users (made with ``useradd``, run with ``setpriv``) on books set up by
``fluksio-nb machine init``, and the second user attacks as a hostile
colleague would. CI runs as root and can do all this; elsewhere the tests
skip and say what is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fluksio_nb.identity import process_started
from tests.kernels import Kernel, until_it_exists
from tests.machines import fluksio_nb, kernels_on_books, machine, machine_env, wait_until
from tests.unix_users import (
    USER_A,
    USER_B,
    as_user,
    ready_user,
    require_unix_users,
    run_as,
    user_environ,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def users():
    require_unix_users()
    return ready_user(USER_A), ready_user(USER_B)


@pytest.fixture
def kernels():
    with kernels_on_books() as start:
        yield start


def running_labels(kernel: Kernel) -> list:
    return [(c["user"], c["label"]) for c in kernel.books()["running"]]


#: A file that never comes: a claim told to hold until it exists holds until it is killed.
NEVER = Path("/nonexistent")


def hold(label: str, until: Path) -> str:
    """A ``gpus=1`` background claim that holds its card until the file ``until`` exists."""
    return f"%%claim gpus=1 --background --label {label}\n{until_it_exists(until)}"


def test_two_users_get_different_cards_and_the_second_waits_for_the_one_card(users, kernels):
    """Guards against two people on one machine both being granted card 0."""
    alice, bob = users
    with machine(gpus=2) as layout:
        a, b = kernels(alice, layout), kernels(bob, layout)
        cards = []
        for kernel in (a, b):
            kernel.run("from fluksio_nb import claim\nheld = claim(gpus=1).acquire()", check=True)
            cards.append(kernel.facts("list(held.allocation.gpus)"))
        assert sorted(cards) == [[0], [1]]
        for kernel in (a, b):
            kernel.run("held.release()", check=True)
    with machine(gpus=1) as layout:
        a, b = kernels(alice, layout), kernels(bob, layout)
        a.run("from fluksio_nb import claim\nheld = claim(gpus=1).acquire()", check=True)
        waited = b.run("%%claim gpus=1 --timeout 1\nx = 1")
        assert waited.error["ename"] == "ClaimTimeout"
        assert USER_A in waited.error["evalue"]
        a.run("held.release()", check=True)
        b.run("%%claim gpus=1 --timeout 10\nx = 1", check=True)


def test_another_user_cannot_cancel_my_claim_even_calling_itself_root(users, kernels):
    """Guards against `accountant().cancel(n)` in another user's kernel stopping my
    running cell, and against $USER deciding who a kernel is."""
    alice, bob = users
    with machine(gpus=1) as layout:
        stop = layout.prefix / "stop"
        a = kernels(alice, layout)
        b = kernels(bob, layout, USER="root", LOGNAME="root")
        a.start_job(hold("alices-training", until=stop), "job")
        ticket = wait_until(lambda: a.books()["running"], what="alice's claim")[0]["ticket"]

        attempt = b.run(f"import fluksio_nb\nfluksio_nb.accountant().cancel({ticket})")
        assert attempt.error["ename"] == "NotYours"
        assert USER_A in attempt.error["evalue"]
        seen_by_bob = b.books()
        assert seen_by_bob["user"] == USER_B
        (held,) = seen_by_bob["running"]
        assert (held["user"], held["label"], held["mine"]) == (USER_A, None, False)

        b.run("%%claim cpus=1 --background --label bobs\nimport time; time.sleep(30)", check=True)
        mine = wait_until(
            lambda: [c for c in b.books()["running"] if c["mine"]], what="bob's claim"
        )
        assert mine[0]["user"] == USER_B

        terminal = run_as(
            bob,
            "import sys; from fluksio_nb.__main__ import main; sys.exit(main([]))",
            env=machine_env(layout),
        )
        assert terminal.returncode == 0, terminal.stderr
        assert f"a claim of {USER_A}" in terminal.stdout
        assert "bobs (yours)" in terminal.stdout
        assert "alices-training" not in terminal.stdout

        assert a.facts("job.status") == "running"
        stop.touch()
        a.run("job.result(30)", check=True)
        assert a.facts("job.status") == "ok"


def test_a_hostile_user_holding_locks_planting_links_and_stopping_itself_stalls_nobody(
    users, kernels
):
    """Guards against another user stalling every claim on the machine by holding a
    lock and sleeping, by planting symlinks where the books write, or by sending
    half a request and stopping itself."""
    alice, bob = users
    with machine(gpus=1) as layout:
        secret = layout.prefix / "root-only-secret"
        secret.write_text("not for bob")
        os.chmod(secret, 0o600)
        attacker = subprocess.Popen(
            [
                *as_user(bob),
                sys.executable,
                "-c",
                ATTACK,
                str(layout.run_dir),
                str(layout.records),
                str(secret),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=user_environ(bob),
        )
        try:
            report = json.loads(attacker.stdout.readline())
            wait_until(
                lambda: psutil.Process(attacker.pid).status() == psutil.STATUS_STOPPED,
                what="the attacker stopped",
            )
            assert report["locked"], "the attacker found nothing to lock"
            assert report["planted_in_run_dir"] == []
            a = kernels(alice, layout)
            for _ in range(3):
                ran = a.run("%%claim gpus=1 --timeout 3\nx = 41 + 1", check=True)
                assert ran.status == "ok"
            assert a.facts("x") == 42
            assert secret.read_text() == "not for bob"
            assert oct(secret.stat().st_mode & 0o777) == "0o600"
            records = [p for p in layout.records.iterdir() if p.stat().st_uid == alice.uid]
            assert records and all(not p.is_symlink() for p in records)
        finally:
            attacker.kill()
            attacker.wait()


ATTACK = r"""
import fcntl, json, os, socket, sys
run_dir, records, secret = sys.argv[1:4]
locked, planted_run, planted_records = [], [], []
for directory in (run_dir, records):
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        for flags in (os.O_RDWR, os.O_RDONLY):
            try:
                fd = os.open(path, flags | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked.append(path)
            except OSError:
                pass
            break
for name in ("books.sock", "machine", ".machine.new", "service.pid", "service.log"):
    try:
        os.symlink(secret, os.path.join(run_dir, name + ".x"))
        planted_run.append(name)
    except OSError:
        pass
    try:
        os.symlink(secret, os.path.join(run_dir, name))
        planted_run.append(name)
    except OSError:
        pass
for uid in range(0, 70000, 997):
    try:
        os.symlink(secret, os.path.join(records, f"{uid}-{os.getpid()}-x.jsonl"))
        planted_records.append(uid)
    except OSError:
        pass
half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
half.connect(os.path.join(run_dir, "books.sock"))
half.sendall(b'{"op":"hello"}\n{"op":"claim","id":1,"need":{"cpus":1,')
garbage = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
garbage.connect(os.path.join(run_dir, "books.sock"))
garbage.sendall(b'{"op":"hello"}\n{"op":"claim","id":1,"need":{"cpus":"all","gpus":1e9}}\n')
print(json.dumps({"locked": locked, "planted_in_run_dir": planted_run}), flush=True)
os.kill(os.getpid(), 19)
"""


FLOOD_THE_QUEUE = r"""
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
send = lambda message: sock.sendall(json.dumps(message).encode() + b"\n")
send({"op": "hello", "share_labels": True, "notebook": "n" * 4096, "kernel_id": "k" * 256})
need = {"cpus": 1, "gpus": 1, "ram_bytes": 0}
for n in range(1, 301):
    send({"op": "claim", "id": n, "need": need, "label": "x" * 512})
answers = sock.makefile("rb")
told = [json.loads(answers.readline()) for _ in range(301)]
print(json.dumps([m["op"] for m in told[1:]]), flush=True)
sys.stdin.readline()
"""


def test_another_users_long_queue_of_long_labels_cannot_break_my_kernels_hold(users, kernels):
    """Guards against another user queueing 300 claims with the longest labels and
    notebook path the protocol takes, shared with all, so that the snapshot my kernel
    reads grew past the longest line: my kernel dropped its connection, the service
    freed my card, and the attacker's first claim was granted it."""
    alice, bob = users
    with machine(gpus=1) as layout:
        a = kernels(alice, layout)
        a.run("from fluksio_nb import claim\nheld = claim(gpus=1).acquire()", check=True)
        attacker = subprocess.Popen(
            [*as_user(bob), sys.executable, "-c", FLOOD_THE_QUEUE, str(layout.socket)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=user_environ(bob),
        )
        try:
            assert json.loads(attacker.stdout.readline()) == ["ticket"] * 300
            seen = a.books()
            assert len(seen["waiting"]) + seen["waiting_unlisted"] == 300
            assert all(len(c["label"]) < 512 for c in seen["waiting"])
            for _ in range(3):
                assert [(c["user"], c["mine"]) for c in a.books()["running"]] == [(USER_A, True)]
            assert a.facts("[held.allocation.gpus, held.status.phase]") == [[0], "running"]
            terminal = run_as(
                alice,
                "import sys; from fluksio_nb.__main__ import main; sys.exit(main([]))",
                env=machine_env(layout),
            )
            unlisted = seen["waiting_unlisted"]
            assert f"and {unlisted} more of other users' claims, not listed" in terminal.stdout
        finally:
            attacker.kill()
            attacker.wait()
        a.run("held.release()", check=True)


def test_one_users_twenty_queued_claims_do_not_starve_anothers_one(users, kernels):
    """Guards against FIFO between claims making one person wait for all of another
    person's backlog: B's one-core claim starts within two of A's twenty."""
    alice, bob = users
    with machine(cpus=3, gpus=0) as layout:
        # Alice's first claim holds until Bob's is queued behind her nineteen
        # others: the queue is then exactly what the test is about.
        go = layout.prefix / "go"
        a, b = kernels(alice, layout), kernels(bob, layout)
        a.run("jobs = []", check=True)
        for n in range(20):
            a.run(
                f"%%claim cpus=2 --background --label a{n}\nimport os, time\n"
                f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\n"
                "started = time.time(); time.sleep(0.3)",
                check=True,
            )
            a.run("jobs.append(_)", check=True)
        wait_until(lambda: len(b.books()["waiting"]) == 19, what="alice's queue")
        b.start_job(
            "%%claim cpus=2 --background --label b\nimport time\nstarted = time.time()", "job"
        )
        wait_until(lambda: len(b.books()["waiting"]) == 20, what="bob's claim in the queue")
        go.touch()
        bob_started = b.facts("job.result(120)['started']")
        a_starts = a.facts("[j.result(120)['started'] for j in jobs]")
        assert sum(s < bob_started for s in a_starts) <= 2


def test_a_killed_kernels_card_reaches_another_users_waiting_cell(users, kernels, tmp_path):
    """Guards against a dead kernel's share staying taken because nobody else may
    delete its files. How soon it arrives is ``bench/books.py``'s to measure (a few
    ms): a bound here only measured how loaded the machine was."""
    alice, bob = users
    with machine(gpus=1) as layout:
        a, b = kernels(alice, layout), kernels(bob, layout)
        a.start_job(hold("doomed", until=NEVER), "job")
        wait_until(lambda: b.books()["running"], what="alice's claim")
        b.start_job(
            "%%claim gpus=1 --background --label next\nimport time\nstarted = time.time()",
            "job",
        )
        wait_until(lambda: b.books()["waiting"], what="bob's waiting claim")
        killed_at = time.time()
        os.kill(a.pid, signal.SIGKILL)
        wait_until(lambda: process_started(a.pid) is None, what="alice's kernel's end")
        # Alice's claim never ends but with her kernel: bob's runs only after it.
        assert b.facts("job.result(30)['started']") > killed_at


def test_an_admin_may_cancel_anyones_claim_and_the_owner_reads_who(users, kernels, tmp_path):
    """Guards against an admin being unable to free a card someone forgot, and against
    the owner's cell ending without saying who stopped it."""
    alice, bob = users
    admins = "fluksio-test-admins"
    subprocess.run(["groupadd", "-f", admins], check=True)
    subprocess.run(["usermod", "-aG", admins, bob.name], check=True)
    with machine(gpus=1, config={"admin_group": admins}) as layout:
        a, b = kernels(alice, layout), kernels(bob, layout)
        a.start_job(hold("forgotten", until=NEVER), "job")
        ticket = wait_until(lambda: b.books()["running"], what="alice's claim")[0]["ticket"]
        assert b.books()["can_cancel_any"] is True
        b.run(f"import fluksio_nb\nassert fluksio_nb.accountant().cancel({ticket})", check=True)
        ended = a.run("job.result(30)")
        assert ended.error["ename"] == "ClaimCancelled"
        assert f"stopped by {USER_B}, an admin of this machine" in ended.error["evalue"]


def test_usage_counts_a_users_claims_and_nobody_else_reads_them(users, kernels):
    """Guards against accounting that misses claims, and against the machine's usage
    records telling every user what another user's notebooks ran."""
    alice, bob = users
    with machine(gpus=0) as layout:
        a = kernels(alice, layout)
        for n in range(3):
            a.run(f"%%claim cpus=1 --label r{n}\nx = {n}", check=True)
        files = [p for p in layout.records.iterdir() if p.stat().st_uid == alice.uid]
        assert files and all(p.stat().st_mode & 0o077 == 0 for p in files)
        as_root = json.loads(fluksio_nb("usage", "--dir", str(layout.records), "--json").stdout)
        (row,) = [r for r in as_root["rows"] if r["user"] == USER_A]
        assert row["claims"] == 3
        as_bob = run_as(
            bob,
            "import sys; from fluksio_nb.__main__ import main; "
            f"sys.exit(main(['usage', '--dir', {str(layout.records)!r}, '--json']))",
        )
        assert as_bob.returncode == 0, as_bob.stderr
        seen = json.loads(as_bob.stdout)
        assert [r for r in seen["rows"] if r["user"] == USER_A] == []
        assert seen["skipped_files"] >= len(files)
        # With no --dir, a user's own records on the machine are where they look first.
        as_alice = run_as(
            alice,
            "import sys; from fluksio_nb.__main__ import main; sys.exit(main(['usage', '--json']))",
            env=machine_env(layout),
        )
        assert as_alice.returncode == 0, as_alice.stderr
        (row,) = [r for r in json.loads(as_alice.stdout)["rows"] if r["user"] == USER_A]
        assert row["claims"] == 3


def test_a_killed_kernels_claims_are_recorded_by_the_service_against_its_user_once(users, kernels):
    """Guards against a kernel killed with SIGKILL (the OOM killer, `kill -9`) taking its
    claims' core-hours out of the machine's accounting, since a kernel writes its
    records itself; against those records being charged to root, who wrote them; and
    against a claim the kernel ended itself being counted twice."""
    alice, bob = users
    with machine(gpus=1) as layout:
        a, b = kernels(alice, layout), kernels(bob, layout)
        a.run("%%claim cpus=1 --label fine\nx = 1", check=True)
        b.run("%%claim cpus=1 --label bobs\nx = 1", check=True)
        a.start_job(hold("held", until=NEVER), "held")
        a.start_job("%%claim gpus=1 --background --label queued\nx = 2", "queued")
        assert a.facts("[held.status, queued.status]") == ["running", "waiting"]
        os.kill(a.pid, signal.SIGKILL)

        def died() -> list:
            report = json.loads(fluksio_nb("usage", "--dir", str(layout.records), "--json").stdout)
            return [r for r in report["rows"] if r["endings"].get("kernel died")]

        (row,) = wait_until(died, what="the killed kernel's claims recorded")
        assert (row["user"], row["claims"]) == (USER_A, 3)
        assert row["endings"] == {"ok": 1, "kernel died": 2}, "a claim counted twice"
        report = json.loads(fluksio_nb("usage", "--dir", str(layout.records), "--json").stdout)
        assert {r["user"]: r["claims"] for r in report["users"]} == {USER_A: 3, USER_B: 1}
        assert all(r["user"] != "root" for r in report["rows"]), "charged to the service"
        only_hers = json.loads(
            fluksio_nb("usage", "--dir", str(layout.records), "--user", USER_A, "--json").stdout
        )
        assert [r["claims"] for r in only_hers["users"]] == [3]
        roots = json.loads(
            fluksio_nb("usage", "--dir", str(layout.records), "--user", "root", "--json").stdout
        )
        assert roots["rows"] == []

        # In the service's account of her claims: a file of root's for her alone,
        # private like every records file, holding every claim of hers it saw end.
        (mine,) = [
            p
            for p in layout.records.iterdir()
            if p.stat().st_uid == 0 and p.name.startswith(f"0-books-{alice.uid}-")
        ]
        assert mine.stat().st_mode & 0o077 == 0
        seen = [json.loads(line) for line in mine.read_text().splitlines()]
        assert all(r["uid"] == alice.uid and r["by_service"] for r in seen)
        died_records = [r for r in seen if r["ending"] == "kernel died"]
        assert sorted(r["label"] for r in died_records) == ["held", "queued"]
        held = next(r for r in died_records if r["label"] == "held")
        assert (held["uid"], held["gpus"], held["ending"]) == (alice.uid, [0], "kernel died")
        assert held["granted_at"] < held["ended_at"]
        assert "peak_rss_bytes" not in held, "a peak memory nobody alive knew was made up"

        # Her own, through the service, which reads root's file for her; nobody else's.
        def usage_of(user) -> dict:
            ran = run_as(
                user,
                "import sys; from fluksio_nb.__main__ import main; "
                "sys.exit(main(['usage', '--json']))",
                env=machine_env(layout),
            )
            assert ran.returncode == 0 and not ran.stderr, ran.stderr
            return {r["user"]: r for r in json.loads(ran.stdout)["users"]}

        assert usage_of(alice)[USER_A]["endings"] == {"ok": 1, "kernel died": 2}
        assert USER_A not in usage_of(bob), "another user's killed kernels were shown"
        # And among the finished claims her panel and %claims show.
        finished = (
            "[(c['label'], c['ending']) for c in __import__('fluksio_nb.usage.recent', "
            "fromlist=['_']).process_recent_usage().finished()['claims']]"
        )
        assert sorted(kernels(alice, layout).facts(finished)) == [
            ["fine", "ok"],
            ["held", "kernel died"],
            ["queued", "kernel died"],
        ]
        assert ["held", "kernel died"] not in b.facts(finished)


STRESS = r"""
import json, random, signal, sys, time
from fluksio_nb.kernel import accountant
from fluksio_nb.errors import ClaimTimeout
from fluksio_nb.resources import Resources

armed = False

def interrupt(*_):
    # A timer that fired just as it was disarmed must not hit the cleanup.
    if armed:
        raise KeyboardInterrupt

signal.signal(signal.SIGALRM, interrupt)
random.seed(int(sys.argv[1]))
q = accountant()
counts = {"held": 0, "interrupted": 0, "timed_out": 0}
for n in range(100):
    ticket = None
    armed = True
    try:
        if random.random() < 0.25:
            # The stop button, at a moment nobody chose: asking, waiting or holding.
            signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0005, 0.02))
        ticket = q.enqueue(Resources(cpus=random.choice([1, 1, 2]), gpus=random.choice([0, 1])))
        q.wait(ticket, 20)
        start = time.time()
        time.sleep(random.uniform(0, 0.004))
        end = time.time()
        # The hold is over: what is printed of it is the test's, and an interrupt
        # between a line and its newline would run it into the next one.
        armed = False
        held = ticket.allocation
        said = {"cpus": held.cpus, "gpus": list(held.gpus), "start": start, "end": end}
        print(json.dumps(said), flush=True)
        counts["held"] += 1
    except KeyboardInterrupt:
        counts["interrupted"] += 1
    except ClaimTimeout:
        counts["timed_out"] += 1
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        if ticket is not None:
            q.release(ticket)
print(json.dumps({"done": counts}), flush=True)
"""


def test_many_processes_of_two_users_never_share_a_card_and_the_books_balance(users):
    """Guards against a grant made twice, a claim lost, or a share never given back when
    two users' processes claim at once, are interrupted at random moments, and one
    of them is killed."""
    from fluksio_nb.machine.connection import read_snapshot

    alice, bob = users
    with machine(cpus=4, gpus=2) as layout:
        total_cpus = read_snapshot(layout.socket)["cpus"]["total"]
        procs = [
            subprocess.Popen(
                [*as_user(user), sys.executable, "-c", STRESS, str(seed)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=user_environ(user, machine_env(layout)),
                cwd="/",
            )
            for seed, user in enumerate([alice, bob] * 4)
        ]
        victim = procs[0]
        holds, finished = [], []
        for line in iter(victim.stdout.readline, ""):
            holds.append(json.loads(line))
            if len(holds) == 20:
                victim.kill()
                break
        victim.wait()
        for proc in procs[1:]:
            out, err = proc.communicate(timeout=200)
            assert proc.returncode == 0, err
            lines = [json.loads(line) for line in out.splitlines()]
            finished.append(lines[-1]["done"])
            holds += lines[:-1]
        assert all(sum(c.values()) == 100 for c in finished)
        assert sum(c["held"] for c in finished) > 300

        events = sorted(
            [(h["start"], 1, h) for h in holds] + [(h["end"], -1, h) for h in holds],
            key=lambda e: (e[0], e[1]),
        )
        cards: dict[int, int] = {}
        cpus = 0
        for _, step, held in events:
            cpus += step * held["cpus"]
            assert cpus <= total_cpus
            for card in held["gpus"]:
                cards[card] = cards.get(card, 0) + step
                assert cards[card] <= 1, f"card {card} held twice"

        books = read_snapshot(layout.socket)
        assert books["running"] == [] and books["waiting"] == []
        assert books["cpus"]["free"] == total_cpus and books["gpus"]["free"] == 2


def test_an_admins_cap_holds_its_user_to_it_and_says_which_cap(users, kernels):
    """Guards against a capped user being given more than the admin allowed, and against
    a shrunk or refused claim that does not say which limit applied."""
    alice, bob = users
    with machine(cpus=4, gpus=1, config={"caps": {USER_A: {"cpus": 1}}}) as layout:
        a, b = kernels(alice, layout), kernels(bob, layout)
        clamped = a.run("%%claim cpus=2\nimport os\nn = os.environ['OMP_NUM_THREADS']", check=True)
        assert "ClampedWarning" in clamped.stderr
        assert "fluksio_nb/" not in clamped.stderr, "told at the user's line, not in the package"
        assert f"the cap this machine's admin set for {USER_A} (cpus=1)" in clamped.stderr
        assert a.facts("n") == "1"
        refused = a.run("%%claim cpus=2 --strict\nx = 1")
        assert refused.error["ename"] == "ClaimTooLarge"
        assert USER_A in refused.error["evalue"] and "--strict" in refused.error["evalue"]
        b.run("%%claim cpus=2\nimport os\nn = os.environ['OMP_NUM_THREADS']", check=True)
        assert b.facts("n") == "2"
