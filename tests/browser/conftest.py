"""Fixtures for browser tests: one JupyterLab per session, one fresh page per test.

``lab`` is a running :class:`~tests.browser.lab.JupyterLab` with a declared
inventory (2 cpus, 2 GPUs, 4 GB, no reserve) and books of its own;
``notebook7`` is the same for Notebook 7, started only if a test asks for it.
``server`` is the one of them that ``page`` and ``notebook`` use: JupyterLab,
unless a test module overrides ``server``. Every test's kernels are shut down
after it, so a claim one test leaves running never holds the share the next
test asks for. ``page`` is a new Chromium page that records every JavaScript
dialog (none should ever open) and every error the page logs. ``notebook``
writes a notebook and opens it in that page.

The pages are opened in one Chromium profile for the session, whose disk
cache is kept from test to test, and nothing else is: after each test its
page is closed and the cookies, permissions and storage it left (local
storage, IndexedDB, service workers, the Cache API) are cleared, so that the
next test starts from what a new browser window would show. What the cache
keeps is JupyterLab's code, the same for every test, and V8's compiled form
of it: a notebook opened in a profile that had never seen it took Chromium
about a CPU-second more to load (measured: 2.8-3.2 s against 1.8-2.2 s), and
the tests open dozens.

The whole directory is skipped, with the reason, when Debian's Chromium or the
playwright package is missing: those, and nothing else, are what a machine
may genuinely lack.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.browser.lab import (
    OUTPUT,
    JupyterLab,
    Notebook,
    launch_chromium,
    launch_chromium_profile,
    missing_for_browser_tests,
)

MISSING = missing_for_browser_tests()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "browser: drives a real JupyterLab or Notebook 7 in headless Chromium"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/browser/" in item.nodeid:
            item.add_marker(pytest.mark.browser)
            if MISSING:
                item.add_marker(pytest.mark.skip(reason=MISSING))


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    server = JupyterLab(tmp_path_factory.mktemp("jupyterlab")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def notebook7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    server = JupyterLab(tmp_path_factory.mktemp("notebook7"), app="jupyter-notebook").start()
    yield server
    server.stop()


@pytest.fixture
def server(lab: JupyterLab) -> JupyterLab:
    """The server ``page`` and ``notebook`` drive; a module overrides this to drive another."""
    return lab


@pytest.fixture(scope="session")
def playwright_driver() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="session")
def chromium(playwright_driver: Any) -> Iterator[Any]:
    """A Chromium of its own, for a test that wants a browser rather than a page."""
    browser = launch_chromium(playwright_driver)
    yield browser
    browser.close()


@pytest.fixture(scope="session")
def profile(playwright_driver: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The session's one Chromium profile, which ``page`` opens its pages in."""
    folder = tmp_path_factory.mktemp("chromium-profile")
    context = launch_chromium_profile(playwright_driver, folder)
    yield context
    context.close()


class Page:
    """A browser page and what it said while the test ran."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("dialog", self._dialog)
        # With its stack, which says whose code threw.
        page.on("pageerror", lambda error: self.errors.append(error.stack or str(error)))

    def _dialog(self, dialog: Any) -> None:
        if dialog.type == "beforeunload":
            # "Leave the page?" as a test opens a notebook again: what it
            # needs saved it saved first, and checks that it was.
            dialog.accept()
            return
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_FAILED] = report.failed
    return report


_FAILED = pytest.StashKey[bool]()


#: What a test's page may have left in the profile, in Chromium's names
#: (``Storage.clearDataForOrigin``): everything but the HTTP cache.
LEFT_BY_A_PAGE = ",".join(
    [
        "cookies",
        "local_storage",
        "indexeddb",
        "websql",
        "file_systems",
        "service_workers",
        "cache_storage",
        "shared_storage",
        "storage_buckets",
    ]
)


@pytest.fixture
def page(request: pytest.FixtureRequest, server: JupyterLab, profile: Any) -> Iterator[Page]:
    """A fresh page; a failing test leaves a screenshot of it, and the server's log, behind."""
    already_open = list(profile.pages)
    watched = Page(profile.new_page())
    yield watched
    if request.node.stash.get(_FAILED, False):
        OUTPUT.mkdir(parents=True, exist_ok=True)
        watched.page.screenshot(path=str(OUTPUT / f"FAILED-{request.node.name}.png"))
        (OUTPUT / f"FAILED-{request.node.name}.log").write_text(server.log())
    # The next test's page finds what a new window would: the cache alone is kept.
    devtools = profile.new_cdp_session(watched.page)
    devtools.send(
        "Storage.clearDataForOrigin", {"origin": server.base_url, "storageTypes": LEFT_BY_A_PAGE}
    )
    devtools.detach()
    for opened in profile.pages:
        if opened not in already_open:
            opened.close()
    profile.clear_cookies()
    profile.clear_permissions()
    server.shutdown_kernels()


@pytest.fixture
def notebook(server: JupyterLab, page: Page) -> Callable[[str, list[str]], Notebook]:
    """``notebook(name, cells)``: the notebook written, opened, and its kernel idle."""

    def open_notebook(name: str, cells: list[str]) -> Notebook:
        server.write_notebook(name, cells)
        return Notebook(server, page.page, name).open()

    return open_notebook
