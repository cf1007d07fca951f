"""The machine's books service, as processes that do not trust each other use it.

Everything here runs the real service, started by ``fluksio-nb machine init``
as an admin would, and real processes talking to it. The failures guarded
against are the ones a shared machine has: a holder that dies without a
word, a client that sends garbage or stops reading, a service that restarts
under running claims.
"""

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from contextlib import contextmanager

import pytest

from fluksio_nb.identity import process_started
from fluksio_nb.machine import protocol
from fluksio_nb.machine.service import DEATHS_DUTY
from tests.machines import fluksio_nb, heard, machine, process, wait_until
from tests.stops import STOP_AT, STOP_AT_EVERY_MOMENT_OF_A_CLAIM

pytestmark = pytest.mark.timeout(120)

HOLD_A_CARD = """
t = q.enqueue(Resources(gpus=1), "holder"); q.wait(t)
say(gpus=list(t.allocation.gpus))
sys.stdin.readline()
q.release(t)
say(released=True)
"""

WAIT_FOR_A_CARD = """
t = q.enqueue(Resources(gpus=1), "waiter")
say(state=t.state)
q.wait(t, 60)
say(gpus=list(t.allocation.gpus), at=time.time())
q.release(t)
"""


def snapshot(layout) -> dict:
    from fluksio_nb.machine.connection import read_snapshot

    return read_snapshot(layout.socket)


def test_init_sets_up_books_that_status_names_and_remove_takes_down(monkeypatch):
    """Guards against an admin's init leaving kernels on their own books, or remove
    leaving a service behind."""
    monkeypatch.delenv("FLUKSIO_LEDGER")
    with machine() as layout:
        said = fluksio_nb("machine", "status", "--prefix", str(layout.prefix)).stdout
        assert "books shared by every user" in said and str(layout.run_dir) in said
        pid = int(layout.pidfile.read_text())
        assert os.stat(layout.socket).st_uid == 0
        assert oct(os.stat(layout.records).st_mode & 0o7777) == "0o1777"
    wait_until(lambda: process_started(pid) is None, what="the service's end")
    said = fluksio_nb("machine", "status", "--prefix", str(layout.prefix)).stdout
    assert "books of this user's own kernels" in said
    assert "fluksio-nb machine init" in said


def test_the_service_answers_ahead_of_the_kernels_that_ask_it():
    """Guards against a service that waits for a time slice behind every busy kernel
    on a machine whose cores are all taken, which is when claims matter."""
    import psutil

    from fluksio_nb.machine.setup import SERVICE_NICENESS

    with machine() as layout:
        service = psutil.Process(int(layout.pidfile.read_text()))
        assert service.nice() == SERVICE_NICENESS < psutil.Process().nice()


def test_the_service_may_hold_every_users_connections_at_once():
    """Guards against a service left at the usual soft limit of 1024 descriptors, which
    two users' 512 connections each would fill, so that nobody else could connect."""
    import resource

    import psutil

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Started as a login shell's admin would start it: with the usual soft limit.
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        with machine() as layout:
            service = psutil.Process(int(layout.pidfile.read_text()))
            assert service.rlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_init_refuses_to_run_as_anyone_but_root():
    """Guards against a user's init seeming to set up books nobody else will trust."""
    from tests.unix_users import USER_A, require_unix_users, run_as, unix_user

    require_unix_users()
    ran = run_as(
        unix_user(USER_A),
        "import sys; from fluksio_nb.__main__ import main; "
        "sys.exit(main(['machine', 'init', '--prefix', '/tmp/nope']))",
    )
    assert ran.returncode == 2
    assert "runs as root: sudo fluksio-nb machine init" in ran.stderr


