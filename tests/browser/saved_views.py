"""A ``%claims`` monitor and a running background claim, saved and opened again: read in
JupyterLab and Notebook 7 alike.

Both are live widgets. Saved while live, they were saved as widget views,
which a page opened again with a new kernel, or none, drew as "Error
displaying widget: model not found" or "Loading widget..." for good. Each
must instead read as it was saved (the monitor's text as of the clock time
it was drawn, the claim's "running when this was saved"), marked stale,
and, while their kernel lives, still be drawn live. The tests for each app
call :func:`live_views_read_as_saved` with that app's fixtures.
"""

from __future__ import annotations

import json
from typing import Any

from tests.browser.lab import JupyterLab, Notebook, contrast_failures, until_exists

SAVED_VIEW = "application/vnd.fluksio-nb.live-view+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

#: What no saved view may ever say, in either app.
BROKEN = ("model not found", "Error displaying widget", "Loading widget")

STALE = "Stale: the kernel that showed this is gone"


def live_views_read_as_saved(notebook: Any, server: JupyterLab) -> None:
    """Draw both live, save while the claim runs, then open again with a new kernel and with none.

    ``notebook`` is the tests' fixture of that name, ``server`` the app it drives.
    """
    release = server.home / "release-the-background-claim"
    nb = notebook(
        "live-saved.ipynb",
        [
            "%load_ext fluksio_nb",
            "%claims",
            f"%%claim cpus=1 --label bg --background\n{until_exists(release)}",
        ],
    )
    try:
        nb.run_all()
        # Live first: the extension's renderer must leave the live widgets drawn live.
        monitor = nb.wait_for(1, ".fluksio-monitor[data-stale=no]")
        monitor.locator("[data-field=host-memory]").wait_for(timeout=60_000)
        nb.wait_for(2, ".fluksio-claim[data-phase=running]")
        nb.wait_until_idle()
        nb.save()

        # The page opened again beside the same kernel, still running: still live, not stale.
        nb.open()
        nb.wait_for(1, ".fluksio-monitor[data-stale=no]")
        nb.wait_for(2, ".fluksio-claim[data-phase=running]")
        assert not nb.panel.locator(".fluksio-lab-saved-view[data-stale]").count()

        # (b) With a new kernel, which holds no widget of the old one's: in either theme.
        server.shutdown_kernels()
        nb.open()
        each_reads_as_saved(nb, "a new kernel")
        nb.screenshot(f"live-views-saved-new-kernel-{server.app}")
        low = contrast_failures(nb.panel.locator(".fluksio-lab-saved-view"))
        assert low == [], f"saved views below 4.5:1 on the light theme: {low}"
        server.use_theme("JupyterLab Dark")
        nb.open()
        nb.page.locator('body[data-jp-theme-light="false"]').wait_for(state="attached")
        each_reads_as_saved(nb, "a new kernel, in the dark theme")
        low = contrast_failures(nb.panel.locator(".fluksio-lab-saved-view"))
        assert low == [], f"saved views below 4.5:1 on the dark theme: {low}"

        # (a) With no kernel: shut down, and the notebook read again from disk.
        nb.menu("Kernel", "kernelmenu:shutdown")
        nb.panel.locator(".jp-Toolbar-kernelName", has_text="No Kernel").wait_for(timeout=60_000)
        # The views drawn before are marked, so that only those drawn again are read.
        nb.panel.evaluate(
            "p => p.querySelectorAll('.fluksio-lab-saved-view').forEach(v => v.dataset.old = 'yes')"
        )
        nb.menu("File", "docmanager:reload")
        each_reads_as_saved(nb, "no kernel")
        nb.screenshot(f"live-views-saved-no-kernel-{server.app}")

        # Saved live, with what front ends without the extension pick beside ours.
        saved = server.read_notebook("live-saved.ipynb")
        for index in (1, 2):
            kinds = {kind for o in saved["cells"][index]["outputs"] for kind in o.get("data", {})}
            assert {SAVED_VIEW, WIDGET_VIEW, "text/plain", "text/html"} <= kinds, (index, kinds)

        # An untrusted copy (another's, changed since it was signed) keeps its sanitized
        # HTML, as it did before: ours, like the widget view, is drawn only where trusted.
        saved["metadata"]["copied"] = True
        (server.root / "live-saved-copy.ipynb").write_text(json.dumps(saved))
        copy = Notebook(server, nb.page, "live-saved-copy.ipynb").open()
        for index, said in ((1, "machine as of "), (2, "bg: running when this was saved")):
            output = copy.output_of(index)
            output.get_by_text(said).first.wait_for(timeout=60_000)
            text = output.inner_text()
            assert not any(broken in text for broken in BROKEN), text
            assert not output.locator(".fluksio-lab-saved-view").count(), text
    finally:
        server.use_theme("JupyterLab Light")
        release.touch()


def each_reads_as_saved(nb: Notebook, how: str, timeout_ms: float = 60_000) -> None:
    """The monitor and the claim, opened again with ``how``, each say their saved text, stale."""
    for index, said in ((1, "machine as of "), (2, "bg: running when this was saved")):
        output = nb.output_of(index)
        stale = output.locator(".fluksio-lab-saved-view[data-stale=yes]:not([data-old])")
        try:
            stale.wait_for(timeout=timeout_ms)
        except Exception as error:
            raise AssertionError(
                f"with {how}, cell {index} was not drawn as saved; it shows:\n{output.inner_text()}"
            ) from error
        text = output.inner_text()
        assert said in text, (how, text)
        assert text.count(STALE) == 1, (how, text)
        assert not any(broken in text for broken in BROKEN), (how, text)
        assert not output.locator(".fluksio-monitor, .fluksio-claim").count(), (how, text)
    assert "Run %claims again in a running kernel." in nb.output_of(1).inner_text()
