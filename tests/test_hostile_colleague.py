"""A hostile second user against the machine's books service, and what they cannot do (#45).

Each test runs a real second Unix user (``useradd``, ``setpriv``) against a
real service started by ``fluksio-nb machine init --prefix``, as the other
tests of shared books do: what one user sends must not break another's
view, what one user writes must not crash, hide or outgrow root's usage
report, a prefix through another user's link must not steer root, and
another user's kernel's pid must not give away its kernel id. CI runs as
root and can make the users; elsewhere the tests skip and say why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fluksio_nb.machine.connection import ask_once, read_snapshot
from tests.machines import (
    fluksio_nb,
    heard,
    kernels_on_books,
    machine,
    machine_env,
    process,
    wait_until,
)
from tests.unix_users import (
    USER_A,
    USER_B,
    as_user,
    owned_tmp_dir,
    ready_user,
    run_as,
    user_environ,
)

pytestmark = pytest.mark.timeout(240)

#: A label, and a notebook, with escape codes and newlines: on a terminal that
#: obeys them, a line that looks like one of the reader's own claims.
FORGED = "\x1b[2J\x1b[H\nrunning  forged (yours): 64 cores\r\x1b]0;owned\x07\u202e"

#: Bob at the socket, as a kernel of his would be if it lied: a claim with
#: the forged label, shared, and then readings no view can show.
POISON = r"""
import json, socket, sys
path, label, readings = sys.argv[1], sys.argv[2], sys.argv[3]
def connect():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    send = lambda m: sock.sendall(json.dumps(m).encode() + b"\n")
    answers = sock.makefile("rb")
    send({"op": "hello", "share_labels": True, "notebook": label, "kernel_id": "k-" + label})
    json.loads(answers.readline())
    send({"op": "claim", "id": 1, "need": {"cpus": 1, "gpus": 0, "ram_bytes": 0}, "label": label})
    return sock, send, answers, json.loads(answers.readline())
held, send, answers, ticket = connect()
# A second claim whose report is poisoned, raw, as written here (NaN, 1e300).
poisoned, psend, panswers, pticket = connect()
poisoned.sendall(
    b'{"op":"report","ticket":%d,"readings":%s}\n' % (pticket["ticket"], readings.encode())
)
told = panswers.readline()
print(json.dumps({"ticket": ticket["ticket"], "after_report": told.decode()}), flush=True)
sys.stdin.readline()
"""

POISONED_READINGS = [
    '{"stopped_since":1e300,"rss_bytes":1}',
    '{"stopped_since":-1e300}',
    '{"stopped_since":NaN,"cpu_percent":Infinity}',
    '{"rss_bytes":1e400,"peak_rss_bytes":-1}',
]


def strict_json(text: str):
    """JSON as a browser's ``JSON.parse`` reads it: no NaN, no Infinity."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} in JSON: JSON.parse refuses it")

    return json.loads(text, parse_constant=refuse)


def forged_lines(text: str) -> list[str]:
    """Lines that a forged label printed raw: escape codes, or a row of its own."""
    return [
        line
        for line in text.splitlines()
        if "\x1b" in line or "\r" in line or line.lstrip().startswith("running  forged")
    ]


@pytest.fixture
def users():
    return ready_user(USER_A), ready_user(USER_B)