def test_a_killed_holders_card_goes_to_the_waiter_at_once():
    """Guards against a kernel killed with SIGKILL keeping its card until somebody notices."""
    with machine(gpus=1) as layout:
        holder = process(layout, HOLD_A_CARD)
        assert heard(holder) == {"gpus": [0]}
        waiter = process(layout, WAIT_FOR_A_CARD)
        assert heard(waiter) == {"state": "waiting"}
        killed_at = time.time()
        holder.kill()
        granted = heard(waiter)
        assert granted["gpus"] == [0]
        assert granted["at"] - killed_at < 2.0
        waiter.wait(10)


def raw_connection(layout) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(layout.socket))
    sock.sendall(protocol.line({"op": "hello"}))
    return sock


def test_a_bad_line_ends_only_the_connection_that_sent_it():
    """Guards against one malformed request (a string for cpus, a negative card count,
    a huge number, an unknown operation) breaking the books for everyone."""
    with machine(cpus=4, gpus=1) as layout:
        holder = process(layout, HOLD_A_CARD)
        assert heard(holder) == {"gpus": [0]}
        bad_lines = [
            b"not json\n",
            protocol.line(
                {
                    "op": "claim",
                    "id": 1,
                    "need": {"cpus": "2", "gpus": 0, "ram_bytes": 0},
                    "label": "x",
                }
            ),
            protocol.line(
                {
                    "op": "claim",
                    "id": 1,
                    "need": {"cpus": 1, "gpus": -1, "ram_bytes": 0},
                    "label": "x",
                }
            ),
            protocol.line(
                {
                    "op": "claim",
                    "id": 1,
                    "need": {"cpus": 10**9, "gpus": 0, "ram_bytes": 0},
                    "label": "x",
                }
            ),
            # A claim of nothing fits however full the machine is: as many as one likes.
            protocol.line(
                {
                    "op": "claim",
                    "id": 1,
                    "need": {"cpus": 0, "gpus": 0, "ram_bytes": 0},
                    "label": "x",
                }
            ),
            # Readings go into every reader's snapshot: a few short figures, no more.
            protocol.line(
                {"op": "report", "ticket": 1, "readings": {f"r{n}": n for n in range(1000)}}
            ),
            protocol.line({"op": "release", "id": 1, "ticket": 1, "extra": "field"}),
            protocol.line({"op": "become", "id": 1, "uid": 0}),
            b"{" + b" " * (protocol.MAX_LINE_BYTES + 10) + b"\n",
        ]
        for bad in bad_lines:
            sock = raw_connection(layout)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                # A line too long is refused as soon as it is longer than any
                # request, before the rest is sent: the refusal is there to read.
                sock.sendall(bad)
            sock.settimeout(10)
            answers = b""
            # A service that closes with part of a line unread resets the
            # connection: what it wrote before is read first, then the reset.
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 16):
                    answers += chunk
            assert b"refused" in answers or b'"op":"error"' in answers, bad[:80]
            sock.close()
        books = snapshot(layout)
        assert [c["label"] for c in books["running"]] == ["holder"]
        assert books["cpus"]["free"] == books["cpus"]["total"] - 1 == 2
        assert books["gpus"]["free"] == 0
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert heard(holder) == {"released": True}


def test_a_client_that_stops_reading_is_dropped_and_stalls_nobody():
    """Guards against a process that floods requests and never reads the answers
    blocking the service for every other kernel."""
    with machine(cpus=2, gpus=0) as layout:
        flooder = raw_connection(layout)
        request = protocol.line({"op": "snapshot", "id": 1})
        flooder.setblocking(False)
        sent, dropped = 0, False
        other = process(
            layout,
            """
            for _ in range(50):
                t = q.enqueue(Resources(cpus=1), "busy"); q.wait(t, 10); q.release(t)
            say(done=True)
            """,
        )
        deadline = time.monotonic() + 60
        while not dropped and time.monotonic() < deadline:
            try:
                sent += flooder.send(request * 64)
            except BlockingIOError:
                time.sleep(0.01)
            except (BrokenPipeError, ConnectionResetError):
                dropped = True
        assert dropped, f"the flooder was never dropped ({sent} bytes sent)"
        assert heard(other) == {"done": True}
        books = snapshot(layout)
        assert books["cpus"]["free"] == books["cpus"]["total"]


