"""A claimed cell as JupyterLab (light and dark) and Notebook 7 show it while it runs.

The failures guarded against are the ones only a front end shows: a claimed
cell's traceback, or the kernel's own, in colours that read under 4.5:1 on a
theme's error background (JupyterLab draws ANSI colours in one palette made
for a white page; labextension/style/base.css shades them), in colours other
than the kernel's own scheme, or with "/" wrapped in a link to nowhere
(labextension/src/errors.ts); and the kernel said "Idle" a second into a
claimed cell, because the widget's subshell request was answered with an
idle that JupyterLab took for the kernel's.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser.lab import (
    CONTRAST_JS,
    JupyterLab,
    not_notebook7s_own,
    until_exists,
    wait_in_page,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.keeps_its_page]

FRONT_ENDS = ["JupyterLab Light", "JupyterLab Dark", "Notebook 7"]


@pytest.fixture(scope="module", params=FRONT_ENDS)
def server(request: pytest.FixtureRequest) -> Iterator[JupyterLab]:
    """Each test in JupyterLab's light theme, its dark theme, and Notebook 7.

    For the module, so that the tests run a front end at a time, each in the
    page the one before left (``keeps_its_page``).
    """
    if request.param == "Notebook 7":
        yield request.getfixturevalue("notebook7")
        return
    lab: JupyterLab = request.getfixturevalue("lab")
    lab.use_theme(request.param)
    yield lab
    lab.use_theme("JupyterLab Light")


FAILING = "x = 1\ndef divide(a):\n    return a / 0\ndivide(x)"

#: A module in the server's root dir that fails inside itself: its traceback
#: names a file JupyterLab can open.
MODULE = "def divide(a):\n    return a / 0\n"

#: Each anchor in a traceback: its text and its href (null for none).
ANCHORS_JS = "e => [...e.querySelectorAll('a')].map(a => [a.textContent, a.getAttribute('href')])"


def traceback_of(nb, index: int, said: str) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """Cell ``index``'s traceback, once it ran: its coloured pieces and its anchors."""
    nb.run_cell(index)
    nb.wait_until_ran(index)
    error = nb.output_of(index).locator('[data-mime-type="application/vnd.jupyter.stderr"]')
    error.filter(has_text="ZeroDivisionError").first.wait_for(timeout=60_000)
    error = error.first
    assert said in error.inner_text(), error.inner_text()
    return error.evaluate(CONTRAST_JS), error.evaluate(ANCHORS_JS)


def colours(pieces: list[dict[str, Any]]) -> list[str]:
    """The colours a traceback's pieces are drawn in, each once."""
    return sorted({piece["colour"] for piece in pieces})


def test_a_claimed_cells_traceback_reads_in_the_kernels_colours(server, notebook, page):
    """Every piece of a claimed cell's traceback must read at 4.5:1, in the kernel's colours.

    The kernel's own traceback of the same error too, and IPython 9's marked
    expression (dark on yellow) as well; the claimed cell's colours are the
    plain cell's. No anchor leads nowhere: none without an href, none around
    punctuation; and a file's path in a traceback (a module in the server's
    root dir) stays a link where the front end links paths (JupyterLab).
    Guards against JupyterLab's white-page palette on the error background
    (cyan at 1.6:1 on the light theme's #fdd, red at 3.9:1 on the dark
    theme's), IPython's 256-colour keywords (3.7:1 and 2.9:1), and the "/"
    of ``a / 0`` wrapped in a link with no href.
    """
    module = f"failing_{uuid.uuid4().hex[:8]}"
    (server.root / f"{module}.py").write_text(MODULE)
    nb = notebook(
        "traceback.ipynb",
        [
            "%load_ext fluksio_nb",
            FAILING,
            "%%claim cpus=1\n" + FAILING,
            f"%%claim cpus=1\nimport {module}\n{module}.divide(1)",
        ],
    )
    nb.run_cell(0)
    nb.wait_until_ran(0)
    plain, plain_anchors = traceback_of(nb, 1, "return a / 0")
    claimed, claimed_anchors = traceback_of(nb, 2, "return a / 0")
    in_module, module_anchors = traceback_of(nb, 3, f"{module}.py")
    theme = page.page.evaluate("document.body.dataset.jpThemeName")
    nb.screenshot(f"claimed-traceback-{server.app}-{theme}".replace(" ", "-"))
    unreadable = [
        (which, piece)
        for which, pieces in [("plain", plain), ("claimed", claimed), ("module", in_module)]
        for piece in pieces
        if piece["ratio"] < 4.5
    ]
    assert unreadable == [], f"pieces under 4.5:1 in {theme}: {unreadable}"
    marked = [piece for piece in claimed if "ansi-yellow-bg" in piece["cls"]]
    assert marked, f"no marked expression (dark on yellow) to judge: {claimed}"
    # The kernel's scheme: no colour the plain cell's traceback does not use,
    # but for the marked expression, drawn on a background of its own (the
    # worker finds the failing expression where the kernel does not).
    unmarked = [piece for piece in claimed if "-bg" not in piece["cls"]]
    foreign = sorted(set(colours(unmarked)) - set(colours(plain)))
    assert foreign == [], f"colours the kernel's own traceback never uses: {foreign}"
    anchors = plain_anchors + claimed_anchors + module_anchors
    nowhere = [a for a in anchors if not a[1] or not re.search(r"\w", a[0])]
    assert nowhere == [], f"links to nowhere: {nowhere}"
    if server.app == "jupyter-lab":
        # Notebook 7 links no paths at all (its link handler opens none).
        linked = [text for text, href in module_anchors if f"{module}.py" in text and href]
        assert linked, f"the module's path is not a link: {module_anchors}"
    assert not_notebook7s_own(page.errors) == [], page.errors


