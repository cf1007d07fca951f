"""The cards in a real JupyterLab: who holds their memory, in the panel and the status bar.

The server detects its cards as it would on a GPU machine, through an
``nvidia-smi`` on its ``PATH``: here a stand-in (:mod:`tests.gpu_standins`)
that lists the real pid of a claimed cell's worker and of a process nobody
claimed. The failure guarded against is the one people on shared cards meet
every day: a card that is busy, and nothing that says whose it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.lab import OUTPUT, JupyterLab, until_exists
from tests.gpu_standins import StandInSmi, card
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cards(tmp_path_factory: pytest.TempPathFactory) -> StandInSmi:
    return StandInSmi(
        tmp_path_factory.mktemp("smi"), [card(0, utilisation=61), card(1, utilisation=3)]
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cards: StandInSmi) -> Iterator[JupyterLab]:
    """A JupyterLab whose machine has the stand-in's two cards, found, not declared."""
    lab = JupyterLab(
        tmp_path_factory.mktemp("carded-lab"),
        inventory={"FLUKSIO_GPUS": None},
        PATH=cards.path_env(),
    ).start()
    yield lab
    lab.stop()


@pytest.fixture
def nobodys_process() -> Iterator[subprocess.Popen]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    yield process
    process.kill()
    process.wait()


def text_until(locator: Any, wanted: str, timeout_s: float = 30) -> str:
    """The locator's text once it contains ``wanted``; fails with what it showed instead."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = locator.inner_text(timeout=10_000) if locator.count() else ""
        if wanted in text:
            return text
        time.sleep(0.2)
    raise AssertionError(f"never showed {wanted!r}; showed {text!r}")


def test_the_panel_says_what_each_card_holds_and_whose_memory_nobody_claimed(
    server, notebook, page, cards, nobodys_process
):
    facts, released = server.home / "worker.json", server.home / "release-trainer"
    trainer = notebook(
        "trainer.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim gpus=1 --label trainer\n"
            "import json, os, time\n"
            f"with open({str(facts)!r}, 'w') as f:\n"
            "    card = int(os.environ['CUDA_VISIBLE_DEVICES'])\n"
            "    json.dump({'pid': os.getpid(), 'card': card}, f)\n" + until_exists(released),
        ],
    )
    try:
        trainer.run_all()
        assert wait_until(lambda: facts.exists() and facts.read_text(), timeout=60)
        worker = json.loads(facts.read_text())
        mine, other = worker["card"], 1 - worker["card"]
        busy = {mine: (61, 1200), other: (3, 500)}
        cards.set_cards(
            [card(i, utilisation=busy[i][0], used_mib=busy[i][1]) for i in sorted(busy)]
        )
        cards.set_apps(
            [
                {"uuid": cards.cards[mine]["uuid"], "pid": worker["pid"], "used_mib": 1200},
                {"uuid": cards.cards[other]["uuid"], "pid": nobodys_process.pid, "used_mib": 500},
            ]
        )
        ui = page.page
        text_until(ui.locator(".fluksio-lab-status"), "1 squatter")

        ui.locator(".fluksio-lab-status").click()
        panel = ui.locator("#fluksio-nb-panel")
        panel.wait_for(state="visible", timeout=10_000)
        text_until(panel.locator(".fluksio-lab-cards"), f"card {mine}: 61% busy, 1.3GB/42.9GB used")
        squatters = text_until(
            panel.locator(".fluksio-lab-squatters"),
            f"card {other}: 524.3MB held by pid {nobodys_process.pid}",
        )
        assert squatters.rstrip().endswith("no claim"), squatters
        readings = panel.locator(".fluksio-lab-list-running .fluksio-lab-claim-readings")
        text_until(readings, f"GPU 1.3GB on card {mine} (61% busy)")
        OUTPUT.mkdir(parents=True, exist_ok=True)
        ui.screenshot(path=str(OUTPUT / "lab-cards.png"))
        assert page.errors == [], page.errors
    finally:
        released.touch()
