"""Slices of a card on the machine's books, with a stand-in ``nvidia-smi``.

A real books service run by root under a temporary prefix, reading the
stand-in cards as it would read real ones, and real processes claiming with
``claim()`` as a notebook does: two half cards share one card while a third
waits, a whole-card claim waits for a card without slices and is not starved
by slices that come after it, ``gpu_ram=`` alone is a slice of that much
memory, and a card a process outside every claim fills is not granted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fluksio_nb.card_compute import LOOKED_FOR_EVERY_S, mps_daemon_runs
from fluksio_nb.card_devices import cards_held_here
from fluksio_nb.card_slices import PASSES
from fluksio_nb.machine.connection import read_snapshot
from tests.gpu_standins import MPS_DAEMON, StandInSmi, card
from tests.machines import fluksio_nb, heard, machine, machine_env, wait_until
from tests.suite_locks import held_across_suites

pytestmark = pytest.mark.timeout(180)

MIB = 2**20
#: The stand-in's cards: 40960 MiB, as an A100-40GB says.
CARD = 40960 * MIB

PRELUDE = "import json, sys\ndef say(**facts):\n    print(json.dumps(facts), flush=True)\n"

#: Holds ``claim(**ARGS)`` until told to let go, saying what it was given.
HOLD = """
from fluksio_nb import claim
c = claim(**json.loads(sys.argv[1]))
c.__enter__()
say(gpus=list(c.allocation.gpus), gpu_bytes=c.allocation.gpu_bytes,
    fraction=c.env.get("FLUKSIO_GPU_MEMORY_FRACTION"),
    visible=c.env["CUDA_VISIBLE_DEVICES"])
sys.stdin.readline()
c.__exit__(None, None, None)
say(released=True)
"""


#: Holds ``claim(**ARGS)`` ``N`` times over, each granted before the next is asked.
HOLD_MANY = """
from fluksio_nb import claim
held = []
for _ in range(int(sys.argv[2])):
    held.append(claim(**json.loads(sys.argv[1])))
    held[-1].__enter__()
say(held=[c.allocation.gpu_bytes for c in held])
sys.stdin.readline()
for c in held:
    c.__exit__(None, None, None)