def raw_client(user, script: str, *args: str) -> subprocess.Popen:
    """``script`` run as ``user``, talking to the service on its own socket, in pipes."""
    return subprocess.Popen(
        [*as_user(user), sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=user_environ(user),
        cwd="/",
    )


def poison(layout, bob, readings: str) -> subprocess.Popen:
    return raw_client(bob, POISON, str(layout.socket), FORGED, readings)


VIEWS = r"""
import json, sys
from fluksio_nb.__main__ import main
from fluksio_nb.overview import describe_monitor, kernel_snapshot, read_books
from fluksio_nb.shown import json_safe
print("=== fluksio-nb")
main([])
print("=== %claims")
print(describe_monitor(kernel_snapshot()))
print("=== json")
print(json.dumps(json_safe(read_books()), allow_nan=False, default=str))
"""


def test_another_users_poisoned_readings_and_labels_break_none_of_my_views(users):
    """Guards against one user's kernel reporting a `stopped_since` of 1e300, -1e300
    or NaN (or Infinity figures) making every other user's `fluksio-nb` and `%claims`
    raise, and the server's snapshot not JSON; and against a shared label with escape
    codes and newlines printing a line on another user's terminal that looks like
    one of their own claims."""
    alice, bob = users
    with machine(cpus=8, gpus=0) as layout:
        for readings in POISONED_READINGS:
            attacker = poison(layout, bob, readings)
            try:
                said = heard(attacker)
                refused = json.loads(said["after_report"] or "{}")
                assert refused.get("op") == "refused", f"{readings} was taken: {said}"
                ran = run_as(alice, VIEWS, env=machine_env(layout))
                assert ran.returncode == 0, ran.stderr
                assert forged_lines(ran.stdout) == [], ran.stdout
                assert "\\x1b[2J" in ran.stdout, "the shared label was not shown at all"
                strict_json(ran.stdout.split("=== json\n", 1)[1])
            finally:
                attacker.kill()
                attacker.wait()


def test_the_servers_snapshot_and_history_are_strict_json_whatever_another_user_reports(
    users, tmp_path
):
    """Guards against `/fluksio/api/snapshot` answering `NaN` and `Infinity`, which the
    JupyterLab panel's `JSON.parse` refuses, when another user's kernel reports them."""
    from tests.browser.lab import JupyterLab

    _, bob = users
    with machine(cpus=8, gpus=0) as layout:
        attacker = poison(layout, bob, '{"cpu_percent":NaN,"stopped_since":Infinity}')
        lab = None
        try:
            heard(attacker)
            lab = JupyterLab(tmp_path, {}, **machine_env(layout)).start()
            for path in ("fluksio/api/snapshot", "fluksio/api/history", "fluksio/api/finished"):
                with lab.get(path) if hasattr(lab, "get") else _get(lab, path) as text:
                    strict_json(text)
        finally:
            attacker.kill()
            attacker.wait()
            if lab is not None:
                lab.stop()


class _get:
    def __init__(self, lab, path: str) -> None:
        import urllib.request

        request = urllib.request.Request(
            f"{lab.base_url}/{path}", headers={"Authorization": f"token {lab.token}"}
        )
        with urllib.request.urlopen(request, timeout=20) as response:
            self.text = response.read().decode()

    def __enter__(self) -> str:
        return self.text

    def __exit__(self, *_) -> None:
        pass


def record(**fields) -> str:
    base = {"label": "x", "asked_at": 1_700_000_000.0, "ended_at": 1_700_000_060.0}
    return json.dumps({**base, "ending": "ok", **fields})


POISONED_RECORDS = "\n".join(
    [
        record(ended_at=1e300, granted_at=1_700_000_000.0, cpus=4),
        record(asked_at=-1e300),
        '{"label":"x","asked_at":1,"ended_at":2,"ending":"ok","cpus":1' + "0" * 400 + "}",
        '{"label":"x","asked_at":1,"ended_at":2,"ending":"ok","peak_rss_bytes":1' + "0" * 400 + "}",
        '{"label":"x","asked_at":1,"ended_at":NaN,"ending":"ok"}',
        '{"label":"x","asked_at":1,"ended_at":Infinity,"ending":"ok"}',
        '{"label":"cut short by a crash",',
        record(notebook=FORGED, ending=FORGED, cpus=1, granted_at=1_700_000_000.0),
    ]
)


def write_as(user, path: Path, text: str) -> None:
    ran = run_as(user, f"open({str(path)!r}, 'w').write({text!r})")
    assert ran.returncode == 0, ran.stderr


def test_another_users_poisoned_records_neither_crash_nor_forge_roots_usage_report(users):
    """Guards against a records line with times that overflow, or cpus and peaks of
    10**400, crashing root's `fluksio-nb usage` (OverflowError) or making `--json`
    print Infinity; and against a notebook name with newlines and escape codes
    forging rows in root's table. The report says how many lines it skipped and why."""
    _, bob = users
    with machine(cpus=4, gpus=0) as layout:
        write_as(bob, layout.records / f"{bob.uid}-1-poison.jsonl", POISONED_RECORDS)
        table = fluksio_nb("usage", "--dir", str(layout.records))
        assert forged_lines(table.stdout) == [], table.stdout
        assert "7 lines that are not a usage record were skipped" in table.stdout
        assert "out of range" in table.stdout and "not a JSON object" in table.stdout
        report = strict_json(fluksio_nb("usage", "--dir", str(layout.records), "--json").stdout)
        assert report["bad_lines"] == 7 and sum(report["bad_reasons"].values()) == 7
        (row,) = report["rows"]
        assert (row["user"], row["notebook"], row["claims"]) == (USER_B, FORGED, 1)


def test_a_records_file_past_any_read_limit_is_read_to_its_end(users):
    """Guards against root's report reading only the first 64 MiB of a file and
    saying nothing of the rest, so that a claim recorded after another user's
    padding was silently not counted."""
    _, bob = users
    with machine(cpus=4, gpus=0) as layout:
        padding = " " * (65 * 2**20)
        script = (
            f"f = open({str(layout.records / f'{bob.uid}-2-big.jsonl')!r}, 'w')\n"
            f"f.write({padding[:16]!r} * {len(padding) // 16} + '\\n')\n"
            f"f.write({record(label='after', cpus=2, granted_at=1_700_000_000.0)!r} + '\\n')\n"
        )
        ran = run_as(bob, script)
        assert ran.returncode == 0, ran.stderr
        report = strict_json(fluksio_nb("usage", "--dir", str(layout.records), "--json").stdout)
        assert [(r["user"], r["claims"]) for r in report["users"]] == [(USER_B, 1)]
        assert report["bad_reasons"] == {"longer than any record": 1}
        assert report["files_cut"] == 0


HOLD_AND_WAIT = """
t = q.enqueue(Resources(cpus=1), label="held")
q.wait(t, timeout=30)
say(ticket=t.number)
sys.stdin.readline()
"""


def test_one_users_flood_of_killed_claims_pushes_no_one_elses_out_and_is_bounded(users):
    """Guards against the service writing every user's killed kernels' records into
    one file of root's without limit, where one user's 74 MiB of them pushed another
    user's later killed claim out of root's report: each user's account is a file of
    its own, rotated by size, and the report reads every rotated file kept."""
    alice, bob = users
    config = {"records_rotate_bytes": 8192, "records_kept": 2}
    with machine(cpus=4, gpus=0, config=config) as layout:
        flood = process(
            layout,
            """
            tickets = [q.enqueue(Resources(cpus=1), label="flood") for _ in range(300)]
            say(n=len(tickets))
            sys.stdin.readline()
            """,
            user=bob,
        )
        assert heard(flood)["n"] == 300
        flood.kill()
        flood.wait()
        hers = process(layout, HOLD_AND_WAIT, user=alice)
        heard(hers)
        hers.kill()
        hers.wait()

        def roots_report() -> dict:
            return strict_json(fluksio_nb("usage", "--dir", str(layout.records), "--json").stdout)

        def hers_counted() -> list:
            return [u for u in roots_report()["users"] if u["user"] == USER_A]

        (counted,) = wait_until(hers_counted, what="alice's killed claim in root's report")
        assert counted["endings"] == {"kernel died": 1}
        bobs_files = [
            p
            for p in layout.records.iterdir()
            if p.stat().st_uid == 0 and p.name.startswith(f"0-books-{bob.uid}-")
        ]
        assert 1 < len(bobs_files) <= 3, "bob's account was not rotated, or not pruned"
        assert all(p.stat().st_size < 8192 + 4096 for p in bobs_files)
        assert all(p.stat().st_mode & 0o077 == 0 for p in bobs_files)


def test_deleting_or_editing_ones_own_records_changes_no_claims_in_roots_report(users):
    """Guards against a user deleting their own records files taking their claims
    in root's report from 3 to 0, and against a made-up record adding core-hours:
    root's report counts each claim as the books service saw it."""
    alice, _ = users
    with machine(cpus=4, gpus=0) as layout:
        three = process(
            layout,
            """
            from fluksio_nb import claim
            for n in range(3):
                with claim(cpus=1, label=f"r{n}"):
                    pass
            say(done=True)
            """,
            user=alice,
        )
        assert heard(three) == {"done": True}
        three.wait(30)
        mine = [p for p in layout.records.iterdir() if p.stat().st_uid == alice.uid]
        assert mine, "alice's kernel wrote no records of its own to delete"
        ran = run_as(
            alice,
            "import os, sys\n"
            f"d = {str(layout.records)!r}\n"
            "for n in os.listdir(d):\n"
            "    p = os.path.join(d, n)\n"
            "    if os.stat(p).st_uid == os.getuid(): os.unlink(p)\n"
            f"open(os.path.join(d, '{alice.uid}-9-forged.jsonl'), 'w').write({FORGED_CLAIM!r})\n",
        )
        assert ran.returncode == 0, ran.stderr
        report = strict_json(fluksio_nb("usage", "--dir", str(layout.records), "--json").stdout)
        (hers,) = [u for u in report["users"] if u["user"] == USER_A]
        assert hers["claims"] == 3
        assert hers["core_hours"] < 1, "a made-up record was counted"
        assert report["not_seen_by_service"] == 1


#: A claim of 64 cores for 100 hours that the books never granted.
FORGED_CLAIM = record(cpus=64, asked_at=2e9, granted_at=2e9, ended_at=2e9 + 360_000)


def link_of(user, target: Path) -> Path:
    """A symbolic link in /tmp, made and owned by ``user``, to ``target``."""
    name = Path(tempfile.mktemp(prefix="fluksio-link-", dir="/tmp"))
    ran = run_as(user, f"import os; os.symlink({str(target)!r}, {str(name)!r})")
    assert ran.returncode == 0, ran.stderr
    return name


def test_init_refuses_a_prefix_through_another_users_link(users):
    """Guards against `init --prefix /tmp/L/machine` being accepted when /tmp/L is
    another user's link, because the checks resolved the link away: its owner could
    point it elsewhere once root has checked it."""
    _, bob = users
    with machine(cpus=2, gpus=0) as elsewhere:
        link = link_of(bob, elsewhere.prefix)
        try:
            ran = fluksio_nb("machine", "init", "--prefix", str(link / "machine"), check=False)
            assert ran.returncode == 2, ran.stdout
            assert "symbolic link" in ran.stderr
            assert not (elsewhere.prefix / "machine").exists()
        finally:
            link.unlink()


def test_remove_through_another_users_link_removes_and_stops_nothing(users):
    """Guards against root's `machine remove --prefix /tmp/L` following another user's
    link to books root set up elsewhere, deleting their run directory and stopping
    their service."""
    _, bob = users
    with machine(cpus=2, gpus=0) as victim:
        link = link_of(bob, victim.prefix)
        try:
            ran = fluksio_nb("machine", "remove", "--prefix", str(link), check=False)
            assert ran.returncode == 2
            assert "symbolic link" in ran.stderr
            assert victim.marker.exists() and victim.config.exists()
            from fluksio_nb.machine.setup import answering

            assert answering(victim), "the service behind the link was stopped"
        finally:
            link.unlink()


def test_another_users_claim_shows_no_pid_but_my_own_and_roots_view_do(users):
    """Guards against the pid of another user's kernel giving away its kernel id,
    through /proc/<pid>/cmdline, which the snapshot otherwise hides."""
    alice, bob = users
    with machine(cpus=4, gpus=0) as layout:
        hers = process(layout, HOLD_AND_WAIT, user=alice)
        heard(hers)
        try:
            look = "import json; from fluksio_nb.overview import read_books\n" + (
                "print(json.dumps([(c['user'], c['pid']) for c in read_books()['running']]))"
            )
            seen_by_bob = json.loads(run_as(bob, look, env=machine_env(layout)).stdout)
            assert seen_by_bob == [[USER_A, None]]
            seen_by_her = json.loads(run_as(alice, look, env=machine_env(layout)).stdout)
            assert seen_by_her == [[USER_A, hers.pid]]
            as_root = subprocess.run(
                [sys.executable, "-c", look],
                capture_output=True,
                text=True,
                env={**os.environ, **machine_env(layout)},
            )
            assert json.loads(as_root.stdout) == [[USER_A, hers.pid]]
        finally:
            hers.send_signal(signal.SIGKILL)
            hers.wait()


# -----------------------------------------------------------------------------
# A restart, and an admin's cancel: nothing another user can take, or keep
# -----------------------------------------------------------------------------

HOLD_A_CARD = """
t = q.enqueue(Resources(cpus=1, gpus=1), "hers"); q.wait(t, 30)
say(ticket=t.number, gpus=list(t.allocation.gpus))
sys.stdin.readline()
say(cancelled=t.cancelled, ticket=t.number)
q.release(t)
"""

#: Bob, who read Alice's share in a snapshot, watching the socket through a
#: restart to put it back as his own before her kernel does: as the protocol
#: had it, and with her ticket number and a guessed secret.
STEAL_AT_THE_RESTART = r"""
import json, socket, sys, time
path = sys.argv[1]
def ask(*requests):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    answers = sock.makefile("rb")
    sock.sendall(b'{"op":"hello"}\n')
    json.loads(answers.readline())
    said = []
    for n, request in enumerate(requests, start=1):
        sock.sendall((json.dumps({**request, "id": n}) + "\n").encode())
        said.append(json.loads(answers.readline()))
    return sock, said
_, (seen,) = ask({"op": "snapshot"})
(hers,) = seen["snapshot"]["running"]
share = {"op": "restore", "label": "mine now", **hers["allocation"]}
guessed = {**share, "ticket": hers["ticket"], "secret": "0" * 32}
print(json.dumps({"ready": hers["ticket"]}), flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        held, said = ask(share, guessed)
    except (OSError, ValueError):
        time.sleep(0.002)  # between the two services
        continue
    if said[0].get("message") != "a claim is put back only while the service restarts":
        print(json.dumps(said), flush=True)
        sys.stdin.readline()  # held, if it was taken
        break
    held.close()
    time.sleep(0.002)
"""


def test_after_a_restart_only_the_owners_kernel_puts_a_share_back(users):
    """Guards against any user "putting back" a share they read in a snapshot during
    the grace after a restart, before its owner's kernel reconnects, so that the
    owner's running cell ends with `ClaimCancelled ... what this claim held is taken`;
    and against the owner's own restore being refused, or renumbered."""
    alice, bob = users
    with machine(cpus=2, gpus=1) as layout:
        hers = process(layout, HOLD_A_CARD, user=alice)
        held = heard(hers)
        assert held["gpus"] == [0]
        thief = raw_client(bob, STEAL_AT_THE_RESTART, str(layout.socket))
        try:
            assert heard(thief) == {"ready": held["ticket"]}
            # Her kernel stopped through the restart: the thief is surely first.
            hers.send_signal(signal.SIGSTOP)
            fluksio_nb("machine", "init", "--prefix", str(layout.prefix), "--gpus", "1")
            tried = json.loads(thief.stdout.readline() or "null")
            assert tried is not None, thief.stderr.read()
            assert [answer["op"] for answer in tried] == ["error", "error"], tried
            assert all("only the kernel that held" in answer["message"] for answer in tried)
            hers.send_signal(signal.SIGCONT)

            def hers_back() -> list:
                running = read_snapshot(layout.socket)["running"]
                return [(c["user"], c["ticket"], c["allocation"]["gpus"]) for c in running]

            assert wait_until(hers_back, what="alice's share put back") == [
                (USER_A, held["ticket"], [0])
            ]
            hers.stdin.write("\n")
            hers.stdin.flush()
            assert heard(hers) == {"cancelled": None, "ticket": held["ticket"]}
        finally:
            for proc in (thief, hers):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()


CLAIM_THREE_HOLD_ONE = """
done = []
for _ in range(3):
    t = q.enqueue(Resources(cpus=1), "done"); q.wait(t, 30); q.release(t); done.append(t.number)
t = q.enqueue(Resources(cpus=1), "held"); q.wait(t, 30)
say(done=done, held=t.number)
sys.stdin.readline()
say(held=t.number, cancelled=t.cancelled)
"""

ONE_CLAIM = """
t = q.enqueue(Resources(cpus=1), "after"); q.wait(t, 30)
say(ticket=t.number)
q.release(t)
"""


def test_ticket_numbers_are_never_given_out_again_after_a_restart(users):
    """Guards against the service numbering claims from 1 again after a restart, so
    that a number an admin read before it (to cancel, say) names another user's
    claim after it."""
    alice, bob = users
    with machine(cpus=4, gpus=0) as layout:
        hers = process(layout, CLAIM_THREE_HOLD_ONE, user=alice)
        try:
            before = heard(hers)
            read_before = [*before["done"], before["held"]]
            fluksio_nb("machine", "init", "--prefix", str(layout.prefix), "--gpus", "0")
            wait_until(
                lambda: (
                    [c["ticket"] for c in read_snapshot(layout.socket)["running"]]
                    == [before["held"]]
                ),
                what="alice's claim put back under its number",
            )
            his = process(layout, ONE_CLAIM, user=bob)
            after = heard(his)["ticket"]
            his.wait(30)
            assert after not in read_before and after > max(read_before)
            for number in before["done"]:
                stale = ask_once(layout.socket, {"op": "cancel", "ticket": number, "reason": "x"})
                assert (stale["op"], stale["found"]) == ("ok", False), stale
            hers.stdin.write("\n")
            hers.stdin.flush()
            assert heard(hers) == {"held": before["held"], "cancelled": None}
        finally:
            hers.kill()
            hers.wait()


ADMINS = "fluksio-test-admins"


@pytest.fixture
def bob_is_an_admin(users):
    _, bob = users
    subprocess.run(["groupadd", "-f", ADMINS], check=True)
    subprocess.run(["usermod", "-aG", ADMINS, bob.name], check=True)
    return {"admin_group": ADMINS}


def cancel_as(user, layout, ticket: int) -> float:
    """``user`` cancels claim ``ticket`` from a terminal; when the service said it found it."""
    ran = run_as(
        user,
        "import json, time\nfrom fluksio_nb.machine.connection import ask_once\n"
        f"said = ask_once({str(layout.socket)!r}, "
        f"{{'op': 'cancel', 'ticket': {ticket}, 'reason': 'card needed'}})\n"
        "print(json.dumps([said, time.time()]))",
    )
    assert ran.returncode == 0, ran.stderr
    said, at = json.loads(ran.stdout)
    assert said.get("found") is True, said
    return at


WAIT_FOR_THE_CARD = """
t = q.enqueue(Resources(cpus=1, gpus=1), "next")
say(state=t.state)
q.wait(t, 15)
say(granted_at=time.time())
q.release(t)
"""

#: Alice's kernel as it would be if it ignored the service: it holds the card
#: and never reads a line again. Given pids, it first starts a process for the
#: claim and says so, with those pids besides, which are not its claim's.
IGNORE_THE_STOP = r"""
import json, socket, subprocess, sys
path, others = sys.argv[1], json.loads(sys.argv[2])
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(path)
answers = sock.makefile("rb")
send = lambda m: sock.sendall((json.dumps(m) + "\n").encode())
send({"op": "hello"})
json.loads(answers.readline())
send({"op": "claim", "id": 1, "need": {"cpus": 1, "gpus": 1, "ram_bytes": 0}, "label": "mine"})
ticket = json.loads(answers.readline())
child = None
if others is not None:
    child = subprocess.Popen(["sleep", "600"])
    send({"op": "processes", "ticket": ticket["ticket"], "pids": [child.pid, *others]})
said = {"ticket": ticket["ticket"], "gpus": ticket.get("gpus"), "child": child and child.pid}
print(json.dumps(said), flush=True)
sys.stdin.readline()
"""


def gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def ignoring_the_stop(layout, alice, others: list[int] | None) -> subprocess.Popen:
    return raw_client(alice, IGNORE_THE_STOP, str(layout.socket), json.dumps(others))


def test_an_admins_cancel_frees_a_card_whose_holder_ignores_the_stop_within_5_s(
    users, bob_is_an_admin
):
    """Guards against an admin's cancel answering `found: true` and freeing nothing while
    the holder's kernel ignores the stop, so that the next claim timed out."""
    alice, bob = users
    with machine(cpus=4, gpus=1, config=bob_is_an_admin) as layout:
        holder, waiter = ignoring_the_stop(layout, alice, None), None
        try:
            held = heard(holder)
            assert held["gpus"] == [0]
            waiter = process(layout, WAIT_FOR_THE_CARD, user=bob)
            assert heard(waiter) == {"state": "waiting"}
            cancelled_at = cancel_as(bob, layout, held["ticket"])
            granted_at = heard(waiter)["granted_at"]
            assert granted_at - cancelled_at < 5.0
            assert holder.poll() is None, "the holder's own process was killed"
        finally:
            for proc in (holder, waiter):
                if proc is not None:
                    proc.kill()
                    proc.wait()


def test_an_admins_cancel_kills_the_claims_reported_process_and_no_pid_that_is_not_its(
    users, bob_is_an_admin
):
    """Guards against the service, carrying out an admin's cancel, leaving the claim's
    process running on the card, or killing a pid the holder named that is not its
    claim's: another user's process, or one of the holder's own not started below
    the kernel that holds the claim."""
    alice, bob = users
    with machine(cpus=4, gpus=1, config=bob_is_an_admin) as layout:
        bystander = subprocess.Popen([*as_user(bob), "sleep", "600"])
        hers_elsewhere = subprocess.Popen([*as_user(alice), "sleep", "600"])
        holder = ignoring_the_stop(layout, alice, [bystander.pid, hers_elsewhere.pid])
        try:
            held = heard(holder)
            cancel_as(bob, layout, held["ticket"])
            wait_until(lambda: gone(held["child"]), timeout=5, what="the claim's process killed")
            assert read_snapshot(layout.socket)["gpus"]["free"] == 1
            assert bystander.poll() is None and hers_elsewhere.poll() is None
            assert holder.poll() is None, "the holder's own process was killed"
        finally:
            for proc in (holder, bystander, hers_elsewhere):
                proc.kill()
                proc.wait()


def test_an_admins_cancel_of_a_stopped_kernels_claim_frees_it_and_the_cell_says_who(
    users, bob_is_an_admin
):
    """Guards against a holder stopped with SIGSTOP keeping its card after an admin's
    cancel until someone kills it (which a non-root admin cannot): the service kills
    the claim's worker and frees the card within 5 s, and the owner's cell, once its
    kernel runs again, says which admin stopped it."""
    from tests.kernels import until_it_exists

    alice, bob = users
    with (
        machine(cpus=4, gpus=1, config=bob_is_an_admin) as layout,
        kernels_on_books() as kernels,
        owned_tmp_dir(alice) as hers,
    ):
        a = kernels(alice, layout)
        said_pid = hers / "worker.pid"
        a.start_job(
            "%%claim gpus=1 --background --label stopped\nimport os\n"
            f"open({str(said_pid)!r}, 'w').write(str(os.getpid()))\n"
            + until_it_exists(Path("/nonexistent")),
            "job",
        )
        worker = int(wait_until(lambda: said_pid.exists() and said_pid.read_text(), what="pid"))
        (claim,) = read_snapshot(layout.socket)["running"]
        waiter = process(layout, WAIT_FOR_THE_CARD, user=bob)
        try:
            assert heard(waiter) == {"state": "waiting"}
            os.kill(a.pid, signal.SIGSTOP)
            cancelled_at = cancel_as(bob, layout, claim["ticket"])
            granted_at = heard(waiter)["granted_at"]
            assert granted_at - cancelled_at < 5.0
            wait_until(lambda: gone(worker), timeout=5, what="the stopped claim's worker killed")
        finally:
            os.kill(a.pid, signal.SIGCONT)
            waiter.kill()
            waiter.wait()
        ended = a.run("job.result(30)")
        assert ended.error["ename"] == "ClaimCancelled", ended.error
        assert f"stopped by {USER_B}, an admin of this machine" in ended.error["evalue"]