def test_claims_survive_the_service_restarting(monkeypatch):
    """Guards against an admin's restart (init run again after a config change) freeing
    every running claim, so that a second kernel is granted a card the first still
    computes on, or dropping the claims that were waiting."""
    with machine(gpus=1) as layout:
        holder = process(layout, HOLD_A_CARD)
        assert heard(holder) == {"gpus": [0]}
        waiter = process(layout, WAIT_FOR_A_CARD)
        assert heard(waiter) == {"state": "waiting"}
        first = int(layout.pidfile.read_text())
        fluksio_nb("machine", "init", "--prefix", str(layout.prefix), "--gpus", "1")
        assert int(layout.pidfile.read_text()) != first
        books = wait_until(
            lambda: (b := snapshot(layout))["running"] and b["waiting"] and b,
            timeout=60,
            what="both claims put back",
        )
        assert [(c["label"], c["allocation"]["gpus"]) for c in books["running"]] == [
            ("holder", [0])
        ]
        assert [c["label"] for c in books["waiting"]] == ["waiter"]
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert heard(holder) == {"released": True}
        assert heard(waiter)["gpus"] == [0]


def test_a_claim_put_back_after_a_restart_is_recorded_once_when_its_holder_is_killed():
    """Guards against the service's restart, which closes every connection, read as
    every kernel dying (a record for each claim that goes on running), and against
    a claim put back after it going unrecorded when its holder is then killed."""
    with machine(gpus=1) as layout:
        holder = process(layout, HOLD_A_CARD)
        assert heard(holder) == {"gpus": [0]}
        waiter = process(layout, WAIT_FOR_A_CARD)
        assert heard(waiter) == {"state": "waiting"}
        fluksio_nb("machine", "init", "--prefix", str(layout.prefix), "--gpus", "1")
        wait_until(
            lambda: (b := snapshot(layout))["running"] and b["waiting"],
            timeout=60,
            what="both claims put back",
        )
        holder.kill()
        holder.wait(10)
        assert heard(waiter)["gpus"] == [0]
        waiter.wait(10)

        def records() -> list:
            return [
                json.loads(line)
                for path in layout.records.iterdir()
                for line in path.read_text().splitlines()
            ]

        wait_until(
            lambda: any(r["label"] == "holder" for r in records()),
            what="the killed holder's claim recorded",
        )
        found = records()
        # The service's own account records every claim it saw end, the
        # waiter's release too: what must not be there is a death the
        # restart made up, or the holder twice.
        died = [(r["label"], r["ending"], r["gpus"]) for r in found if r["ending"] == "kernel died"]
        assert died == [("holder", "kernel died", [0])], "the restart left a record of a death"
        assert [r["label"] for r in found].count("holder") == 1, "the holder recorded once"


def test_a_kernel_on_a_machine_whose_service_is_down_says_so():
    """Guards against a kernel silently keeping books of its own, which nobody else
    sees, while the machine's service is down."""
    with machine() as layout:
        os.kill(int(layout.pidfile.read_text()), signal.SIGTERM)
        wait_until(lambda: not layout.socket.exists(), what="the service's end")
        orphan = process(layout, "say(got=1)")
        orphan.wait(30)
        error = orphan.stderr.read()
        assert "ServiceUnavailable" in error
        assert "does not answer" in error and "fluksio-nb machine status" in error


# -----------------------------------------------------------------------------
# A restore: only while the service restarts, and never past the queue or a cap
# -----------------------------------------------------------------------------