say(released=True)
"""


def hold(layout, smi, many: int = 0, **asked) -> subprocess.Popen:
    """A process that claims ``asked`` (``many`` times, if given) on the machine's books
    and holds it until told."""
    script, times = (HOLD_MANY, [str(many)]) if many else (HOLD, [])
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + script, json.dumps(asked), *times],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **machine_env(layout), **smi.env()},
        cwd="/",
    )


def books(layout) -> dict:
    return read_snapshot(layout.socket)


def labels_waiting(layout) -> int:
    return len(books(layout)["waiting"])


def let_go(proc: subprocess.Popen) -> None:
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert heard(proc) == {"released": True}


@pytest.fixture
def ends():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


@pytest.fixture
def only_our_mps_daemon():
    """No stand-in MPS daemon of another test, this suite's or another's, runs while the
    test does, and its own is gone, and known to be gone, before any other may look.

    Asked for before ``ends``, which ends the test's stand-in: fixtures end in the
    reverse of the order they were made in.
    """
    with held_across_suites(MPS_DAEMON):
        yield
        wait_until(lambda: not mps_daemon_runs(), what="no stand-in MPS daemon left")
        # A process that looked while it ran keeps that answer this long.
        time.sleep(LOOKED_FOR_EVERY_S)


def passes_of_the_cards(smi: StandInSmi) -> int:
    return sum(1 for c in smi.calls() if c and c[0].startswith("--query-gpu"))


def service_has_read(smi: StandInSmi, passes: int = 1) -> None:
    """Wait for the service to have read the cards: a grant is decided on them."""
    wait_until(lambda: passes_of_the_cards(smi) >= passes, what=f"{passes} passes of the cards")


def test_two_half_cards_run_at_once_on_one_card_and_a_third_waits(tmp_path, ends):
    """Guards against a card handed out only whole (a 4 GB notebook taking 40 GB from
    everyone), and against more slices on a card than it holds."""
    smi = StandInSmi(tmp_path / "smi", [card(0)])
    with machine(gpus=1, env=smi.env()) as layout:
        first, second = hold(layout, smi, gpus=0.5), hold(layout, smi, gpus=0.5)
        ends += [first, second]
        a, b = heard(first), heard(second)
        assert a["gpus"] == b["gpus"] == [0]
        assert a["visible"] == b["visible"] == "0"
        assert a["gpu_bytes"] == b["gpu_bytes"] == CARD // 2
        # The frameworks are told their share of the card, as gpu_ram= tells them.
        assert a["fraction"] == b["fraction"] == "0.500"

        third = hold(layout, smi, gpus=0.5)
        ends.append(third)
        wait_until(lambda: labels_waiting(layout) == 1, what="the third claim waiting")
        seen = books(layout)
        assert len(seen["running"]) == 2
        (row,) = seen["gpus"]["cards"]
        assert (row["claims"], row["held_bytes"], row["total_bytes"]) == (2, CARD, CARD)
        # Every view says it: the terminal's snapshot here.
        shown = fluksio_nb(env=machine_env(layout)).stdout
        assert "card 0: 2 claims, 43/43 GB" in shown
        assert "asks cpus=1 gpus=0.5" in shown

        let_go(first)
        assert heard(third)["gpus"] == [0]


def test_a_whole_card_claim_waits_for_a_card_without_slices_and_is_not_starved(tmp_path, ends):
    """Guards against a whole-card claim granted beside a slice, against it keeping the room
    beside the slice empty while it waits, and against slices that come after it taking
    the room its card frees, one after another, for ever: after PASSES, none goes."""
    smi = StandInSmi(tmp_path / "smi", [card(0)])
    # Cores for every claim here: the claims wait for the card, not for cores.
    with machine(gpus=1, cpus=4 + PASSES, env=smi.env()) as layout:
        half = hold(layout, smi, gpus=0.5)
        ends.append(half)
        assert heard(half)["gpus"] == [0]
        whole = hold(layout, smi, gpus=1)
        ends.append(whole)
        wait_until(lambda: labels_waiting(layout) == 1, what="the whole-card claim waiting")
        # Slices after it that fit beside the half go around it, as many as PASSES...
        slivers = hold(layout, smi, many=PASSES, gpu_ram="1G")
        ends.append(slivers)
        assert heard(slivers) == {"held": [10**9] * PASSES}
        # ... and no more: the next waits behind the whole card, though it would fit.
        sliver = hold(layout, smi, gpu_ram="1G")
        ends.append(sliver)
        wait_until(lambda: labels_waiting(layout) == 2, what="the slice waiting behind it")
        assert len(books(layout)["running"]) == 1 + PASSES

        let_go(half)
        let_go(slivers)
        got = heard(whole)
        assert (got["gpus"], got["gpu_bytes"]) == ([0], 0)
        assert len(books(layout)["running"]) == 1 and labels_waiting(layout) == 1
        let_go(whole)
        assert heard(sliver)["gpu_bytes"] == 10**9


def test_gpu_ram_alone_is_a_slice_of_that_much_of_one_card(tmp_path, ends):
    """Guards against gpu_ram= without gpus= refused, or taking a whole card, and against
    two such slices granted more of a card than it has."""
    smi = StandInSmi(tmp_path / "smi", [card(0)])
    with machine(gpus=1, env=smi.env()) as layout:
        service_has_read(smi)
        first = hold(layout, smi, gpu_ram="30G")
        ends.append(first)
        got = heard(first)
        assert (got["gpus"], got["gpu_bytes"]) == ([0], 30 * 10**9)
        assert got["fraction"] == f"{30 * 10**9 / CARD:.3f}"
        second = hold(layout, smi, gpu_ram="20G")
        ends.append(second)
        wait_until(lambda: labels_waiting(layout) == 1, what="the second slice waiting")
        small = hold(layout, smi, gpu_ram="10G")
        ends.append(small)
        # Packed around the 20G one, best-fit, as it has not been passed PASSES times.
        assert heard(small)["gpu_bytes"] == 10 * 10**9
        let_go(first)
        assert heard(second)["gpu_bytes"] == 20 * 10**9


def test_a_card_a_squatter_fills_is_not_granted_and_the_waiter_is_told_whose(tmp_path, ends):
    """Guards against granting memory a process outside every claim holds (the claim
    fails on its first allocation), and against a wait that does not say why."""
    squatter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    ends.append(squatter)
    cards = [card(0, used_mib=30000)]
    smi = StandInSmi(
        tmp_path / "smi",
        cards,
        [{"uuid": cards[0]["uuid"], "pid": squatter.pid, "used_mib": 30000}],
    )
    with machine(gpus=1, env=smi.env()) as layout:
        service_has_read(smi)
        small = hold(layout, smi, gpu_ram="5G")
        ends.append(small)
        assert heard(small)["gpus"] == [0]
        big = hold(layout, smi, gpu_ram="20G")
        ends.append(big)

        def told() -> str | None:
            waiting = books(layout)["waiting"]
            return waiting[0].get("warning") if waiting else None

        said = wait_until(told, what="the waiting claim told why")
        # 42.9 GB, less 31.5 GB of the squatter's and the 5 GB slice granted.
        assert said == f"card 0 has 6.5GB free; 31.5GB held by pid {squatter.pid} (root), no claim"
        # The squatter leaves: the card is granted without any claim ending.
        smi.set_apps([])
        smi.set_cards([card(0)])
        assert heard(big)["gpu_bytes"] == 20 * 10**9


def test_a_whole_card_claim_is_not_granted_the_card_a_squatter_fills(tmp_path, ends):
    """Guards against the lowest free index handed out whole though a process outside
    every claim holds most of it, while another card is empty."""
    squatter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    ends.append(squatter)
    cards = [card(0, used_mib=30000), card(1)]
    smi = StandInSmi(
        tmp_path / "smi",
        cards,
        [{"uuid": cards[0]["uuid"], "pid": squatter.pid, "used_mib": 30000}],
    )
    with machine(gpus=2, env=smi.env()) as layout:
        service_has_read(smi)
        first = hold(layout, smi, gpus=1)
        ends.append(first)
        assert heard(first)["gpus"] == [1]
        second = hold(layout, smi, gpus=1)
        ends.append(second)
        wait_until(lambda: labels_waiting(layout) == 1, what="the second whole card waiting")
        assert books(layout)["waiting"][0]["warning"].startswith("card 0 has ")


def test_slices_running_across_a_restart_are_put_back_on_their_cards_and_a_fourth_still_waits(
    tmp_path, ends
):
    """Guards against an admin's restart dropping a slice (its card then granted again
    to someone else), putting one back on another card or with other memory than it
    was granted, or letting a slice that did not fit before the restart in after it, or
    granting one on a card the restarted service has not read yet: sized on a guess of
    80 GB, three quarters of a 43 GB card was 60 GB.

    Each holder uses most of its slice on its card, as a real one would: the new
    service reads that memory before the kernels have put their claims back, and must
    not count it as no claim's and refuse them as no longer free."""
    cards = [card(0), card(1)]
    smi = StandInSmi(tmp_path / "smi", cards)
    with machine(gpus=2, env=smi.env()) as layout:
        service_has_read(smi)
        half = hold(layout, smi, gpus=0.5)
        ends.append(half)
        assert heard(half)["gpus"] == [0]
        # Best fit: beside the half on card 0, which keeps card 1 empty.
        small = hold(layout, smi, gpu_ram="15G")
        ends.append(small)
        assert heard(small)["gpus"] == [0]
        budget = hold(layout, smi, gpu_ram="30G")
        ends.append(budget)
        assert heard(budget)["gpus"] == [1]
        # Each uses most of its slice.
        using = [(half, 0, 20000), (small, 0, 14000), (budget, 1, 28000)]
        smi.set_apps(
            [{"uuid": cards[c]["uuid"], "pid": p.pid, "used_mib": mib} for p, c, mib in using]
        )
        smi.set_cards([card(0, used_mib=34000), card(1, used_mib=28000)])
        # 32 GB fits on neither card beside them.
        fourth = hold(layout, smi, gpus=0.75)
        ends.append(fourth)
        wait_until(lambda: labels_waiting(layout) == 1, what="the fourth slice waiting")

        def granted(seen: dict) -> list:
            return sorted(
                (c["ticket"], c["allocation"]["gpus"], c["allocation"]["gpu_bytes"])
                for c in seen["running"]
            )

        before = granted(books(layout))
        assert sorted((gpus, nbytes) for _, gpus, nbytes in before) == sorted(
            [([0], CARD // 2), ([0], 15 * 10**9), ([1], 30 * 10**9)]
        )
        first = int(layout.pidfile.read_text())
        fluksio_nb("machine", "init", "--prefix", str(layout.prefix), "--gpus", "2", env=smi.env())
        assert int(layout.pidfile.read_text()) != first

        def grace_over() -> dict | None:
            seen = books(layout)
            return None if "grants_resume_at" in seen else seen

        wait_until(grace_over, timeout=60, what="the restart's grace over")
        # A pass of the cards after it, which would grant the fourth if it fitted.
        service_has_read(smi, passes=passes_of_the_cards(smi) + 1)
        seen = books(layout)
        assert granted(seen) == before, f"every slice put back on its card, as it was: {seen}"
        rows = {row["index"]: row for row in seen["gpus"]["cards"]}
        assert (rows[0]["claims"], rows[0]["held_bytes"]) == (2, CARD // 2 + 15 * 10**9)
        assert (rows[1]["claims"], rows[1]["held_bytes"]) == (1, 30 * 10**9)
        assert len(seen["waiting"]) == 1
        assert not seen["waiting"][0].get("warning"), "the slices' memory is theirs, no squatter's"
        let_go(budget)
        # Its process gone, the driver frees its memory.
        smi.set_apps(
            [{"uuid": cards[c]["uuid"], "pid": p.pid, "used_mib": mib} for p, c, mib in using[:2]]
        )
        smi.set_cards([card(0, used_mib=34000), card(1)])
        got = heard(fourth)
        assert (got["gpus"], got["gpu_bytes"]) == ([1], int(0.75 * CARD))


#: Holds ``claim(**ARGS)`` until told to let go, saying what its cell's status line and
#: its widget say of it, and what its worker was told of MPS.
HOLD_SAYING = """
from fluksio_nb import claim
from fluksio_nb.status import describe
from fluksio_nb.widget.facts import claim_facts
c = claim(**json.loads(sys.argv[1]))
c.__enter__()
say(line=describe(c.status), held=claim_facts(c.status)["enforcement"],
    mps=c.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
sys.stdin.readline()
c.__exit__(None, None, None)
say(released=True)
"""

#: What the panel (the server's snapshot is ``read_books()``) and ``%claims`` show.
VIEWS = """
from fluksio_nb.overview import read_books
from fluksio_nb.widget.facts import machine_facts
seen = read_books()
facts = machine_facts(seen, {}, (1, 1))
say(panel=seen["enforcement"].get("card slices"),
    monitor=[card["slices"] for card in facts["gpus"]],
    monitor_held=facts["enforcement"].get("card slices"))
"""


def views(layout, smi) -> dict:
    ran = subprocess.run(
        [sys.executable, "-c", PRELUDE + VIEWS],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **machine_env(layout), **smi.env()},
        cwd="/",
    )
    assert ran.returncode == 0, ran.stderr
    return json.loads(ran.stdout)


def hold_saying(layout, smi, **asked) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + HOLD_SAYING, json.dumps(asked)],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **machine_env(layout), **smi.env()},
        cwd="/",
    )


