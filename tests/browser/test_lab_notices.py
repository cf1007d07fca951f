"""The notices in a real JupyterLab and Notebook 7: a queued claim starts, a long one ends.

A cell queued behind someone else's share may wait minutes, and its user
has long since looked elsewhere. The failures guarded against: no notice
when the claim starts, a notice that does not say which claim or which
notebook, no word of how a long claim ended, a notice the user turned off
in the settings that speaks anyway, and nothing through the browser's own
notifications while the tab is hidden (or something while it is in view).

The machine (2 CPUs) is held by a claim in a second notebook's kernel,
started through the server's sessions API; the page's own notebook queues
a claim behind it. The thresholds (10 s of waiting, 30 s of running) are
lowered to 1 s through the extension's settings file, as a user would set
them, rather than waited out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.browser.lab import (
    OUTPUT,
    JupyterLab,
    in_background,
    not_notebook7s_own,
    notebook_kernel,
    until_exists,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(params=["jupyter-lab", "jupyter-notebook"])
def server(request: pytest.FixtureRequest) -> JupyterLab:
    """JupyterLab, then Notebook 7: the notices must speak in both."""
    return request.getfixturevalue("lab" if request.param == "jupyter-lab" else "notebook7")


@pytest.fixture
def notice_settings(server: JupyterLab) -> Iterator[Callable[[dict[str, Any]], None]]:
    """``notice_settings({...})``: the extension's user settings, as the settings editor saves
    them; read by a page opened after. Taken away after the test, for the tests that follow."""
    path = server.settings_dir / "fluksio-nb" / "plugin.jupyterlab-settings"

    def write(settings: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))

    yield write
    path.unlink(missing_ok=True)


def waited_longer_than(server: JupyterLab, label: str, seconds: float) -> bool:
    """Whether the claim ``label`` is waiting, and has waited more than ``seconds``."""
    snapshot = server.api("GET", "fluksio/api/snapshot")
    return any(
        claim["label"] == label and time.time() - claim["since"] > seconds
        for claim in snapshot["waiting"]
    )


def hold_the_machine(server: JupyterLab, released: Any) -> Any:
    """A kernel whose background claim holds both CPUs until ``released`` exists."""
    client = notebook_kernel(server, "holders/holder.ipynb")
    in_background(client, "cpus=2 --label holder", until_exists(released), "holder")
    assert wait_until(
        lambda: any(
            claim["label"] == "holder"
            for claim in server.api("GET", "fluksio/api/snapshot")["running"]
        ),
        timeout=30,
    )
    return client


def queued_cell(go_on: Any) -> list[str]:
    """A notebook whose claim, once it starts, runs until ``go_on`` exists: long enough to
    be seen running, and to have run past the lowered threshold."""
    return [
        "%load_ext fluksio_nb",
        "%%claim cpus=1 --label 'after the holder'\n"
        + until_exists(go_on)
        + "print('its work is done')",
    ]


def boxes(locator: Any) -> list[dict[str, float]]:
    return [box for box in (one.bounding_box() for one in locator.all()) if box is not None]


RECORD_TOASTS = """() => {
    const seen = (window.fluksioToastsSeen = new Set());
    const look = () => {
        for (const toast of document.querySelectorAll("[class*='jp-Notification-Toast-']")) {
            seen.add(JSON.stringify([toast.className, toast.innerText]));
        }
    };
    new MutationObserver(look).observe(document.body, {
        childList: true, subtree: true, characterData: true,
    });
    look();
}"""


def recording_toasts(page: Any) -> None:
    """From now on the page remembers every toast it shows, also once it has closed.

    A notice closes itself after 10 s. Two come close together when a claim
    ends and the next starts, and on a loaded machine the one looked for
    second may have come and gone while the first was awaited.
    """
    page.evaluate(RECORD_TOASTS)


def toasts_seen(page: Any, kind: str) -> list[str]:
    """The text of every toast of ``kind`` shown since :func:`recording_toasts`."""
    seen = [json.loads(one) for one in page.evaluate("() => [...window.fluksioToastsSeen]")]
    return [text for classes, text in seen if f"jp-Notification-Toast-{kind}" in classes.split()]


def wait_for_toast(server: JupyterLab, page: Any, kind: str, text: str) -> str:
    """The text of the toast, once shown; fails with every toast shown and the server's
    finished claims, which say how a claim ended."""

    def found() -> str | None:
        return next((shown for shown in toasts_seen(page, kind) if text in shown), None)

    if not wait_until(lambda: found() is not None, timeout=90):
        everything = page.evaluate("() => [...window.fluksioToastsSeen]")
        finished = server.api("GET", "fluksio/api/finished")
        raise AssertionError(
            f"no {kind} notice saying {text!r}; shown: {everything}; finished: {finished}"
        )
    return found()


def test_a_claim_that_waited_says_so_when_it_starts_and_a_long_one_says_how_it_ended(
    server, notebook, page, notice_settings
):
    notice_settings({"startedAfterWaitingSeconds": 1, "endedAfterRunningSeconds": 1})
    released = server.home / f"release-{server.app}-holder"
    go_on = server.home / f"release-{server.app}-queued"
    client = hold_the_machine(server, released)
    try:
        queued = notebook("queued.ipynb", queued_cell(go_on))
        recording_toasts(page.page)
        queued.run_all()
        assert wait_until(lambda: waited_longer_than(server, "after the holder", 2), timeout=60)
        released.touch()

        ui = page.page
        started = wait_for_toast(server, ui, "info", "‘after the holder’ started after waiting")
        assert "in queued.ipynb" in started, started
        # The holder ran for seconds in another notebook of this user's, and ended well.
        holder = wait_for_toast(
            server, ui, "success", "‘holder’ in holders/holder.ipynb finished after running"
        )
        assert "in holders/holder.ipynb" in holder, holder
        # The toasts slide in from the right: the picture is taken once they are in full view.
        width = ui.viewport_size["width"]
        toasts = ui.locator("[class*='jp-Notification-Toast-']")
        assert wait_until(
            lambda: all(box["x"] + box["width"] <= width for box in boxes(toasts)), timeout=10
        )
        OUTPUT.mkdir(parents=True, exist_ok=True)
        ui.screenshot(path=str(OUTPUT / f"notices-{server.app}.png"))

        go_on.touch()
        wait_for_toast(
            server, ui, "success", "‘after the holder’ in queued.ipynb finished after running"
        )
        queued.wait_for(1, "text=its work is done")
        assert not_notebook7s_own(page.errors) == [], page.errors
    finally:
        released.touch()
        go_on.touch()
        client.stop_channels()


@pytest.mark.parametrize("server", ["jupyter-lab"], indirect=True)
def test_start_notices_turned_off_in_the_settings_stay_silent(
    server, notebook, page, notice_settings
):
    """The start notice is off. The queued claim's own end notice comes after the page
    saw it start: it is the proof that the start notice had its chance and said nothing."""
    notice_settings(
        {
            "notifyWhenStarted": False,
            "startedAfterWaitingSeconds": 1,
            "endedAfterRunningSeconds": 1,
        }
    )
    released = server.home / "release-silent-holder"
    go_on = server.home / "release-silent-queued"
    client = hold_the_machine(server, released)
    try:
        queued = notebook("silent.ipynb", queued_cell(go_on))
        recording_toasts(page.page)
        queued.run_all()
        assert wait_until(lambda: waited_longer_than(server, "after the holder", 2), timeout=60)
        released.touch()
        ui = page.page
        # The status bar counts the queued claim's one CPU once the page has seen it run.
        status = ui.locator(".fluksio-lab-status")
        assert wait_until(lambda: status.inner_text().startswith("cpus 1/2 used"), timeout=30)
        go_on.touch()
        wait_for_toast(
            server, ui, "success", "‘after the holder’ in silent.ipynb finished after running"
        )
        assert [said for said in toasts_seen(ui, "info") if "started after waiting" in said] == []
        assert page.errors == [], page.errors
    finally:
        released.touch()
        go_on.touch()
        client.stop_channels()


DESKTOP = """hidden => {
    Object.defineProperty(document, 'hidden', { configurable: true, get: () => hidden });
    if (window.fluksioDesktop === undefined) {
        const Browsers = window.Notification;
        window.fluksioDesktop = [];
        window.Notification = class extends Browsers {
            constructor(title, options) {
                super(title, options);
                window.fluksioDesktop.push(options.body);
            }
        };
    }
}"""


def tab_hidden(server: JupyterLab, page: Any, hidden: bool) -> None:
    """The browser may notify, as if the user had said yes once; the tab is ``hidden`` or
    in view; and from now on the page remembers what each notification it made said."""
    page.context.grant_permissions(["notifications"], origin=server.base_url)
    page.evaluate(DESKTOP, hidden)


def desktop_said(page: Any) -> list[str]:
    return page.evaluate("() => window.fluksioDesktop")


@pytest.mark.parametrize("server", ["jupyter-lab"], indirect=True)
def test_a_notice_reaches_the_desktop_while_its_tab_is_hidden_and_only_then(
    server, notebook, page, notice_settings
):
    """The user has looked elsewhere: the start after a wait comes through the browser's
    own notifications too. Back on the tab, the end is a toast and nothing more."""
    notice_settings({"startedAfterWaitingSeconds": 1, "endedAfterRunningSeconds": 1})
    released = server.home / "release-hidden-holder"
    go_on = server.home / "release-hidden-queued"
    client = hold_the_machine(server, released)
    try:
        queued = notebook("hidden.ipynb", queued_cell(go_on))
        ui = page.page
        recording_toasts(ui)
        queued.run_all()
        assert wait_until(lambda: waited_longer_than(server, "after the holder", 2), timeout=60)
        tab_hidden(server, ui, True)
        released.touch()
        started = "‘after the holder’ started after waiting"
        assert wait_until(lambda: any(started in said for said in desktop_said(ui)), timeout=90)

        tab_hidden(server, ui, False)
        go_on.touch()
        wait_for_toast(
            server, ui, "success", "‘after the holder’ in hidden.ipynb finished after running"
        )
        assert not [
            said
            for said in desktop_said(ui)
            if "‘after the holder’ in hidden.ipynb finished" in said
        ]
        assert page.errors == [], page.errors
    finally:
        released.touch()
        go_on.touch()
        client.stop_channels()
