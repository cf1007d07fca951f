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
import subprocess
import sys

import pytest

from fluksio_nb.machine.connection import read_snapshot
from tests.gpu_standins import StandInSmi, card
from tests.machines import fluksio_nb, heard, machine, machine_env, wait_until

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


def hold(layout, smi, **asked) -> subprocess.Popen:
    """A process that claims ``asked`` on the machine's books and holds it until told."""
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + HOLD, json.dumps(asked)],
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


def service_has_read(smi: StandInSmi, passes: int = 1) -> None:
    """Wait for the service to have read the cards: a grant is decided on them."""
    wait_until(
        lambda: sum(1 for c in smi.calls() if c and c[0].startswith("--query-gpu")) >= passes,
        what=f"{passes} passes of the cards",
    )


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
    """Guards against a whole-card claim granted beside a slice, and against slices that
    come after it taking the room its card frees, one after another, for ever."""
    smi = StandInSmi(tmp_path / "smi", [card(0)])
    with machine(gpus=1, env=smi.env()) as layout:
        half = hold(layout, smi, gpus=0.5)
        ends.append(half)
        assert heard(half)["gpus"] == [0]
        whole = hold(layout, smi, gpus=1)
        ends.append(whole)
        wait_until(lambda: labels_waiting(layout) == 1, what="the whole-card claim waiting")
        # A slice after it would fit beside the half: it waits behind the whole card.
        quarter = hold(layout, smi, gpus=0.25)
        ends.append(quarter)
        wait_until(lambda: labels_waiting(layout) == 2, what="the slice waiting behind it")
        assert len(books(layout)["running"]) == 1

        let_go(half)
        got = heard(whole)
        assert (got["gpus"], got["gpu_bytes"]) == ([0], 0)
        assert len(books(layout)["running"]) == 1 and labels_waiting(layout) == 1
        let_go(whole)
        assert heard(quarter)["gpu_bytes"] == CARD // 4


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
        # Behind the 20G one, which waits for this card: not granted, though it would fit.
        wait_until(lambda: labels_waiting(layout) == 2, what="the small slice waiting")
        let_go(first)
        assert heard(second)["gpu_bytes"] == 20 * 10**9
        assert heard(small)["gpu_bytes"] == 10 * 10**9


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
