"""The machine's books service under floods from a hostile second user (issue #45).

A second Unix user with a raw client on the service's socket froze it for
everyone: 300 snapshot requests in one write while holding 4,096 waiting
claims, 100 connections writing 256 KiB of requests each, 10⁵ claims
pipelined on one connection, 500 lines that never end, connection after
connection refused and each refusal logged, 512 connections of each of a
hub's users. Each test here runs the real service (``machine init
--prefix``), the flood as a real second user (:mod:`tests.floods`), and a
real kernel client of another user claiming and giving back meanwhile,
whose every claim must still be answered promptly. The bounds are the
issue's, made generous for a loaded two-core machine: the floods froze the
service for tens of seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fluksio_nb.machine import protocol
from fluksio_nb.machine.setup import Layout
from tests.floods import Flood, flooding, rss
from tests.machines import fluksio_nb, machine, machine_env, wait_until
from tests.unix_users import (
    USER_A,
    USER_B,
    as_user,
    ready_user,
    run_as,
    shared_tmp_dir,
    user_environ,
)

pytestmark = pytest.mark.timeout(240)

#: The slowest any of the other user's claims (claim, grant, give-back) or
#: snapshots on a new connection may be while a flood runs. The issue's
#: target is 250 ms; the floods made it 6-21 s.
SLOWEST_S = 2.0
#: The median of them: the issue's target is well under 50 ms; a flood of
#: pipelined claims made it 0.64 s.
MEDIAN_S = 0.25
#: How many of the other user's claims are timed while each flood runs.
PROBES = 20
#: How many connections the log flood has refused: at a line each, some 2 MB.
REFUSALS = 3000
MB = 1 << 20


@pytest.fixture
def users():
    return ready_user(USER_A), ready_user(USER_B)


@contextmanager
def flood_of(layout: Layout, users, mode: str, *args: int) -> Iterator[Flood]:
    """Bob's flood of ``mode`` under way, and Alice's kernel client claiming beside it."""
    alice, bob = users
    with flooding(
        as_user(bob),
        user_environ(bob),
        str(layout.socket),
        mode,
        *args,
        probe=(as_user(alice), user_environ(alice, machine_env(layout))),
        service_pid=service_pid(layout),
    ) as flood:
        yield flood


def service_pid(layout: Layout) -> int:
    return int(layout.pidfile.read_text())


def assert_answered_promptly(samples: list[dict[str, float]]) -> None:
    for what in ("claim", "snapshot"):
        took = [sample[what] for sample in samples]
        assert max(took) < SLOWEST_S, f"another user's {what} took {max(took):.2f} s: {took}"
        assert statistics.median(took) < MEDIAN_S, f"another user's {what}s: {took}"


def books_as_root(layout: Layout) -> dict:
    from fluksio_nb.machine.connection import read_snapshot

    return read_snapshot(layout.socket)


def test_pipelined_snapshots_from_a_user_with_thousands_waiting_do_not_freeze_the_service(
    users,
):
    """Guards against a snapshot costing time in proportion to its asker's waiting
    claims, and the service answering all of one connection's lines before anyone
    else's: 4,096 waiting claims and 300 snapshots in one write froze it for 11-21 s,
    and another user's claim waited 10 s."""
    with machine(cpus=4, gpus=1) as layout:
        with flood_of(layout, users, "snapshots", 4097, 300) as flood:
            assert flood.facts["waiting"] == 4097  # one holds the card, 4,096 wait
            assert_answered_promptly(flood.probes(PROBES, within=60))
            books = books_as_root(layout)
            said = flood.stop()
        assert said["claims"] == {"welcome": 1, "ticket": 4097}
        assert said["answers"] > 0, "the flooder's own snapshots went unanswered"
        # Counted, not listed: no reader carries the attacker's queue.
        assert len(books["waiting"]) <= 100 and books["waiting_unlisted"] == 4096 - len(
            books["waiting"]
        )
        wait_until(lambda: not books_as_root(layout)["waiting"], what="the flooder's claims freed")


def test_a_hundred_connections_of_snapshot_requests_do_not_freeze_the_service(users):
    """Guards against 100 connections each writing 256 KiB of snapshot requests (and
    reading nothing) freezing the service for 40 s, and against their unread answers
    piling up in its memory."""
    with machine(cpus=4, gpus=1) as layout:
        with flood_of(layout, users, "connections", 100, 256 << 10) as flood:
            assert_answered_promptly(flood.probes(PROBES, within=60))
            flood.stop()
        assert flood.peak_rss < 200 * MB, f"the service held {flood.peak_rss / MB:.0f} MB"


