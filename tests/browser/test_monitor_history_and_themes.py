"""The monitor's history plot and the widgets' colours, in a real JupyterLab, light and dark.

Only a browser shows these: a plot that is drawn once and never moves, axis
labels that are missing, and text whose colour reads on a white page but
not on JupyterLab's dark one (WCAG asks for 4.5:1).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.browser.lab import JupyterLab, contrast_failures, history_plot_moves

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def dark(lab: JupyterLab) -> Iterator[None]:
    """JupyterLab's dark theme for pages opened in this test, and the light one after it."""
    lab.use_theme("JupyterLab Dark")
    yield
    lab.use_theme("JupyterLab Light")


def test_the_monitors_history_plot_moves_against_its_scales(notebook, page):
    """The plot must gain points while shown, with 0-100% and 0-total memory on its axes."""
    history_plot_moves(notebook, page)
    assert page.errors == [], page.errors


def test_in_the_dark_theme_every_widget_text_keeps_its_contrast(dark, notebook, page):
    """The claim widget's and the monitor's text must read at 4.5:1 on JupyterLab Dark."""
    nb = notebook(
        "dark.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim cpus=1 --background --label fine\nimport time\ntime.sleep(30)",
            "%claims",
            "%%claim cpus=1 --label failing\nraise ValueError('boom')",
        ],
    )
    assert page.page.evaluate("document.body.dataset.jpThemeLight") == "false"
    nb.run_all()
    nb.wait_for(1, ".fluksio-claim[data-phase=running] [data-field=rss]")
    running = nb.output_of(1).locator(".fluksio-claim")
    monitor = nb.wait_for(2, ".fluksio-monitor")
    # The failed claim's ending is shown in the colour of a failure: that text is checked too.
    monitor.locator("[data-list=finished] [data-ending=error]").wait_for(timeout=60_000)
    nb.screenshot("widgets-dark")

    for name, widget in (("claim", running), ("monitor", monitor)):
        low = contrast_failures(widget.first)
        assert low == [], f"text in the {name} widget below 4.5:1 on the dark theme: {low}"
    assert page.errors == [], page.errors


def test_in_the_light_theme_every_widget_text_keeps_its_contrast(notebook, page):
    """The same on JupyterLab Light, which the dark theme's colours must not spoil."""
    nb = notebook(
        "light.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim cpus=1 --background --label fine\nimport time\ntime.sleep(30)",
            "%claims",
            "%%claim cpus=1 --label failing\nraise ValueError('boom')",
        ],
    )
    nb.run_all()
    nb.wait_for(1, ".fluksio-claim[data-phase=running] [data-field=rss]")
    running = nb.output_of(1).locator(".fluksio-claim")
    monitor = nb.wait_for(2, ".fluksio-monitor")
    monitor.locator("[data-list=finished] [data-ending=error]").wait_for(timeout=60_000)
    for name, widget in (("claim", running), ("monitor", monitor)):
        low = contrast_failures(widget.first)
        assert low == [], f"text in the {name} widget below 4.5:1 on the light theme: {low}"
