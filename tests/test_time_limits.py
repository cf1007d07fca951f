"""An admin's time limit on one claim (``max_hours``), as the people on the machine meet it.

A shared machine's admin caps how long one claim may run, so that a card held
by a forgotten notebook comes back on its own. The failures guarded against:
a claim stopped with no warning, or with a message that reads like a crash
rather than naming the admin's limit; records that call it a plain release;
a ``--timeout`` that promises more than the admin allows; a restart that
hands every running claim its time again; and a typo in ``machine.json``
that quietly means "no limit". Everything runs the real service, started by
``fluksio-nb machine init``, and real kernels of a real Unix user.
"""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest

from fluksio_nb.overview import describe_snapshot
from fluksio_nb.records import TIME_LIMIT
from fluksio_nb.widget.facts import machine_facts
from tests.kernels import Kernel, until_it_exists
from tests.machines import (
    fluksio_nb,
    heard,
    kernels_on_books,
    machine,
    process,
    wait_until,
)
from tests.unix_users import USER_A, USER_B, ready_user, require_unix_users, shared_tmp_dir

pytestmark = pytest.mark.timeout(240)

#: A test-sized limit: 3.6 s, so a claim is warned 3.24 s into it.
MAX_HOURS = 0.001
#: How every message names it, and who set it.
NAMED = (
    "the 3.6 s its user may hold a claim on this machine "
    "(max_hours=0.001 in the admin's machine.json)"
)
#: A claimed cell that runs until something stops it.
FOR_EVER = "import time\nwhile True:\n    time.sleep(0.05)"


@pytest.fixture
def users():
    require_unix_users()
    return ready_user(USER_A), ready_user(USER_B)


@pytest.fixture
def kernels():
    with kernels_on_books() as start:
        yield start


def records_of(records: Path, ticket: int) -> list[dict]:
    """Every record of claim ``ticket`` in the machine's records: the kernel's and the service's."""
    return [
        record
        for path in records.iterdir()
        for line in path.read_text().splitlines()
        if (record := json.loads(line)).get("ticket") == ticket
    ]


def service_and_kernel_records(records: Path, ticket: int) -> tuple[dict, dict]:
    found = wait_until(
        lambda: len(records_of(records, ticket)) == 2 and records_of(records, ticket),
        what=f"claim {ticket}'s two records",
    )
    (service,) = [r for r in found if r.get("by_service")]
    (kernel,) = [r for r in found if not r.get("by_service")]
    return service, kernel


def snapshot(layout) -> dict:
    from fluksio_nb.machine.connection import read_snapshot

    return read_snapshot(layout.socket)


def test_a_claim_past_its_time_limit_is_warned_then_stopped_with_the_limit_named(users, kernels):
    """Guards against a claim ended at the admin's time limit without a warning first,
    in its cell and in everyone's view of the machine; against a stop that reads
    like a crash instead of naming the admin's limit; and against records (the
    kernel's and the service's) that call it anything but the time limit."""
    alice, _ = users
    config = {"caps": {USER_A: {"max_hours": MAX_HOURS}}}
    with machine(cpus=2, gpus=0, config=config) as layout:
        a: Kernel = kernels(alice, layout)
        msg_id = a.client.execute(f"%%claim cpus=1 --label long\n{FOR_EVER}")

        def warned_books() -> dict | None:
            books = snapshot(layout)
            return books if any(c.get("warning") for c in books["running"]) else None

        books = wait_until(warned_books, what="the claim warned in the machine's snapshot")
        (warned,) = books["running"]
        assert NAMED in warned["warning"] and "it is stopped at" in warned["warning"]
        # As the terminal's snapshot and the %claims monitor show that snapshot.
        assert f"; {warned['warning']}" in describe_snapshot(books)
        (row,) = machine_facts(books, {}, (1 << 30, 1 << 29))["running"]
        assert row["warning"] == warned["warning"]
        ran = a.messages_of(msg_id, timeout=60)
        ticket = warned["ticket"]
        # In its cell, once, before it was stopped: the line, and its live view.
        told = [line for line in ran.stderr.splitlines() if "has run" in line]
        assert told == [f"fluksio_nb: {warned['warning']}"], ran.stderr
        live = [
            m["content"]["data"]["state"]["warning"]
            for m in a.seen
            if m["msg_type"] == "comm_msg" and "warning" in m["content"]["data"].get("state", {})
        ]
        assert live == [warned["warning"]], "the cell's live view did not show the warning"
        assert ran.error is not None and ran.error["ename"] == "ClaimCancelled"
        assert NAMED in ran.error["evalue"], ran.error["evalue"]
        assert f"claim {ticket} reached" in ran.error["evalue"]
        service, kernel = service_and_kernel_records(layout.records, ticket)
        assert service["ending"] == kernel["ending"] == TIME_LIMIT
        # Counted from its grant: never stopped short of the limit.
        assert service["ended_at"] - service["granted_at"] >= MAX_HOURS * 3600
        assert snapshot(layout)["running"] == []


