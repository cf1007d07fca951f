"""A claimed cell as JupyterLab (light and dark) and Notebook 7 show it while it runs.

The failures guarded against are the ones only a front end shows: a claimed
cell's traceback in a dark terminal's palette, unreadable on the light
theme's error background, with "/" wrapped in an empty link; and the kernel
said "Idle" a second into a claimed cell, because the widget's subshell
request was answered with an idle that JupyterLab took for the kernel's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.lab import CONTRAST_JS, JupyterLab, not_notebook7s_own, until_exists

pytestmark = pytest.mark.timeout(240)

FRONT_ENDS = ["JupyterLab Light", "JupyterLab Dark", "Notebook 7"]


@pytest.fixture(params=FRONT_ENDS)
def server(request: pytest.FixtureRequest) -> Iterator[JupyterLab]:
    """Each test in JupyterLab's light theme, its dark theme, and Notebook 7."""
    if request.param == "Notebook 7":
        yield request.getfixturevalue("notebook7")
        return
    lab: JupyterLab = request.getfixturevalue("lab")
    lab.use_theme(request.param)
    yield lab
    lab.use_theme("JupyterLab Light")


FAILING = "x = 1\ndef divide(a):\n    return a / 0\ndivide(x)"

#: Each coloured piece of a traceback: its text, its computed colour, and its contrast.
PIECES_JS = CONTRAST_JS


EMPTY_LINKS_JS = (
    "e => [...e.querySelectorAll('a')].filter(a => !a.getAttribute('href')).map(a => a.outerHTML)"
)


def traceback_of(nb, index: int) -> tuple[Any, list[dict[str, Any]]]:
    """Cell ``index``'s traceback (a locator) and its pieces, once it ran."""
    nb.run_cell(index)
    nb.wait_until_ran(index)
    error = nb.output_of(index).locator('[data-mime-type="application/vnd.jupyter.stderr"]')
    error.filter(has_text="ZeroDivisionError").first.wait_for(timeout=60_000)
    said = error.first.inner_text()
    assert "return a / 0" in said and "divide(x)" in said, said
    return error.first, error.first.evaluate(PIECES_JS)


def test_a_claimed_cells_traceback_reads_as_the_kernels_own(server, notebook, page):
    """A claimed cell's traceback must come in the colours of the same error in a plain cell.

    Every piece of it in a colour the plain cell's traceback uses, none reading
    worse against the error background, and no more empty links. Guards
    against the worker formatting in IPython's Linux scheme: identifiers near
    white (1.09:1) on JupyterLab Light's #ffdddd, each token in a span of its
    own.
    """
    nb = notebook(
        "traceback.ipynb", ["%load_ext fluksio_nb", FAILING, "%%claim cpus=1\n" + FAILING]
    )
    nb.run_cell(0)
    nb.wait_until_ran(0)
    plain_error, plain = traceback_of(nb, 1)
    claimed_error, claimed = traceback_of(nb, 2)
    theme = page.page.evaluate("document.body.dataset.jpThemeName")
    nb.screenshot(f"claimed-traceback-{server.app}-{theme}".replace(" ", "-"))
    kernels_colours = {piece["colour"] for piece in plain}
    # The expression that failed is marked (dark on yellow) where IPython finds
    # the source, as it does in the worker: a colour of its own, if it reads.
    foreign = [
        piece
        for piece in claimed
        if piece["colour"] not in kernels_colours and piece["ratio"] < 4.5
    ]
    assert foreign == [], f"pieces in colours the kernel's own traceback never uses: {foreign}"
    floor = min(piece["ratio"] for piece in plain)
    worse = [piece for piece in claimed if piece["ratio"] < min(floor, 4.5)]
    assert worse == [], f"pieces reading worse than the kernel's own ({floor:.2f}:1): {worse}"
    # JupyterLab's error renderer takes every "/" for a path and links it, in
    # the kernel's own tracebacks too: no more of them than there.
    empty, kernels_empty = (e.evaluate(EMPTY_LINKS_JS) for e in (claimed_error, plain_error))
    assert len(empty) <= len(kernels_empty), f"links to nowhere: {empty} against {kernels_empty}"
    assert not_notebook7s_own(page.errors) == [], page.errors


