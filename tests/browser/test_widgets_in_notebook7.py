"""The live widgets in a real Notebook 7, in headless Chromium, as a user sees them.

Notebook 7 is built from JupyterLab's components but is its own application,
with its own build of the widget manager and its own page. The failures
guarded against are the ones only that page shows: widget.js not loaded there
(nothing drawn, "Error displaying widget", or only the text fallback),
widget.css not applied, a status that never reaches done, a monitor that does
not draw the machine, and a label run as HTML instead of shown as text.
"""

from __future__ import annotations

import time

import pytest

from tests.browser.cell_records import each_ending_said_once, records_survive_saving
from tests.browser.lab import (
    HOSTILE,
    JupyterLab,
    history_plot_moves,
    memory_hog,
    not_notebook7s_own,
    peak_rss_of,
    phases_until_the_record,
    stray_text,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def server(notebook7: JupyterLab) -> JupyterLab:
    """``page`` and ``notebook`` drive Notebook 7 in this module."""
    return notebook7


def test_the_claim_status_and_the_monitor_draw_in_notebook_7(notebook, page):
    """Both widgets must be drawn by widget.js, styled by widget.css, and follow the kernel.

    The claimed cell allocates 300 MiB for a few seconds: its status must
    reach done with a peak RSS to match, and its label, which is HTML, must
    show as text. ``%claims`` must then draw the declared machine's cpus.
    """
    nb = notebook(
        "notebook7.ipynb",
        [
            "%load_ext fluksio_nb",
            memory_hog(HOSTILE),
            "%claims",
        ],
    )
    nb.run_all()
    # Only widget.js makes .fluksio-claim; the fallback is a .fluksio-status.
    claim = nb.wait_for(1, ".fluksio-claim")
    assert claim.locator(".fluksio-label").inner_text() == HOSTILE
    # The 3px edge comes from widget.css alone: the record's is inline, on another element.
    assert claim.evaluate("e => getComputedStyle(e).borderLeftWidth") == "3px"
    assert "running when this was saved" not in nb.output_of(1).inner_text(), (
        "the fallback was drawn"
    )
    seen, record = phases_until_the_record(nb.output_of(1))
    assert seen[0] in ("waiting", "running"), seen
    said = record.inner_text()
    assert said.startswith(f"{HOSTILE}: ok · waited "), said
    peak = peak_rss_of(said)
    assert 300 * 2**20 <= peak < 1500 * 2**20, f"peak RSS {peak} is not what a 300 MiB cell uses"
    assert "Error displaying widget" not in nb.output_of(1).inner_text()

    monitor = nb.wait_for(2, ".fluksio-monitor")
    cpus = monitor.locator("[data-field=cpus]")
    cpus.wait_for(timeout=30_000)
    assert cpus.get_attribute("data-value") == "0"
    assert cpus.inner_text() == "0/2 used"
    assert stray_text(monitor) == [], "the monitor drew text that is no section of it"
    assert "Error displaying widget" not in nb.output_of(2).inner_text()

    time.sleep(1)  # an onerror handler would have fired by now
    assert nb.panel.locator(".jp-OutputArea img").count() == 0
    assert page.dialogs == [], f"a label was run as HTML: {page.dialogs}"
    nb.screenshot("notebook7-widgets")
    assert not_notebook7s_own(page.errors) == [], page.errors


def test_a_saved_notebook_opened_again_in_notebook_7_shows_each_record(notebook, page, server):
    """No "model not found" in Notebook 7 either: what was saved is each claim's record."""
    records_survive_saving(notebook, server)
    assert not_notebook7s_own(page.errors) == [], page.errors


@pytest.mark.timeout(300)
def test_each_ending_is_said_once_in_notebook_7_too(notebook, page, server):
    """The record, then the why, once each, in light and dark, in Notebook 7's page."""
    each_ending_said_once(notebook, page.page, server)
    assert not_notebook7s_own(page.errors) == [], page.errors


def test_the_monitors_history_plot_moves_in_notebook_7_too(notebook, page):
    """The monitor's plot gains points against its scales in Notebook 7's page."""
    history_plot_moves(notebook, page)
    assert not_notebook7s_own(page.errors) == [], page.errors
