"""Another user's long queue, on books every user shares, as JupyterLab shows it.

A snapshot of the machine's books lists only the first
:data:`~fluksio_nb.machine.books.OTHERS_WAITING_LISTED` of other users'
waiting claims, and counts the rest. The failure guarded against: a view that
shows the list and nothing more, so that a person reads a queue of 5,000 as
one of 100. The status bar, the panel and ``%claims`` must each count the
whole queue, and say once, in the words ``fluksio-nb`` uses in a terminal,
how many claims they do not list.

The server runs as root on books set up with ``fluksio-nb machine init``; the
queue is a real second Unix user's, made through the client every kernel uses.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from fluksio_nb.machine.books import OTHERS_WAITING_LISTED
from fluksio_nb.machine.setup import Layout
from tests.browser.lab import OUTPUT, JupyterLab, scroll_to
from tests.machines import machine, machine_env
from tests.unix_users import USER_A, as_user, ready_user, require_unix_users, user_environ

pytestmark = pytest.mark.timeout(240)

#: Their claims, each for the machine's one card: the first holds it, the rest wait.
THEIR_CLAIMS = OTHERS_WAITING_LISTED + 50
WAITING = THEIR_CLAIMS - 1
UNLISTED = WAITING - OTHERS_WAITING_LISTED
NOT_LISTED = f"and {UNLISTED} more of other users' claims, not listed"

QUEUE = """
import sys
from fluksio_nb import Resources, accountant
queue = accountant()
for n in range(int(sys.argv[1])):
    queue.enqueue(Resources(cpus=1, gpus=1), label=f"theirs {n}")
print("queued", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def books() -> Iterator[Layout]:
    require_unix_users()
    with machine(cpus=2, gpus=1) as layout:
        yield layout


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, books: Layout) -> Iterator[JupyterLab]:
    lab = JupyterLab(tmp_path_factory.mktemp("long-queue"), FLUKSIO_LEDGER=str(books.run_dir))
    lab.start()
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def their_queue(books: Layout) -> Iterator[None]:
    """Another user's claims, all in the books before the test looks: held until it ends."""
    user = ready_user(USER_A)
    process = subprocess.Popen(
        [*as_user(user), sys.executable, "-c", QUEUE, str(THEIR_CLAIMS)],
        env=user_environ(user, machine_env(books)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        said = process.stdout.readline().strip()
        assert said == "queued", f"their claims were not queued: {process.stderr.read()}"
        yield
    finally:
        process.kill()
        process.wait()


def test_the_status_bar_and_panel_count_the_whole_queue_and_say_what_is_not_listed(
    server: JupyterLab, their_queue: None, page: Any
) -> None:
    """Guards against a status bar saying `100 waiting` and a panel listing 100 claims,
    and nothing more, while 149 wait."""
    answer = server.api("GET", "fluksio/api/snapshot")
    assert (len(answer["waiting"]), answer["waiting_unlisted"]) == (OTHERS_WAITING_LISTED, UNLISTED)

    ui = page.page
    ui.goto(server.url("lab/workspaces/long-queue"))
    status = ui.locator(".fluksio-lab-status", has_text="waiting")
    status.wait_for(timeout=60_000)
    assert status.inner_text().endswith(f"gpus 1/1 used · {WAITING} waiting"), status.inner_text()
    assert f"{WAITING} waiting. Click to see them." in status.get_attribute("title")

    status.click()
    panel = ui.locator("#fluksio-nb-panel")
    rows = panel.locator(".fluksio-lab-list-waiting .fluksio-lab-claim")
    rows.nth(OTHERS_WAITING_LISTED - 1).wait_for(timeout=30_000)
    assert rows.count() == OTHERS_WAITING_LISTED
    heading = panel.locator(".fluksio-lab-heading", has_text="Waiting")
    assert heading.inner_text() == f"Waiting ({WAITING})"
    said = panel.get_by_text("more of other users' claims, not listed")
    assert said.count() == 1 and said.is_visible()
    assert said.inner_text() == NOT_LISTED
    assert page.errors == [], page.errors
    OUTPUT.mkdir(parents=True, exist_ok=True)
    scroll_to(said)
    ui.screenshot(path=str(OUTPUT / "lab-panel-long-queue.png"))


def test_claims_counts_the_whole_queue_and_says_what_is_not_listed(
    their_queue: None, notebook: Any, page: Any
) -> None:
    """Guards against the live monitor titling the queue `Waiting (100)` and listing
    100 claims, and nothing more, while 149 wait."""
    nb = notebook("long-queue.ipynb", ["%load_ext fluksio_nb", "%claims"])
    nb.run_all()
    waiting = nb.wait_for(1, ".fluksio-monitor [data-list=waiting]")
    rows = waiting.locator(".fluksio-item[data-ticket]")
    rows.nth(OTHERS_WAITING_LISTED - 1).wait_for(timeout=30_000)
    assert rows.count() == OTHERS_WAITING_LISTED
    assert waiting.locator(".fluksio-title").inner_text() == f"Waiting ({WAITING})"
    said = waiting.get_by_text("more of other users' claims, not listed")
    assert said.count() == 1 and said.inner_text() == NOT_LISTED
    assert page.errors == [], page.errors
    scroll_to(said)
    nb.screenshot("monitor-long-queue")