def test_the_kernel_is_busy_for_the_whole_of_a_claimed_cell(server, notebook, page):
    """The kernel's status must never read idle while the claimed cell runs.

    In JupyterLab its status bar, and in every front end the server's own
    account of the kernel (``api/sessions``), which follows the same list of
    messages that do not count. Guards against the widget's subshell request
    (JEP 91), answered with a busy and an idle of its own, being taken for
    the kernel's status.
    """
    nb = notebook(
        "busy.ipynb", ["%load_ext fluksio_nb", "%%claim cpus=1\nimport time\ntime.sleep(6)"]
    )
    nb.run_cell(0)
    nb.wait_until_ran(0)
    # Every change of the status bar's kernel item, with the prompt at the time.
    page.page.evaluate(
        """() => {
          window.fluksioSeen = [];
          const read = () => {
            const item = [...document.querySelectorAll('.jp-StatusBar-TextItem')]
              .find(e => e.textContent.includes('(ipykernel) |'));
            const prompt = document.querySelectorAll('.jp-Cell .jp-InputPrompt')[1];
            const now = [item ? item.textContent : '', prompt ? prompt.textContent : ''];
            const last = window.fluksioSeen[window.fluksioSeen.length - 1];
            if (!last || last[0] !== now[0] || last[1] !== now[1]) window.fluksioSeen.push(now);
          };
          new MutationObserver(read).observe(document.body,
            {subtree: true, childList: true, characterData: true});
          read();
        }"""
    )
    nb.run_cell(1)
    nb.wait_for(1, ".fluksio-claim")
    prompt = nb.panel.locator(".jp-Cell").nth(1).locator(".jp-InputPrompt")
    record = nb.output_of(1).locator(".fluksio-status")
    server_said = []
    # Until the record takes the widget's place, just before the cell's end.
    while "*" in prompt.inner_text() and not record.count():
        server_said.append(nb.kernel_state())
        page.page.wait_for_timeout(200)
    nb.wait_until_ran(1)
    seen = page.page.evaluate("window.fluksioSeen")
    assert "idle" not in server_said, f"the server said idle while the cell ran: {server_said}"
    if server.app == "jupyter-lab":
        # The prompt says [*] as the cell is sent, a moment before the kernel is busy with it.
        started = next(i for i, (status, p) in enumerate(seen) if "Busy" in status and "*" in p)
        idle = [(status, p) for status, p in seen[started:] if "Idle" in status and "*" in p]
        assert idle == [], f"the status bar said Idle while the cell ran: {seen}"


#: What each child of an output area shows, in order: "status" (the live widget),
#: "record", or its text; blank ones (a place held for the status) left out.
ORDER_JS = """area => [...area.querySelectorAll(':scope > .jp-OutputArea-child')]
  .map(c => c.querySelector('.fluksio-claim') ? 'status'
          : c.querySelector('.fluksio-status') ? 'record' : c.innerText.trim())
  .filter(Boolean)"""


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_claimed_cells_output_is_all_below_its_status_then_its_record(
    server, notebook, page, background
):
    """The live status, then the record in its place, above everything the cell printed.

    Guards against the first printed line sitting above the live status and the
    rest below it, and against a foreground cell's record going below its
    output where a background cell's stays above.
    """
    # Each front end's own: JupyterLab's two themes share a server.
    go = server.home / f"order-{uuid.uuid4().hex}"
    cell = (
        f"%%claim cpus=1 --label order{' --background' if background else ''}\n"
        "print('first', flush=True)\n" + until_exists(go) + "print('second')"
    )
    nb = notebook("order.ipynb", ["%load_ext fluksio_nb", cell])
    try:
        nb.run_cell(0)
        nb.wait_until_ran(0)
        nb.run_cell(1)
        area = nb.output_of(1)
        area.locator(".fluksio-claim[data-phase=running]").wait_for(timeout=60_000)
        area.get_by_text("first").wait_for(timeout=60_000)
        assert area.evaluate(ORDER_JS) == ["status", "first"], area.evaluate(ORDER_JS)
    finally:
        go.touch()
    area.locator(".fluksio-status").wait_for(timeout=60_000)
    page.page.wait_for_function(
        "area => area.innerText.includes('second')", arg=area.element_handle(), timeout=60_000
    )
    shown = area.evaluate(ORDER_JS)
    assert shown[0] == "record" and "\n".join(shown[1:]) == "first\nsecond", shown


def test_a_monitor_whose_kernel_is_gone_says_it_is_stale(server, notebook, page):
    """``%claims`` must say its figures are stale once its kernel is shut down.

    Guards against the monitor staying as it was after "Shut Down Kernel",
    kernel RSS included, with nothing saying that none of it is live.
    """
    nb = notebook("stale.ipynb", ["%load_ext fluksio_nb", "%claims"])
    nb.run_all()
    monitor = nb.wait_for(1, ".fluksio-monitor")
    monitor.locator("[data-field=kernel-rss]").wait_for(timeout=60_000)
    assert monitor.get_attribute("data-stale") == "no"
    server.shutdown_kernels()
    stale = nb.output_of(1).locator(".fluksio-monitor[data-stale=yes]")
    stale.wait_for(timeout=60_000)
    assert "Stale: the kernel that showed this is gone" in stale.inner_text()