def test_a_claim_that_ends_before_its_warning_is_never_warned_and_the_next_has_its_own_time(
    users, kernels
):
    """Guards against a claim's warning or stop firing after it ended, on whatever
    holds its number or its kernel next, and against a limit counted per kernel
    rather than per claim: each claim has the whole limit from its own grant."""
    alice, _ = users
    config = {"caps": {USER_A: {"max_hours": MAX_HOURS}}}
    with machine(cpus=2, gpus=0, config=config) as layout:
        a = kernels(alice, layout)
        # A second of work: well short of the warning at 3.24 s.
        short = a.run("%%claim cpus=1 --label short\nimport time\ntime.sleep(1)", check=True)
        assert "has run" not in short.stderr and "max_hours" not in short.stderr
        long = a.run(f"%%claim cpus=1 --label long\n{FOR_EVER}", timeout=60)
        assert long.error is not None and NAMED in long.error["evalue"]
        assert sum("has run" in line for line in long.stderr.splitlines()) == 1, long.stderr

        def by_label() -> dict[str, list[dict]]:
            found: dict[str, list[dict]] = {}
            for path in layout.records.iterdir():
                for line in path.read_text().splitlines():
                    record = json.loads(line)
                    found.setdefault(record["label"], []).append(record)
            return found

        ended = wait_until(
            lambda: all(len(by_label().get(n, ())) == 2 for n in ("short", "long")) and by_label(),
            what="both claims' records, the kernel's and the service's",
        )
        assert sorted(r["ending"] for r in ended["short"]) == ["ok", "released"], ended
        assert [r["ending"] for r in ended["long"]] == [TIME_LIMIT, TIME_LIMIT], ended
        # Its whole limit, from its own grant, whatever the claim before it used.
        (service,) = [r for r in ended["long"] if r.get("by_service")]
        assert service["ended_at"] - service["granted_at"] >= MAX_HOURS * 3600


def test_a_timeout_longer_than_the_time_limit_is_cut_to_it_with_a_warning(users, kernels):
    """Guards against a ``--timeout`` that promises a cell more time than the admin
    allows without a word, and against a cut that is not used: the claim waits
    in the queue, where only its own timeout ends it, for the limit and no longer."""
    alice, bob = users
    config = {"caps": {USER_A: {"max_hours": MAX_HOURS}}}
    with machine(cpus=2, gpus=1, config=config) as layout, shared_tmp_dir() as tmp:
        a, b = kernels(alice, layout), kernels(bob, layout)
        # Bob has no limit, and holds the machine's one card until the test ends.
        b.start_job(
            f"%%claim gpus=1 --background --label holder\n{until_it_exists(tmp / 'never')}",
            "job",
        )
        wait_until(lambda: snapshot(layout)["running"], what="bob's claim")
        waited = a.run("%%claim gpus=1 --timeout 600 --label waiter\nx = 1", timeout=60)
        assert "ClampedWarning" in waited.stderr
        assert f"a timeout of 600 s is longer than {NAMED}; it is cut to 3.6 s" in waited.stderr, (
            waited.stderr
        )
        assert waited.error is not None and waited.error["ename"] == "ClaimTimeout"
        assert "3.6 s" in waited.error["evalue"], waited.error["evalue"]
        refused = a.run("%%claim gpus=1 --timeout 600 --strict\nx = 1")
        assert refused.error is not None and refused.error["ename"] == "ClaimTooLarge"
        assert NAMED in refused.error["evalue"] and "--strict" in refused.error["evalue"]


