"""The machine at a glance, its history from the first look, and a clean layout, in JupyterLab.

What only a browser shows, and what this guards against:

- a status bar that counts claimed cores only: no kernel memory, no host
  CPU or memory (what users of jupyter-resource-usage look at there), and a
  2-core machine with one core kept back that says "1" with no word of the
  other;
- ``%claims`` opening on "Collecting…" while the server has had the
  machine's history since it started;
- one series drawn in two colours in two views (memory green in the
  monitor, blue in the panel);
- a widget whose sparkline scale wraps and sticks out past its edge at
  720 px, or whose parts overflow at 400 px; panel bars of three lengths;
- a running dot and an empty bar track below 3:1 (WCAG 1.4.11, for what is
  not text), measured from the colours the browser computed, with the
  running dot's pulse stopped at each point of its cycle; and a dot that
  pulses on for a user who asked for less motion.

The server declares 2 cores with 1 kept back for kernels.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.lab import OUTPUT, JupyterLab, contrast_failures, evaluate_each, until_exists
from tests.browser.test_lab_history import open_panel, switch_theme
from tests.test_server import call, wait_for

pytestmark = pytest.mark.timeout(240)

KEPT_BACK = "2 cores: 1 for claims, 1 kept back for kernels and the server"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    """A JupyterLab of its own: 2 cores, 1 kept back (the fixtures ``page`` and ``notebook``)."""
    lab = JupyterLab(
        tmp_path_factory.mktemp("glance-lab"),
        {"FLUKSIO_CPUS": "2", "FLUKSIO_RESERVE_CPUS": "1", "FLUKSIO_GPUS": "0"},
    ).start()
    yield lab
    lab.stop()


def test_the_status_bar_says_the_kernels_memory_the_hosts_use_and_the_core_kept_back(
    server, notebook, page
):
    """Guards against a status bar with shares only, and a reserve core nobody mentions."""
    nb = notebook("glance.ipynb", ["block = bytearray(150_000_000)"])
    nb.run_all()
    nb.wait_until_ran(0)
    ui = page.page
    kernel = ui.locator(".fluksio-lab-glance [data-field=kernel]")

    def kernel_mb() -> float | None:
        said = re.fullmatch(r"Kernel (\d+\.\d)MB", kernel.inner_text()) if kernel.count() else None
        return float(said.group(1)) if said and float(said.group(1)) >= 150 else None

    wait_for(kernel_mb, "the notebook's kernel with its 150 MB in the status bar", 60)

    def host_said():
        # Empty until the server's first reading of the host.
        said = ui.locator(".fluksio-lab-glance [data-field=host]").inner_text()
        return said if re.fullmatch(r"Host CPU \d+% · RAM \S+B/\S+B", said) else None

    wait_for(host_said, "the host's CPU and memory in the status bar", 30)
    # The shares item is still what it was: claimed out of what the books hand out.
    assert ui.locator(".fluksio-lab-status").inner_text().startswith("cpus 0/1 used")
    assert KEPT_BACK in ui.locator(".fluksio-lab-status").get_attribute("title")
    assert KEPT_BACK in ui.locator(".fluksio-lab-glance").get_attribute("title")
    panel = open_panel(ui)
    assert panel.locator(".fluksio-lab-kept-back").inner_text() == KEPT_BACK
    assert page.errors == [], page.errors


def history_points(server: JupyterLab) -> list[dict[str, Any]]:
    status, _, body = call(server, "GET", "fluksio/api/history")
    assert status == 200, body
    return body["points"]


#: A series' stroke as the browser computed it, for each chart it is drawn in.
STROKES_JS = """
(selectors) => Object.fromEntries(Object.entries(selectors).map(([name, selector]) => {
  const line = document.querySelector(selector);
  return [name, line ? getComputedStyle(line).stroke : null];
}))
"""


def test_claims_opens_with_the_servers_history_in_the_panels_colours(server, notebook, page):
    """Guards against ``%claims`` opening empty, and a series coloured differently per view.

    The server has kept points since it started; the monitor must draw them
    at once, before its own kernel could have taken three of its own (one
    every two seconds, the first only starting the counters).
    """
    wait_for(lambda: len(history_points(server)) >= 4, "four points of the server's history", 60)
    nb = notebook("history-first.ipynb", ["%load_ext fluksio_nb", "%claims"])
    nb.run_all()
    monitor = nb.wait_for(1, ".fluksio-monitor [data-section=history]")
    cpu = monitor.locator("[data-field=history-cpu]")
    assert cpu.count() == 1, monitor.inner_text()
    assert int(cpu.get_attribute("data-points")) >= 3

    ui = page.page
    open_panel(ui).locator('[data-chart="memory"] path').first.wait_for(timeout=30_000)
    strokes = ui.evaluate(
        STROKES_JS,
        {
            "monitor cpu": ".fluksio-monitor .fluksio-line-cpu",
            "panel cpu": '#fluksio-nb-panel [data-chart="cpu"] path[data-series="cpu"]',
            "monitor memory": ".fluksio-monitor .fluksio-line-memory",
            "panel memory": '#fluksio-nb-panel [data-chart="memory"] path[data-series="memory"]',
            "monitor outside": ".fluksio-monitor .fluksio-line-outside",
            "panel outside": '#fluksio-nb-panel [data-chart="cpu"] path[data-series="outside"]',
        },
    )
    for series in ("cpu", "memory", "outside"):
        assert strokes[f"monitor {series}"] == strokes[f"panel {series}"], strokes
    assert len({strokes["panel cpu"], strokes["panel memory"], strokes["panel outside"]}) == 3
    assert page.errors == [], page.errors


#: What sticks out of ``root``: each element whose box passes its left or right edge,
#: and each piece of inline text (a scale, a clock) that wrapped onto a second line.
LAYOUT_JS = """
(root) => {
  const edge = root.getBoundingClientRect();
  const out = [];
  for (const e of root.querySelectorAll('*')) {
    const box = e.getBoundingClientRect();
    if (!box.width || !box.height) continue;
    if (box.right > edge.right + 0.5 || box.left < edge.left - 0.5) {
      out.push(`${e.getAttribute('class') || e.tagName} [${Math.round(box.left - edge.left)}, `
        + `${Math.round(box.right - edge.left)}] of ${Math.round(edge.width)}`);
    }
  }
  for (const e of root.querySelectorAll('.fluksio-scale, .fluksio-clock, .fluksio-name')) {
    if (e.getClientRects().length > 1) out.push(`${e.className} wrapped: ${e.textContent}`);
  }
  return out;
}
"""

#: The contrast of a non-text mark (a dot, a bar's track) on what is behind it: the better of
#: its fill and its edge (an inset box-shadow), its fill at its computed opacity, and the
#: worst of that over its animation, stopped at each tenth of it.
NON_TEXT_JS = """
(element) => {
  const parse = value => {
    const m = /rgba?\\(([^)]+)\\)/.exec(value || '');
    if (!m) return null;
    const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, under) => under.map((v, i) => top[i] * top[3] + v * (1 - top[3]));
  const behind = e => {
    const layers = [];
    for (; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    let colour = [255, 255, 255];
    for (const layer of layers.reverse()) colour = over(layer, colour);
    return colour;
  };
  const luminance = rgb => {
    const [r, g, b] = rgb.map(v => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const ratio = (a, b) => {
    const [x, y] = [luminance(a), luminance(b)];
    return (Math.max(x, y) + 0.05) / (Math.min(x, y) + 0.05);
  };
  const back = behind(element.parentElement);
  const now = () => {
    const style = getComputedStyle(element);
    const opacity = Number(style.opacity);
    let best = 0;
    const fill = parse(style.backgroundColor);
    if (fill) best = ratio(over([...fill.slice(0, 3), fill[3] * opacity], back), back);
    const shadow = /inset/.test(style.boxShadow) ? parse(style.boxShadow) : null;
    if (shadow) {
      const edge = over([...shadow.slice(0, 3), shadow[3] * opacity], back);
      best = Math.max(best, ratio(edge, back));
    }
    return best;
  };
  const animations = element.getAnimations();
  if (!animations.length) return now();
  let worst = Infinity;
  for (let tenth = 0; tenth < 10; tenth++) {
    for (const a of animations) {
      a.pause();
      a.currentTime = (a.effect.getTiming().duration * tenth) / 10;
    }
    worst = Math.min(worst, now());
  }
  for (const a of animations) a.play();
  return worst;
}
"""


def non_text_below_3(locator: Any) -> list[tuple[str, float]]:
    def marks() -> list[list[Any]]:
        return evaluate_each(locator, f"e => [e.getAttribute('class'), ({NON_TEXT_JS})(e)]")

    def styled(found: list[list[Any]]) -> bool:
        # 0 is no colour read at all, not a contrast to judge: an element gone from
        # the page by the time it is read has an empty computed style.
        return bool(found) and all(ratio > 0 for _, ratio in found)

    drawn = wait_for(marks, f"{locator} drawn with its stylesheet", 30, until=styled)
    return [(name, round(ratio, 2)) for name, ratio in drawn if ratio < 3]


@pytest.fixture
def widgets_and_panel(server, notebook, page) -> Iterator[tuple[Any, Any, Any]]:
    """A running claim's widget with its sparklines drawn, the monitor with a finished
    claim, and the panel: the notebook, the page, and the panel."""
    # Its own file each time: one a test before touched would end this claim at once.
    released = server.home / f"layout-done-{secrets.token_hex(4)}"
    nb = notebook(
        f"{released.name}.ipynb",
        [
            "%load_ext fluksio_nb",
            "%%claim cpus=1 --label quick\nx = 1",
            "%%claim cpus=1 --background --label layout\n"
            "block = bytearray(120_000_000)\n" + until_exists(released),
            "%claims",
        ],
    )
    ui = page.page
    panel = open_panel(ui)
    nb.run_all()
    # Two readings make a sparkline, and its scale beside it.
    nb.wait_for(2, ".fluksio-claim[data-phase=running] [data-field=scale]", 90_000)
    nb.wait_for(3, ".fluksio-monitor [data-list=finished] .fluksio-item")
    panel.locator(".fluksio-lab-list-finished .fluksio-lab-claim").first.wait_for(timeout=30_000)
    try:
        yield nb, ui, panel
    finally:
        released.touch()


def test_the_widgets_and_the_panel_lay_out_cleanly_at_720_and_400_px(widgets_and_panel, page):
    """Guards against a scale label that wraps and sticks out past a 720 px widget, parts
    that overflow a 400 px output, bars of three lengths, and "AM" alone on a line."""
    nb, _, panel = widgets_and_panel
    running = nb.output_of(2).locator(".fluksio-claim")
    monitor = nb.output_of(3).locator(".fluksio-monitor")
    seen = {}
    for width in (720, 400):
        for name, widget in (("claim", running), ("monitor", monitor)):
            # The output the widget is drawn in, as wide as a notebook would make it.
            # (JupyterLab lets an output grow: its width is held by max-width too.)
            widget.evaluate(
                "(e, width) => { const output = e.closest('.jp-OutputArea-output'); "
                "output.style.width = output.style.maxWidth = width + 'px'; }",
                width,
            )
            drawn = widget.evaluate("e => e.getBoundingClientRect().width")
            assert drawn == width, (name, width, drawn)
            seen[f"{name} at {width}"] = widget.evaluate(LAYOUT_JS)
        bars = running.locator(".fluksio-meter .fluksio-bar").evaluate_all(
            "bs => bs.map(b => Math.round(b.getBoundingClientRect().width))"
        )
        assert len(bars) == 2 and bars[0] == bars[1], (width, bars)
        nb.screenshot(f"layout-widgets-{width}")
    assert all(not out for out in seen.values()), seen

    for width in (720, 400, 260):
        panel.evaluate("(e, width) => { e.style.width = width + 'px'; }", width)
        tracks = panel.locator(".fluksio-lab-bar-track").evaluate_all(
            "ts => ts.map(t => { const b = t.getBoundingClientRect(); "
            "return [Math.round(b.left), Math.round(b.right)]; })"
        )
        assert len(tracks) == 3 and len(set(map(tuple, tracks))) == 1, (width, tracks)
        assert panel.evaluate(LAYOUT_JS) == [], width
        # "ended 3:19:17 AM" on one line: the text from "ended" on has one line's rects.
        lines = panel.locator(".fluksio-lab-list-finished .fluksio-lab-claim").first.evaluate(
            """row => {
              const walker = document.createTreeWalker(row, NodeFilter.SHOW_TEXT);
              for (let n = walker.nextNode(); n; n = walker.nextNode()) {
                const at = n.textContent.indexOf('ended');
                if (at < 0) continue;
                const range = document.createRange();
                range.setStart(n, at);
                range.setEnd(n, n.textContent.length);
                return new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
              }
              return null;
            }"""
        )
        assert lines == 1, (width, lines)
    OUTPUT.mkdir(parents=True, exist_ok=True)
    panel.screenshot(path=str(OUTPUT / "layout-panel-260.png"))
    assert page.errors == [], page.errors


def test_the_running_dot_and_empty_bars_keep_3_to_1_in_light_and_dark(widgets_and_panel):
    """Guards against a running dot that pulses down to 2.2:1 and an empty track at 2.6:1
    on the dark theme, against a fix for dark that spoils light, and against a dot that
    pulses on for a user who asked for less motion."""
    nb, ui, panel = widgets_and_panel
    dot = nb.output_of(2).locator(".fluksio-claim[data-phase=running] .fluksio-dot")

    def pulses() -> list[int]:
        return evaluate_each(dot, "e => e.getAnimations().length")

    # The suite's pages ask for reduced motion (tests/browser/lab.py); this one
    # asks for motion, so that the pulse is judged at each point of its cycle.
    ui.emulate_media(reduced_motion="no-preference")
    try:
        wait_for(lambda: pulses() == [1], "the running dot pulsing", 30)
        ui.emulate_media(reduced_motion="reduce")
        assert pulses() == [0], "the dot pulses for a user who asked for less motion"
        ui.emulate_media(reduced_motion="no-preference")
        failing = _contrast_in_light_and_dark(nb, ui, panel, dot)
    finally:
        ui.emulate_media(reduced_motion="reduce")
    assert all(not marks for parts in failing.values() for marks in parts.values()), failing


def _contrast_in_light_and_dark(nb: Any, ui: Any, panel: Any, dot: Any) -> dict[str, Any]:
    """The marks under 3:1 in each theme, by part; the light theme again after."""
    failing = {}
    for theme, light in (("JupyterLab Light", True), ("JupyterLab Dark", False)):
        if not light:
            switch_theme(ui, theme, light)
        # The status item's words too, which no other test reads.
        low = contrast_failures(ui.locator(".fluksio-lab-glance"))
        assert low == [], (theme, low)
        failing[theme] = {
            "running dot": non_text_below_3(dot),
            "widget bars": non_text_below_3(nb.panel.locator(".fluksio-bar")),
            "panel bars": non_text_below_3(panel.locator(".fluksio-lab-bar-track")),
        }
    switch_theme(ui, "JupyterLab Light", True)
    return failing