def test_lines_that_never_end_hold_little_memory_and_it_is_given_back(users):
    """Guards against 500 connections each sending 1 MiB of a line with no end growing
    the service by 500 MB, of which hundreds stayed held after the sender left."""
    with machine(cpus=4, gpus=1) as layout:
        pid = service_pid(layout)
        idle = rss(pid)
        # Just short of the longest line the service once took.
        with flood_of(layout, users, "unfinished", 500, (1 << 20) - 64) as flood:
            assert_answered_promptly(flood.probes(PROBES, within=60))
            flood.stop()
        assert flood.peak_rss < idle + 150 * MB, (
            f"{flood.peak_rss / MB:.0f} MB during the flood, {idle / MB:.0f} MB idle"
        )
        wait_until(
            lambda: rss(pid) < idle + 50 * MB,
            what=f"the service back within 50 MB of its idle {idle / MB:.0f} MB",
        )


def test_claims_pipelined_on_one_connection_keep_another_users_claims_prompt(users):
    """Guards against each claim costing time in proportion to the books (a count of
    the user's waiting claims, a fair order of every waiting claim): 10⁵ claims
    pipelined on one connection made another user's claim take 0.64 s at the median
    and up to 12 s. The books stay right: the flooder's 4,096 waiting claims, no more."""
    with machine(cpus=4, gpus=1) as layout:
        with flood_of(layout, users, "claims", 100_000) as flood:
            assert_answered_promptly(flood.probes(PROBES, within=60))
            wait_until(
                lambda: (
                    (b := books_as_root(layout))["waiting_unlisted"] + len(b["waiting"]) == 4096
                ),
                timeout=120,
                what="the flooder's queue full",
            )
            assert_answered_promptly(flood.probes(5, within=60))
            said = flood.stop()
        assert said["answers"]["ticket"] == 4097
        wait_until(lambda: not books_as_root(layout)["waiting"], what="the flooder's claims freed")
        books = books_as_root(layout)
        assert books["running"] == [] and books["cpus"]["free"] == books["cpus"]["total"]


def test_a_flood_of_refused_connections_grows_the_log_by_little_and_says_what_was_refused(
    users,
):
    """Guards against every refused line being logged, one by one, to a log on /run's
    tmpfs: 1.7-1.9 MiB/s under a flood, gigabytes an hour. The issue allows 1 MB a
    minute; the log must still say who was refused, how often and why."""
    _, bob = users
    with machine(cpus=4, gpus=1) as layout:
        before = layout.log.stat().st_size
        started = time.monotonic()
        with flood_of(layout, users, "bad-lines", REFUSALS) as flood:
            assert_answered_promptly(flood.probes(PROBES, within=60))
            flood.attacker.wait(120)
            said = flood.stop()
        took = time.monotonic() - started
        assert said["refused"] == REFUSALS
        grown = layout.log.stat().st_size - before
        assert grown < max(64 << 10, took / 60 * 1_000_000), (
            f"the log grew {grown} bytes in {took:.0f} s"
        )

        def counted() -> int:
            said = layout.log.read_text(errors="replace")[before:]
            return sum(map(int, re.findall(r"a request that does not parse ×(\d+)", said)))

        wait_until(lambda: counted() == REFUSALS, what="every refusal counted in the log")
        tail = layout.log.read_text(errors="replace")[before:]
        assert f"{USER_B} (uid {bob.uid})" in tail and "validation error" in tail


# -----------------------------------------------------------------------------
# Connection limits, on a service whose descriptors are few enough to fill
# -----------------------------------------------------------------------------

#: The service's descriptor limit in the test below: small enough to fill.
DESCRIPTORS = 400