def test_a_claim_put_back_after_a_restart_keeps_its_grant_and_is_ended_at_its_limit():
    """Guards against a restart of the service (an admin's init, a crash) giving every
    running claim its whole time again, and against a claim whose kernel ignores the
    stop holding its share past the limit: the service ends it, and records why."""
    max_hours = 0.003  # 10.8 s: more than a restart takes, here
    with machine(gpus=1, config={"caps": {"*": {"max_hours": max_hours}}}) as layout:
        holder = process(
            layout,
            textwrap.dedent(
                """
                t = q.enqueue(Resources(gpus=1), "holder"); q.wait(t)
                say(ticket=t.number, granted_at=t.granted_at)
                sys.stdin.readline()
                """
            ),
        )
        granted = heard(holder)
        fluksio_nb("machine", "init", "--prefix", str(layout.prefix), "--gpus", "1")
        (record,) = wait_until(
            lambda: [r for r in records_of(layout.records, granted["ticket"])],
            timeout=60,
            what="the holder's claim ended by the service",
        )
        holder.kill()
        holder.wait(10)
        assert record["ending"] == TIME_LIMIT
        assert record["granted_at"] == granted["granted_at"], "the restart gave it a new grant"
        assert record["ended_at"] - record["granted_at"] >= max_hours * 3600


@pytest.mark.parametrize("bad", [-1, 0, "8", True])
def test_a_max_hours_that_is_not_a_positive_number_is_refused_saying_so(bad):
    """Guards against a typo in machine.json (a string, zero, a sign) taken as no limit
    or as a limit that ends every claim at once, with nothing said to the admin."""
    with shared_tmp_dir("fluksio-machine-") as prefix:
        config = prefix / "etc" / "fluksio_nb" / "machine.json"
        config.parent.mkdir(parents=True)
        config.write_text(json.dumps({"caps": {USER_A: {"cpus": 1, "max_hours": bad}}}))
        try:
            ran = fluksio_nb("machine", "init", "--prefix", str(prefix), check=False)
        finally:
            fluksio_nb("machine", "remove", "--prefix", str(prefix), check=False)
        assert ran.returncode != 0
        assert f"caps.{USER_A}.max_hours: must be a positive number of hours" in ran.stderr
        assert "leave max_hours out for no time limit" in ran.stderr


def test_a_kernel_of_a_release_before_time_limits_still_reads_the_welcome():
    """Guards against a time limit cutting off, with the machine's books, every kernel
    still running an earlier release, which makes its cap of every field the service
    sends in ``cap``: the limit goes beside it."""
    from fluksio_nb.machine import protocol

    config = {"caps": {"*": {"cpus": 1, "max_hours": 2}}}
    with (
        machine(gpus=0, config=config) as layout,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock,
    ):
        sock.settimeout(30)
        sock.connect(str(layout.socket))
        sock.sendall(protocol.line({"op": "hello"}))
        welcome = json.loads(sock.makefile("rb").readline())
    assert welcome["cap"] == {"cpus": 1, "gpus": None, "ram_bytes": None}
    assert welcome["max_hours"] == 2
