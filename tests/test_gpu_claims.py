"""A claim's cards in a real kernel: what they hold, who else holds them, and the budget.

The kernel reads the cards as it would on a GPU machine, through an
``nvidia-smi`` on its ``PATH``: here a stand-in (:mod:`tests.gpu_standins`)
that lists the real pids of the claim's processes, with the card memory the
test says they hold. The failures guarded against: a claim whose card memory
is never seen, card memory that nobody's claim holds and nothing names, and a
``gpu_ram=`` budget that a claim can overrun and keep running.
"""

import subprocess
import sys

import pytest

from tests.gpu_standins import StandInSmi, card
from tests.kernels import started_kernel
from tests.user_books import users_books
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

MIB = 2**20

#: A block held across cells, with a process it started that the watch samples
#: for as long as the block is open.
OPEN_A_BLOCK = """
import json, sys, time
from fluksio_nb import ClaimHalted, claim
c = claim(gpus=1, gpu_ram="2G", label="training")
c.__enter__()
p = c.popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(json.dumps({"pid": p.pid, "card": c.allocation.gpus[0]}))
"""


def wait_in_the_kernel(condition: str) -> str:
    """A cell that waits, in the kernel, until ``condition`` holds (30 s at most)."""
    return (
        "import time as _t\n"
        "_deadline = _t.monotonic() + 30\n"
        f"while not ({condition}) and _t.monotonic() < _deadline:\n"
        "    _t.sleep(0.05)\n"
        f"assert {condition}, 'not met in 30 s'\n"
    )


@pytest.fixture
def two_cards(tmp_path):
    return StandInSmi(tmp_path / "smi", [card(0, utilisation=37), card(1, utilisation=5)])


@pytest.fixture
def squatter():
    """A process of nobody's claim, for the test to say holds card memory."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield process
    process.kill()
    process.wait()


def test_a_claims_card_memory_is_read_and_a_claim_over_its_gpu_ram_is_halted(
    tmp_path, two_cards, squatter
):
    with started_kernel(
        tmp_path, FLUKSIO_CPUS="2", FLUKSIO_RESERVE_CPUS="0", **two_cards.env()
    ) as kernel:
        held = kernel.run(OPEN_A_BLOCK, check=True).json()
        mine, other = two_cards.cards[held["card"]], two_cards.cards[1 - held["card"]]
        two_cards.set_apps(
            [
                {"uuid": mine["uuid"], "pid": held["pid"], "used_mib": 1000},
                {"uuid": other["uuid"], "pid": squatter.pid, "used_mib": 500},
            ]
        )

        # The claim's readings: its card, what its processes hold there, how busy it is.
        kernel.run(wait_in_the_kernel(f"c.readings.peak_gpu_bytes == {1000 * MIB}"), check=True)
        latest = kernel.facts(
            "[(s.index, s.held_bytes, s.total_bytes, s.utilisation_percent) "
            "for s in c.readings.latest.cards]"
        )
        busy = 37.0 if held["card"] == 0 else 5.0
        assert latest == [[held["card"], 1000 * MIB, 40960 * MIB, busy]]

        # The machine's books carry them, for every other kernel and the server.
        def reported():
            running = users_books(tmp_path / "ledger")["running"]
            readings = (running[0].get("readings") or {}) if running else {}
            return readings.get("gpu_bytes") == 1000 * MIB

        assert wait_until(reported, timeout=30), users_books(tmp_path / "ledger")["running"]

        # Over its gpu_ram=: halted, in one paragraph naming the card and the numbers.
        two_cards.set_apps([{"uuid": mine["uuid"], "pid": held["pid"], "used_mib": 3000}])
        kernel.run(wait_in_the_kernel("p.poll() is not None"), check=True)
        halted = kernel.run(
            "try:\n    c.run(int)\nexcept ClaimHalted as e:\n    print(e)\n"
            "finally:\n    c.__exit__(None, None, None)",
            check=True,
        ).stdout
        assert f"held 3.1GB of the card's 42.9GB on card {held['card']}" in halted
        assert "over its card memory budget of 2.0GB a card" in halted
        books = kernel.books()
        assert books["running"] == [] and books["gpus"]["free"] == 2