def test_the_kernel_is_busy_for_the_whole_of_a_claimed_cell(server, notebook, page):
    """The kernel's status must never read idle while the claimed cell runs.

    In JupyterLab its status bar, and in every front end the server's own
    account of the kernel (``api/sessions``), which follows the same list of
    messages that do not count. Guards against the widget's subshell request
    (JEP 91), answered with a busy and an idle of its own, being taken for
    the kernel's status.
    """
    # Each front end's own: JupyterLab's two themes share a server.
    go = server.home / f"busy-{uuid.uuid4().hex}"
    nb = notebook("busy.ipynb", ["%load_ext fluksio_nb", "%%claim cpus=1\n" + until_exists(go)])
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
          window.fluksioSeenBy = new MutationObserver(read);
          window.fluksioSeenBy.observe(document.body,
            {subtree: true, childList: true, characterData: true});
          read();
        }"""
    )
    nb.run_cell(1)
    nb.wait_for(1, ".fluksio-claim")
    # Every sample is taken while the cell is sure to be running: it waits for
    # ``go``, made only after the last one. Sampling on until the cell's end
    # raced the server's idle against the prompt's update.
    server_said = []
    try:
        for _ in range(25):
            server_said.append(nb.kernel_state())
            page.page.wait_for_timeout(200)
        seen = page.page.evaluate("window.fluksioSeen.slice()")
    finally:
        go.touch()
        # Nothing of the test's own goes on in the page the next test is given.
        page.page.evaluate("() => window.fluksioSeenBy?.disconnect()")
    nb.wait_until_ran(1)
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
    wait_in_page(
        page.page,
        "area => area.innerText.includes('second')",
        arg=area.element_handle(),
        timeout_ms=60_000,
    )
    shown = area.evaluate(ORDER_JS)
    assert shown[0] == "record" and "\n".join(shown[1:]) == "first\nsecond", shown


def test_a_monitor_whose_kernel_is_gone_says_it_is_stale(server, notebook, page):
    """``%claims`` must say its figures are stale once its kernel is shut down.

    Guards against the monitor staying as it was after "Shut Down Kernel",
    kernel RSS included, with nothing saying that none of it is live; and
    against one that says so only after 15 s of silence, when the front end
    had said at once that the kernel was dead.
    """
    nb = notebook("stale.ipynb", ["%load_ext fluksio_nb", "%claims"])
    nb.run_all()
    monitor = nb.wait_for(1, ".fluksio-monitor")
    monitor.locator("[data-field=kernel-rss]").wait_for(timeout=60_000)
    assert monitor.get_attribute("data-stale") == "no"
    server.shutdown_kernels()
    # The page finds the kernel gone at its next look at the running kernels,
    # up to 10 s later; 15 s of silence would mark the monitor stale too, and
    # the two raced (silence won once in five whole runs). The page looks now.
    page.page.evaluate("() => window.jupyterapp.serviceManager.kernels.refreshRunning()")
    stale = nb.output_of(1).locator(".fluksio-monitor[data-stale=yes]")
    stale.wait_for(timeout=60_000)
    assert stale.get_attribute("data-stale-why") == "gone"
    assert "Stale: the kernel that showed this is gone" in stale.inner_text()
