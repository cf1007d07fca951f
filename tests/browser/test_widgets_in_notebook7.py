"""The live widgets in a real Notebook 7, in headless Chromium, as a user sees them.

Notebook 7 is built from JupyterLab's components but is its own application,
with its own build of the widget manager and its own page. The failures
guarded against are the ones only that page shows: widget.js not loaded there
(nothing drawn, "Error displaying widget", or only the text fallback),
widget.css not applied, a status that never reaches done, a monitor that does
not draw the machine, and a label run as HTML instead of shown as text.
"""

from __future__ import annotations

import re
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


def test_the_notebook_page_shows_the_machine_and_opens_the_panel_in_one_click(notebook, page):
    """Guards against a Notebook 7 page with nothing of the machine on it, where the panel
    could be reached only through View › Left Sidebar.

    Notebook 7 has no status bar: the shares and the kernel's memory must be
    in the page's top bar, and one click on them must show the panel.
    """
    nb = notebook("topbar.ipynb", ["block = bytearray(120_000_000)"])
    nb.run_all()
    nb.wait_until_ran(0)
    ui = page.page
    top = ui.locator("#top-panel #fluksio-nb-topbar")
    shares = top.locator(".fluksio-lab-status")
    shares.wait_for(timeout=30_000)
    assert shares.inner_text().startswith("cpus 0/2 used"), shares.inner_text()
    kernel = top.locator(".fluksio-lab-glance [data-field=kernel]")
    kernel.wait_for(timeout=30_000)
    assert re.fullmatch(r"Kernel \d+\.\dMB", kernel.inner_text()), kernel.inner_text()
    assert top.locator(".fluksio-lab-glance [data-field=host]").inner_text().startswith("Host CPU ")
    # On the page, beside the notebook's name: not under it, not off its right edge.
    box, page_width = top.bounding_box(), ui.viewport_size["width"]
    assert box["width"] > 0 and box["x"] + box["width"] <= page_width, (box, page_width)
    panel = ui.locator("#fluksio-nb-panel")
    assert not panel.is_visible()
    shares.click()
    panel.wait_for(state="visible", timeout=10_000)
    assert panel.locator(".fluksio-lab-bar-track").count() == 3
    nb.screenshot("notebook7-topbar-and-panel")
    assert not_notebook7s_own(page.errors) == [], page.errors
