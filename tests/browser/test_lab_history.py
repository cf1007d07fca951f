"""The panel's history, finished claims and colours in a real JupyterLab.

The failures guarded against: a history plot that is drawn once and never
moves, or has no scale to read it by; a claim that vanishes from the panel
as it ends, leaving no word of how it ended; a label run as HTML in the
finished list; and text that reads in the light theme but fades into the
dark one (WCAG asks for 4.5:1). Contrast is worked out from the colours the
browser computed, for every piece of text the panel and the status bar
show, in both themes, switched the way a user switches them: Settings >
Theme, which runs ``apputils:change-theme``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.browser.lab import (
    HOSTILE,
    OUTPUT,
    JupyterLab,
    contrast_failures,
    in_background,
    notebook_kernel,
    until_exists,
    wait_in_page,
)
from tests.kernels import run_in
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


def open_panel(page: Any) -> Any:
    page.locator(".fluksio-lab-status").click(timeout=30_000)
    panel = page.locator("#fluksio-nb-panel")
    panel.wait_for(state="visible", timeout=10_000)
    return panel


def open_lab(server: JupyterLab, page: Any, workspace: str) -> Any:
    """JupyterLab with no notebook open, and the panel shown."""
    page.goto(server.url(f"lab/workspaces/{workspace}"))
    return open_panel(page)


def test_finished_claims_stay_in_the_panel_with_how_they_ended(server, notebook, page):
    ended = notebook(
        "endings.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim cpus=1 --label 'went well'\nx = 1",
            f"%%claim cpus=1 --label '{HOSTILE}'\ny = 2",
            "%%claim cpus=1 --label 'went wrong'\nraise ValueError('on purpose')",
        ],
    )
    ui = page.page
    panel = open_panel(ui)
    ended.run_all()
    finished = panel.locator(".fluksio-lab-list-finished .fluksio-lab-finished")

    def ending_of(label: str) -> str | None:
        row = finished.filter(
            has=ui.locator(".fluksio-lab-claim-label", has_text=re.compile(f"^{re.escape(label)}$"))
        )
        return row.first.locator(".fluksio-lab-ending").inner_text() if row.count() else None

    assert wait_until(lambda: ending_of("went wrong") is not None, timeout=60), panel.inner_text()
    assert ending_of("went wrong") == "error"
    assert ending_of("went well") == "ok"
    assert ending_of(HOSTILE) == "ok"
    newest = finished.first.inner_text()
    assert newest.startswith("went wrong"), newest
    assert "endings.ipynb" in newest and "waited " in newest and "ran " in newest, newest
    assert "peak RSS " in finished.nth(1).inner_text(), finished.nth(1).inner_text()
    assert panel.locator("img").count() == 0
    assert page.dialogs == [], f"a label was run as HTML: {page.dialogs}"
    assert page.errors == [], page.errors


def test_the_history_plot_moves_and_has_its_scale(server, page):
    ui = page.page
    panel = open_lab(server, ui, "history")
    cpu = panel.locator('[data-chart="cpu"] svg')
    cpu.wait_for(timeout=30_000)
    first = cpu.get_attribute("data-latest")
    line = cpu.locator('path[data-series="cpu"]')
    drawn = line.get_attribute("d")

    # The server takes a point every 2 s; the panel reads them while it is shown.
    assert wait_until(lambda: cpu.get_attribute("data-latest") != first, timeout=30), (
        f"the CPU plot stayed at {first}"
    )
    assert wait_until(lambda: line.get_attribute("d") != drawn, timeout=30)
    assert line.get_attribute("d").startswith("M")
    scale = cpu.locator(".fluksio-lab-scale").all_text_contents()
    # 0, half and all, and three times: the %claims monitor's axes, label for label.
    assert scale == ["100%", "50%", "0%", "10 min ago", "5 min ago", "now"], scale
    memory = panel.locator('[data-chart="memory"]')
    caption = memory.locator("figcaption").inner_text()
    assert re.fullmatch(r"Host memory \S+/\S+ used", caption), caption
    total = caption.split("/")[1].removesuffix(" used")
    assert memory.locator(".fluksio-lab-scale").first.text_content() == total
    assert page.errors == [], page.errors


def switch_theme(page: Any, theme: str, light: bool) -> None:
    """Settings > Theme > ``theme``, as a user does it; until the page has it."""
    page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text="Settings").click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile("^Theme$")).hover()
    page.locator(
        '.lm-Menu-item[data-command="apputils:change-theme"]', has_text=theme
    ).first.click()
    wait_in_page(
        page,
        f"document.body.dataset.jpThemeName === {theme!r} "
        f"&& document.body.dataset.jpThemeLight === {str(light).lower()!r}",
        timeout_ms=30_000,
    )


def test_the_panel_and_status_bar_read_at_4_5_to_1_in_light_and_dark(server, page):
    """With every part of the panel on show: a running claim, a waiting one, finished
    ones, and the history."""
    released = server.home / "release-contrast"
    client = notebook_kernel(server, "themes/holder.ipynb")
    try:
        run_in(client, "%%claim cpus=1 --label 'finished first'\nx = 1")
        in_background(client, "cpus=2 --label holder", until_exists(released), "holder")
        in_background(client, "cpus=1 --label 'queued'", "print('ran')", "queued")

        ui = page.page
        panel = open_lab(server, ui, "contrast")
        for part in (
            ".fluksio-lab-list-running .fluksio-lab-claim",
            ".fluksio-lab-list-waiting .fluksio-lab-claim",
            ".fluksio-lab-list-finished .fluksio-lab-claim",
            '[data-chart="cpu"] path[data-series="cpu"]',
        ):
            panel.locator(part).first.wait_for(timeout=30_000)
        OUTPUT.mkdir(parents=True, exist_ok=True)
        seen = {}
        for theme, light in (("JupyterLab Light", True), ("JupyterLab Dark", False)):
            if not light:
                switch_theme(ui, theme, light)
            name = "light" if light else "dark"
            panel.screenshot(path=str(OUTPUT / f"lab-panel-{name}.png"))
            ui.screenshot(path=str(OUTPUT / f"lab-{name}.png"))
            seen[name] = {
                "panel": contrast_failures(ui.locator("#fluksio-nb-panel")),
                "status bar": contrast_failures(ui.locator(".fluksio-lab-status")),
            }
        failing = {
            f"{theme} {part}": texts
            for theme, parts in seen.items()
            for part, texts in parts.items()
            if texts
        }
        assert not failing, f"text below 4.5:1: {failing}"
        assert page.errors == [], page.errors
    finally:
        released.touch()
        # Back to the light theme for the tests that follow: the setting is the server's.
        with_light = server.settings_dir / "@jupyterlab" / "apputils-extension"
        (with_light / "themes.jupyterlab-settings").unlink(missing_ok=True)
        client.stop_channels()