@contextmanager
def service_here(
    tmp_path, *, cpus=4, gpus=2, caps=None, restarting=False, read_deaths=None, held_before=()
):
    """The service's own code on a socket of this test's, in a thread of its own:
    what ``restarting`` keeps it in (a restart's grace) lasts until the test ends,
    with ``held_before`` the claims the service before it wrote down."""
    from fluksio_nb.machine.books import MachineBooks
    from fluksio_nb.machine.service import BooksService, Connection

    path = tmp_path / "books.sock"
    service = BooksService(
        MachineBooks(cpus, range(gpus), 0),
        caps=caps,
        records=str(tmp_path),
        read_deaths=read_deaths,
    )
    service.held_before = {claim.ticket: claim for claim in held_before}
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stopping = asyncio.Event()

    async def serve() -> None:
        server = await loop.create_unix_server(lambda: Connection(service), path=str(path))
        if restarting:
            service.hold_grants(3600)
        ready.set()
        async with server:
            await stopping.wait()
            # As the service's own end does: from Python 3.12 a server's
            # close waits for every connection to end.
            for connection in list(service.connections):
                connection.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield path
    finally:
        loop.call_soon_threadsafe(stopping.set)
        thread.join(30)
        loop.close()


class Client:
    """A process's connection to the service, line by line, as a hostile one would use it."""

    def __init__(self, path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(str(path))
        self.file = self.sock.makefile("rb")
        self.ids = iter(range(1, 1 << 30))
        self.sock.sendall(protocol.line({"op": "hello"}))
        assert json.loads(self.file.readline())["op"] == "welcome"

    def ask(self, **request) -> dict:
        number = next(self.ids)
        self.sock.sendall(protocol.line({**request, "id": number}))
        while (answer := json.loads(self.file.readline())).get("id") != number:
            pass
        return answer

    def restore(self, cpus=1, gpus=(), cores=(), ticket=None, secret=None) -> dict:
        return self.ask(
            op="restore",
            label="r",
            cpus=cpus,
            gpus=list(gpus),
            ram_bytes=0,
            cores=list(cores),
            ticket=ticket,
            secret=secret,
        )

    def books(self) -> dict:
        return self.ask(op="snapshot")["snapshot"]


def held_claim(ticket, gpus=(), cores=(), uid=None, secret="s"):
    """A running claim as the service before wrote it down: of this test's user by default."""
    from fluksio_nb.machine.state import HeldClaim, digest

    return HeldClaim(
        ticket=ticket,
        uid=os.getuid() if uid is None else uid,
        secret_sha256=digest(secret),
        label="r",
        cpus=1,
        gpus=list(gpus),
        ram_bytes=0,
        cores=list(cores),
    )


def test_a_restore_outside_a_restart_is_refused_and_jumps_no_queue(tmp_path):
    """Guards against a client sending "restore" at any time to take what the head of
    the queue is waiting for, past everyone who waits."""
    with service_here(tmp_path, cpus=2, gpus=0) as path:
        holder, waiter, jumper = Client(path), Client(path), Client(path)
        assert "granted_at" in holder.ask(
            op="claim", need={"cpus": 1, "gpus": 0, "ram_bytes": 0}, label="h"
        )
        assert "granted_at" not in waiter.ask(
            op="claim", need={"cpus": 2, "gpus": 0, "ram_bytes": 0}, label="w"
        )

        refused = jumper.restore(cpus=1)
        assert refused == {
            "op": "error",
            "id": refused["id"],
            "message": "a claim is put back only while the service restarts",
        }
        books = jumper.books()
        assert [c["label"] for c in books["running"]] == ["h"] and books["cpus"]["free"] == 1
        assert len(books["waiting"]) == 1


def test_a_claim_made_while_the_service_restarts_waits_on_a_free_machine_and_says_until_when(
    tmp_path,
):
    """Guards against a claim held back by a restart's grace showing no reason, or a
    wrong one, while the whole machine is free; and against a service past its grace
    still saying it holds grants."""
    from fluksio_nb.expected_wait import describe_wait, expected_waits

    with service_here(tmp_path, cpus=2, gpus=0, restarting=True) as path:
        kernel = Client(path)
        asked = kernel.ask(op="claim", need={"cpus": 1, "gpus": 0, "ram_bytes": 0}, label="w")
        assert asked["op"] == "ticket" and "granted_at" not in asked
        books = kernel.books()
        assert books["cpus"]["free"] == 2 and len(books["waiting"]) == 1
        assert 3500 < books["grants_resume_at"] - time.time() <= 3600
        (guess,) = expected_waits(books, {})
        assert describe_wait(guess).startswith(
            "expected to start in about 1 h (the machine's books service has just restarted"
        )
    with service_here(tmp_path, cpus=2, gpus=0) as path:
        assert "grants_resume_at" not in Client(path).books()


def test_reading_killed_kernels_records_keeps_the_service_answering_claims(tmp_path):
    """Guards against a user who asks for their killed kernels' records again and again
    taking the service's time (and its GIL) from the claims of everyone: one read at a
    time, on a thread, and after a read that took a second, none for nine more."""
    reading, go_on = threading.Event(), threading.Event()

    read_s = 1.0

    def a_read_of_a_second(directory, uid, since, most):
        reading.set()
        go_on.wait(60)
        time.sleep(read_s)  # how long this read takes: the rest is the service's
        return [], 0

    with service_here(tmp_path, cpus=2, gpus=0, read_deaths=a_read_of_a_second) as path:
        first, second = Client(path), Client(path)
        asked = time.monotonic()
        first.sock.sendall(protocol.line({"op": "kernel_deaths", "id": 7}))
        assert reading.wait(30)
        busy = second.ask(op="kernel_deaths")
        assert busy["op"] == "error" and busy["retry_in"] == 1.0, busy
        claimed = second.ask(op="claim", need={"cpus": 1, "gpus": 0, "ram_bytes": 0}, label="c")
        assert "granted_at" in claimed, "a claim waited for the read"
        go_on.set()
        assert json.loads(first.file.readline()) == {
            "op": "kernel_deaths",
            "id": 7,
            "records": [],
            "more": 0,
        }
        answered = time.monotonic()
        soon = second.ask(op="kernel_deaths")
        # The service timed the read from its start to its end, which took the
        # second and the asks above, while they blocked it: at most the time
        # from the question to its answer, as the test measured it. It says
        # how long to wait in hundredths of a second, rounded.
        took_at_most, since_asked = answered - asked, time.monotonic() - asked
        quiet_per_read_s = (1 - DEATHS_DUTY) / DEATHS_DUTY
        assert soon["op"] == "error", soon
        wait = soon["retry_in"]
        assert (
            quiet_per_read_s * read_s - since_asked
            < wait
            <= quiet_per_read_s * took_at_most + 0.005
        ), (soon, took_at_most)


def test_a_restore_while_restarting_keeps_its_user_to_the_cap_and_to_distinct_free_cards(
    tmp_path,
):
    """Guards against a restore holding more than its user's cap beside what they
    already hold, and against one card named twice counting as two."""
    from fluksio_nb.machine.caps import Cap

    shares = [{"gpus": [1, 1]}, {"cores": [0, 0]}, {"gpus": [0]}, {"gpus": [1]}]
    written = [held_claim(n, **share) for n, share in enumerate(shares, start=1)]
    with service_here(
        tmp_path, caps={"*": Cap(cpus=1)}, restarting=True, held_before=written
    ) as path:
        kernel = Client(path)
        said = [
            kernel.restore(cpus=1, ticket=n, secret="s", **share)
            for n, share in enumerate(shares, start=1)
        ]
        assert said[0]["op"] == "error"
        assert said[1]["op"] == "error"
        assert said[2]["op"] == "ticket"
        assert said[3]["op"] == "error", "past the cap of cpus=1"
        (held,) = kernel.books()["running"]
        assert held["allocation"]["gpus"] == [0]


# -----------------------------------------------------------------------------
# Root's own steps: nothing another user made or named leads root astray
# -----------------------------------------------------------------------------


def test_init_refuses_a_prefix_another_user_made_first():
    """Guards against root adopting directories another user made under the prefix:
    she could then swap what root writes and chmods there (the socket, the pidfile)
    for a link to any file, or name any pid in the pidfile for remove to kill."""
    from tests.unix_users import USER_B, require_unix_users, run_as, shared_tmp_dir, unix_user

    require_unix_users()
    bob = unix_user(USER_B)
    with shared_tmp_dir("fluksio-machine-") as prefix:
        os.chmod(prefix, 0o1777)
        made = run_as(bob, f"import os; os.makedirs({str(prefix / 'run')!r})")
        assert made.returncode == 0, made.stderr
        os.chmod(prefix, 0o755)
        refused = fluksio_nb("machine", "init", "--prefix", str(prefix), check=False)
        assert refused.returncode != 0
        assert f"{prefix / 'run'} belongs to uid {bob.uid}, not root" in refused.stderr
        assert not (prefix / "run" / "fluksio_nb").exists(), "root wrote in bob's directory"


def test_remove_ends_the_answering_service_not_whatever_a_stale_pidfile_names():
    """Guards against a pidfile left by a service killed outright naming, by now, a
    stranger's process, which remove then killed with SIGTERM and SIGKILL; and
    against remove then leaving the service that does answer running, its run
    directory deleted under it."""
    import subprocess
    import sys

    stranger = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        with machine() as layout:
            service = int(layout.pidfile.read_text())
            layout.pidfile.write_text(str(stranger.pid))
            try:
                fluksio_nb("machine", "remove", "--prefix", str(layout.prefix))
                assert stranger.poll() is None, "remove killed a process that is not its service"
                assert process_started(service) is None, "remove left the service running"
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(service, signal.SIGTERM)
                wait_until(lambda: process_started(service) is None, what="the service's end")
    finally:
        stranger.kill()
        stranger.wait()


def test_the_service_runs_no_fluksio_nb_of_the_directory_init_was_run_from(tmp_path):
    """Guards against `python -m fluksio_nb` in the service's command importing a
    fluksio_nb/ package another user left in the admin's current directory, as root."""
    import subprocess
    import sys
    from pathlib import Path

    planted = tmp_path / "fluksio_nb"
    planted.mkdir()
    ran = tmp_path / "planted code ran"
    (planted / "__init__.py").write_text("")
    (planted / "__main__.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    console = Path(sys.executable).with_name("fluksio-nb")
    with machine() as layout:
        again = subprocess.run(
            [str(console), "machine", "init", "--prefix", str(layout.prefix), "--gpus", "1"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert again.returncode == 0, again.stderr
        assert not ran.exists(), "the service ran the fluksio_nb/ of the directory it started in"
        assert snapshot(layout)["gpus"]["total"] == 1


def test_a_stop_at_any_moment_of_a_claim_leaves_nothing_held_and_the_kernel_hearing_its_grants():
    """Guards against the stop button landing at an unlucky moment of a claim asking the
    service: the kernel then left the lock its reader thread needs held for ever, or its
    reader stood aside for an asker that was gone and no longer heard its grants, or a
    ticket whose request it abandoned stayed held, with another user's claim waiting for
    it, until the kernel next asked for something."""
    with machine(cpus=2, gpus=0) as layout:
        proc = process(layout, STOP_AT + STOP_AT_EVERY_MOMENT_OF_A_CLAIM)
        try:
            said = heard(proc)
        finally:
            proc.kill()
            proc.wait()
    assert "stopped_at" in said, said
    # A claim's way through the client is dozens of such moments: every one was tried.
    assert said["stopped_at"] > 20, said