def a_stand_in_mps_daemon(tmp_path) -> subprocess.Popen:
    """A process called as NVIDIA's MPS control daemon is: what finding one looks for."""
    daemon = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(shutil.which("sleep"), daemon)
    started = subprocess.Popen([str(daemon), "300"])
    wait_until(
        lambda: Path(f"/proc/{started.pid}/comm").read_text().strip() == "nvidia-cuda-mps",
        what="the stand-in MPS daemon running",
    )
    return started


def test_every_view_of_a_slice_says_how_its_compute_is_shared_by_time_or_by_mps(
    tmp_path, only_our_mps_daemon, ends
):
    """Guards against a slice shown as if its card's cores were its own: without an MPS
    control daemon its compute is shared by time, and each view (the claim's status line
    and widget, the terminal, ``machine status``, ``%claims`` and the panel's snapshot)
    must say so; with one, the slice is told its share of the cores and the views say MPS."""
    if mps_daemon_runs():
        pytest.skip("a real MPS control daemon runs on this machine: no view says 'by time'")
    smi = StandInSmi(tmp_path / "smi", [card(0)])
    with machine(gpus=1, env=smi.env()) as layout:
        service_has_read(smi)
        half = hold_saying(layout, smi, gpus=0.5)
        ends.append(half)
        got = heard(half)
        assert got["mps"] is None
        # Every view names how the card is held, too: the machine's answer, as the claim's.
        held = cards_held_here().label
        assert f"a slice of card 0 (gpu_ram=21.5GB, compute shared by time, {held})" in got["line"]
        assert got["held"]["card slices"]["label"] == "compute shared by time"
        shown = fluksio_nb(env={**machine_env(layout), **smi.env()}).stdout
        assert "  card 0: 1 claim, 21/43 GB, compute shared by time\n" in shown, shown
        assert "card slices: compute shared by time" in shown
        status = fluksio_nb("machine", "status", "--prefix", str(layout.prefix)).stdout
        assert "card slices: compute shared by time (no MPS control daemon" in status
        seen = views(layout, smi)
        assert seen["panel"]["label"] == seen["monitor_held"]["label"] == "compute shared by time"
        assert seen["monitor"] == ["card 0: 1 claim, 21/43 GB, compute shared by time"]

        daemon = a_stand_in_mps_daemon(tmp_path)
        ends.append(daemon)
        quarter = hold_saying(layout, smi, gpus=0.25)
        ends.append(quarter)
        got = heard(quarter)
        assert got["mps"] == "25"
        assert f"(gpu_ram=10.7GB, compute: 25% of the card's cores (MPS), {held})" in got["line"]
        assert got["held"]["card slices"]["label"] == "compute: 25% of the card's cores (MPS)"
        mps = "compute: each its share of the card's cores (MPS)"
        shown = fluksio_nb(env={**machine_env(layout), **smi.env()}).stdout
        assert f"  card 0: 2 claims, 32/43 GB, {mps}\n" in shown, shown
        assert f"card slices: {mps}" in shown
        status = fluksio_nb("machine", "status", "--prefix", str(layout.prefix)).stdout
        assert f"card slices: {mps} (an MPS control daemon runs" in status
        seen = views(layout, smi)
        assert seen["panel"]["label"] == seen["monitor_held"]["label"] == mps
        assert seen["monitor"] == [f"card 0: 2 claims, 32/43 GB, {mps}"]
        daemon.kill()
        daemon.wait()
        let_go(half)
        let_go(quarter)