@contextmanager
def machine_with_descriptors(descriptors: int) -> Iterator[Layout]:
    """A machine whose service may open only ``descriptors`` files, as ``ulimit -n`` sets."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, descriptors))

    if os.geteuid() != 0:
        pytest.skip(f"needs root: `fluksio-nb machine init` runs as root (uid {os.geteuid()})")
    with shared_tmp_dir("fluksio-machine-") as prefix:
        layout = Layout(prefix)
        init = [sys.executable, "-m", "fluksio_nb", "machine", "init", "--prefix", str(prefix)]
        ran = subprocess.run(
            [*init, "--cpus", "4", "--gpus", "1"],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=limited,
        )
        assert ran.returncode == 0, ran.stderr
        try:
            import psutil

            limit = psutil.Process(service_pid(layout)).rlimit(resource.RLIMIT_NOFILE)
            if limit[0] != descriptors:
                pytest.skip(
                    f"the service was started with {limit[0]} descriptors, not {descriptors} "
                    "(systemd sets its own limit); too many to fill in a test"
                )
            yield layout
        finally:
            fluksio_nb("machine", "remove", "--prefix", str(prefix), check=False)


HOLD_CONNECTIONS = r"""
import json, socket, sys
held, refused = [], None
for _ in range(int(sys.argv[2])):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(sys.argv[1])
    try:
        sock.sendall(b'{"op":"hello"}\n')
    except BrokenPipeError:
        pass  # refused as it connected: the refusal is there to read
    try:
        answer = json.loads(sock.makefile("rb").readline())
    except TimeoutError:
        answer = {"op": "unanswered"}
    if answer["op"] != "welcome":
        refused = answer
        break
    held.append(sock)
print(json.dumps({"held": len(held), "refused": refused}), flush=True)
sys.stdin.readline()
"""


def connect_as_root(layout: Layout) -> tuple[socket.socket, dict]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(layout.socket))
    with contextlib.suppress(BrokenPipeError):
        # Refused as it connected: the refusal is there to read.
        sock.sendall(protocol.line({"op": "hello"}))
    return sock, json.loads(sock.makefile("rb").readline())


def test_connections_are_limited_per_user_and_in_all_below_the_descriptor_limit(users):
    """Guards against a limit per user only: on a hub, 512 connections for each of a
    few users passed the service's descriptor limit, and then nobody's new connection
    was answered. One user at their limit leaves room for others, the service never
    takes more than its descriptors allow, each refusal says why in a line, and root
    can still look at a full service."""
    from fluksio_nb.machine.turns import RESERVED_DESCRIPTORS, connection_limits

    alice, bob = users
    per_user, in_all = connection_limits(DESCRIPTORS)
    assert per_user < in_all < DESCRIPTORS - RESERVED_DESCRIPTORS // 2
    with machine_with_descriptors(DESCRIPTORS) as layout:
        env = user_environ(bob)
        hog = subprocess.Popen(
            [*as_user(bob), sys.executable, "-c", HOLD_CONNECTIONS, str(layout.socket), "1000"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
        )
        mine: list[socket.socket] = []
        try:
            said = json.loads(hog.stdout.readline())
            assert said["held"] == per_user
            assert said["refused"]["op"] == "refused"
            assert f"{USER_B} already has {per_user} connections" in said["refused"]["message"]

            # Another user's kernel claims as ever beside them.
            claimed = run_as(
                alice,
                "from fluksio_nb.kernel import accountant\n"
                "from fluksio_nb.resources import Resources\n"
                "q = accountant(); t = q.enqueue(Resources(cpus=1)); q.wait(t, 30); "
                "q.release(t); print('claimed')",
                env=machine_env(layout),
            )
            assert claimed.stdout.strip() == "claimed", claimed.stderr

            # Root fills the rest, and a few past it, which only root may.
            while True:
                sock, answer = connect_as_root(layout)
                mine.append(sock)
                if answer["op"] != "welcome":
                    break
                assert len(mine) < in_all, "the service took more connections than it may"
            assert "the most it can" in answer["message"]
            mine.pop().close()
            for sock in mine[-8:]:
                sock.close()
            del mine[-8:]
            wait_until(
                lambda: connect_as_root(layout)[1]["op"] == "welcome",
                what="root let back in past the limit in all",
            )
            turned_away = run_as(
                alice,
                "import json, socket, sys\n"
                "sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                f"sock.connect({str(layout.socket)!r})\n"
                'try:\n    sock.sendall(b\'{"op":"hello"}\\n\')\n'
                "except BrokenPipeError:\n    pass\n"
                "print(sock.makefile('rb').readline().decode())",
            )
            refused = json.loads(turned_away.stdout)
            assert refused["op"] == "refused", refused
            assert "connections, the most it can" in refused["message"]
        finally:
            for sock in mine:
                sock.close()
            hog.kill()
            hog.wait(30)
        # With the crowd gone, everyone is let in again.
        wait_until(lambda: connect_as_root(layout)[1]["op"] == "welcome", what="connections again")
        books = books_as_root(layout)
        assert books["running"] == [] and books["cpus"]["free"] == books["cpus"]["total"]
