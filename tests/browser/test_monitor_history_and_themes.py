"""The monitor's history plot and the widgets' colours, in a real JupyterLab, light and dark.

Only a browser shows these: a plot that is drawn once and never moves, axis
labels that are missing, and text whose colour reads on a white page but
not on JupyterLab's dark one (WCAG asks for 4.5:1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.lab import JupyterLab, contrast_failures, history_plot_moves, until_exists

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


def widgets_on_show(lab: JupyterLab, notebook, name: str) -> tuple[Any, Any, Any]:
    """The notebook, a running claim's widget, and the monitor with a failed claim finished.

    The running claim is held until the test is done with it and makes
    ``<name>-done`` in the server's home: a claim that ended on its own clock,
    on a loaded machine, would have left nothing running to look at.
    """
    nb = notebook(
        f"{name}.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim cpus=1 --background --label fine\n" + until_exists(lab.home / f"{name}-done"),
            "%claims",
            f"%%claim cpus=1 --label failing-{name}\nraise ValueError('boom')",
        ],
    )
    nb.run_all()
    nb.wait_for(1, ".fluksio-claim[data-phase=running] [data-field=rss]")
    running = nb.output_of(1).locator(".fluksio-claim")
    monitor = nb.wait_for(2, ".fluksio-monitor")
    # The failed claim's ending is shown in the colour of a failure: that text is checked too.
    # The list is the user's last finished claims, earlier tests' failures among them.
    failed = monitor.locator("[data-list=finished] [data-ending=error]")
    failed.filter(has_text=f"failing-{name}").wait_for(timeout=60_000)
    return nb, running, monitor


def test_in_the_dark_theme_every_widget_text_keeps_its_contrast(lab, dark, notebook, page):
    """The claim widget's and the monitor's text must read at 4.5:1 on JupyterLab Dark."""
    try:
        nb, running, monitor = widgets_on_show(lab, notebook, "dark")
        assert page.page.evaluate("document.body.dataset.jpThemeLight") == "false"
        nb.screenshot("widgets-dark")
        for name, widget in (("claim", running), ("monitor", monitor)):
            low = contrast_failures(widget.first)
            assert low == [], f"text in the {name} widget below 4.5:1 on the dark theme: {low}"
        assert page.errors == [], page.errors
    finally:
        (lab.home / "dark-done").touch()


def test_in_the_light_theme_every_widget_text_keeps_its_contrast(lab, notebook, page):
    """The same on JupyterLab Light, which the dark theme's colours must not spoil."""
    try:
        _, running, monitor = widgets_on_show(lab, notebook, "light")
        for name, widget in (("claim", running), ("monitor", monitor)):
            low = contrast_failures(widget.first)
            assert low == [], f"text in the {name} widget below 4.5:1 on the light theme: {low}"
    finally:
        (lab.home / "light-done").touch()
