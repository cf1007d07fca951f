"""The status-bar item and the side panel in a real JupyterLab, as a user sees them.

The failures guarded against are the ones only a browser shows: an extension
that does not load, a status bar that does not follow the machine, a panel
that cannot say which notebook holds a share, a cancel button that does
nothing, and a label that is run as HTML instead of shown as text.

One notebook is open in the page. A second notebook's kernel is started
through the server's sessions API and driven directly, as another tab or
another user would drive it.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from tests.browser.lab import OUTPUT, in_background, notebook_kernel, until_exists
from tests.kernels import run_in

pytestmark = pytest.mark.timeout(240)

HOSTILE = "<img src=x onerror=alert(1)><b>waits</b>"


def status_text(page: Any) -> str:
    return page.locator(".fluksio-lab-status").inner_text(timeout=30_000)


def wait_for_status(page: Any, expected: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        text = status_text(page)
        if not seen or seen[-1] != text:
            seen.append(text)
        if text == expected:
            return
        time.sleep(0.2)
    raise AssertionError(f"the status bar never showed {expected!r}; it showed {seen}")


def test_the_status_bar_and_panel_follow_every_notebooks_claims(lab, notebook, page):
    """The status bar must follow a claim from start to end; the panel must name the
    notebook holding a share, cancel a waiting claim, and show labels as text."""
    released = lab.home / "release-first"
    first = notebook(
        "first.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim cpus=1 gpus=1 --label first\n" + until_exists(released),
        ],
    )
    ui = page.page
    wait_for_status(ui, "cpus 0/2 used · gpus 0/2 used")
    first.run_all()
    wait_for_status(ui, "cpus 1/2 used · gpus 1/2 used")
    released.touch()
    wait_for_status(ui, "cpus 0/2 used · gpus 0/2 used")

    holder_released = lab.home / "release-holder"
    client = notebook_kernel(lab, "work/second.ipynb")
    try:
        holding = "block = bytearray(40_000_000)\n" + until_exists(holder_released)
        in_background(client, "gpus=2 --label holder", holding, "holder")
        in_background(client, f"gpus=1 --label '{HOSTILE}'", "print('ran')", "waiting")
        wait_for_status(ui, "cpus 1/2 used · gpus 2/2 used · 1 waiting")

        ui.locator(".fluksio-lab-status").click()
        panel = ui.locator("#fluksio-nb-panel")
        panel.wait_for(state="visible", timeout=10_000)
        running = panel.locator(".fluksio-lab-list-running .fluksio-lab-claim")
        waiting = panel.locator(".fluksio-lab-list-waiting .fluksio-lab-claim")
        waiting.first.wait_for(timeout=10_000)

        assert running.count() == 1 and waiting.count() == 1
        assert running.locator(".fluksio-lab-claim-label").inner_text() == "holder"
        assert running.locator(".fluksio-lab-claim-where").inner_text() == "work/second.ipynb"
        assert "gpus=2 (cards 0,1)" in running.locator(".fluksio-lab-claim-share").inner_text()
        held = panel.locator(".fluksio-lab-enforcement").inner_text()
        assert held.startswith("held by cores: ") and " · memory: " in held, held
        readings = running.locator(".fluksio-lab-claim-readings")
        deadline = time.monotonic() + 15
        while "RSS" not in readings.inner_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert readings.inner_text().startswith("RSS "), readings.inner_text()
        assert waiting.locator(".fluksio-lab-claim-label").inner_text() == HOSTILE
        # Its place in the queue, not its ticket number.
        place = waiting.locator(".fluksio-lab-claim-readings").inner_text()
        assert place.startswith("1st in the queue · "), place
        assert "#" not in panel.locator(".fluksio-lab-list-waiting").inner_text()
        time.sleep(1)  # an onerror handler would have fired by now
        assert panel.locator("img, b").count() == 0
        assert page.dialogs == [], f"a label was run as HTML: {page.dialogs}"
        OUTPUT.mkdir(parents=True, exist_ok=True)
        ui.screenshot(path=str(OUTPUT / "lab-panel.png"))

        waiting.locator(".fluksio-lab-cancel").click()
        waiting.first.wait_for(state="detached", timeout=10_000)
        ended = run_in(
            client,
            "try:\n    waiting.result(30)\nexcept Exception as error:\n"
            "    print(type(error).__name__, error)",
        )
        assert ended.startswith("ClaimCancelled") and "from JupyterLab" in ended, ended
        assert running.count() == 1, "cancelling the waiting claim must not stop the holder"
        assert json.loads(run_in(client, "import json; print(json.dumps(holder.status))")) == (
            "running"
        )
        assert page.errors == [], page.errors
    finally:
        holder_released.touch()
        client.stop_channels()


def test_a_queued_claim_says_its_place_and_when_it_may_start(lab, page):
    """Its place in the queue, not its ticket; and a guess at its start from the running
    claim's past runs, with what the guess rests on in the row's hover."""
    released = lab.home / "release-guessed"
    client = notebook_kernel(lab, "guess/holder.ipynb")
    try:
        # The guess is made from what it waits for: a past run of the holder.
        run_in(client, "%%claim cpus=2 --label holder\nx = 1")
        in_background(client, "cpus=2 --label holder", until_exists(released), "holder")
        in_background(client, "cpus=1 --label 'next in line'", "x = 1", "queued")
        ui = page.page
        ui.goto(lab.url("lab/workspaces/guess"))
        ui.locator(".fluksio-lab-status").click(timeout=30_000)
        waiting = ui.locator("#fluksio-nb-panel .fluksio-lab-list-waiting .fluksio-lab-claim")
        waiting.first.wait_for(timeout=30_000)
        said = waiting.locator(".fluksio-lab-claim-readings")
        assert re.fullmatch(
            r"1st in the queue · starts in (under a minute|about \d+ min)", said.inner_text()
        ), said.inner_text()
        why = said.get_attribute("title")
        # Another test here ran a holder too: how many past runs is not this test's.
        assert why.startswith("asked at "), why
        assert re.search(r"from \d+ past runs? of 'holder' and the running claims' ages$", why), why
        assert waiting.locator(".fluksio-lab-claim-label").inner_text() == "next in line"
        assert page.errors == [], page.errors
    finally:
        released.touch()
        client.stop_channels()
