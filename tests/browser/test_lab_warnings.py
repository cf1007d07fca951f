"""A claim the machine's books warn of, as JupyterLab shows it.

Before an admin's rule ends a claim (its time limit near, its cards idle
while someone waits), the books warn of it. The failures guarded against:
a warning that reaches the owner's cell but no view of the machine, so that
the person waiting never learns the card is about to be theirs; and an
owner who looks at another tab and is told nothing until the claim is gone.

The books are set up with ``fluksio-nb machine init``, giving idle cards
back (``idle_card_minutes``, test-sized, with a grace of half an hour, so
the warning stays while the page is looked at); the card is a stand-in
``nvidia-smi``'s, idle. The server's user holds it and another claim waits
for it, each from a process of its own through the client every kernel uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fluksio_nb.machine.setup import Layout
from tests.browser.lab import OUTPUT, JupyterLab, scroll_to
from tests.browser.test_lab_notices import recording_toasts, toasts_seen
from tests.gpu_standins import StandInSmi, card
from tests.machines import heard, machine, process, wait_until

pytestmark = pytest.mark.timeout(240)

IDLE = {"idle_card_minutes": 0.02, "idle_card_grace_minutes": 30}
#: How the warning begins, whatever its numbers and times.
WARNED = "'s card 0 has been idle (0 % use, memory unchanged)"


@pytest.fixture(scope="module")
def books(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    smi = StandInSmi(tmp_path_factory.mktemp("smi"), [card(0, used_mib=1024)])
    with machine(cpus=2, gpus=1, config=IDLE, env=smi.env()) as layout:
        yield layout


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, books: Layout) -> Iterator[JupyterLab]:
    lab = JupyterLab(tmp_path_factory.mktemp("warnings"), FLUKSIO_LEDGER=str(books.run_dir))
    lab.start()
    yield lab
    lab.stop()


@pytest.fixture
def idle_claim_with_a_waiter(books: Layout) -> Iterator[None]:
    """The server's user holds the card and leaves it idle; another claim waits for it."""
    holder = process(
        books,
        """
        t = q.enqueue(Resources(cpus=1, gpus=1), label="holds the card")
        q.wait(t, timeout=60)
        say(held=True)
        sys.stdin.read()
        """,
    )
    started = [holder]
    try:
        # The card is the holder's before the other asks: they would race for it.
        assert heard(holder) == {"held": True}
        waiter = process(
            books,
            """
            t = q.enqueue(Resources(cpus=1, gpus=1), label="waits for it")
            say(queued=True)
            sys.stdin.read()
            """,
        )
        started.append(waiter)
        assert heard(waiter) == {"queued": True}
        yield
    finally:
        for one in started:
            one.kill()
            one.wait()


def test_the_panel_shows_a_claims_warning_and_its_owner_is_told(
    server: JupyterLab, idle_claim_with_a_waiter: None, page: Any
) -> None:
    """Guards against a warning of the books that no view of the machine shows, and an
    owner not told of it while they look elsewhere."""
    [running] = wait_until(
        lambda: [c for c in server.api("GET", "fluksio/api/snapshot")["running"] if c["warning"]],
        timeout=60,
        what="a warning in the server's snapshot",
    )
    assert WARNED in running["warning"] and "idle_card_minutes" in running["warning"]
    ui = page.page
    ui.goto(server.url("lab/workspaces/warnings"))
    # Long before the extension's first look: the page is still loading JupyterLab.
    recording_toasts(ui)

    ui.locator(".fluksio-lab-status").click()
    panel = ui.locator("#fluksio-nb-panel")
    row = panel.locator(".fluksio-lab-list-running .fluksio-lab-claim.fluksio-lab-warned")
    row.wait_for(timeout=30_000)
    said = row.locator(".fluksio-lab-claim-warning")
    assert said.is_visible() and said.inner_text() == running["warning"]
    # The one waiting is not warned of anything.
    assert panel.locator(".fluksio-lab-list-waiting .fluksio-lab-warned").count() == 0

    wait_until(
        lambda: any(WARNED in text for text in toasts_seen(ui, "warning")),
        what=f"a warning notice saying {WARNED!r}",
    )
    assert page.errors == [], page.errors
    OUTPUT.mkdir(parents=True, exist_ok=True)
    scroll_to(said)
    ui.screenshot(path=str(OUTPUT / "lab-panel-warning.png"))
