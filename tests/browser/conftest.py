"""Fixtures for browser tests: one JupyterLab per session, a fresh page per test.

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

A module marked ``keeps_its_page`` is the one exception: each of its tests
in JupyterLab gets the page the module's last one left, if that test passed
and the server's settings are as they were, and ``notebook`` opens the next
notebook in the JupyterLab already loaded there (closing the documents the
page had open), as a user opens a second notebook. That took 2 CPU-s less
than loading JupyterLab again (measured: the two marked modules, 18 tests,
ran in 122 busy CPU-s against 142, and 13 s sooner). What such a page keeps
from test to test is its JavaScript's own state, so only a module whose
tests leave none behind (no script of their own left running in the page,
no permission, no page size, no setting) is marked.

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
    close_every_document,
    launch_chromium,
    launch_chromium_profile,
    missing_for_browser_tests,
)

MISSING = missing_for_browser_tests()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "browser: drives a real JupyterLab or Notebook 7 in headless Chromium"
    )
    config.addinivalue_line(
        "markers",
        "keeps_its_page: a test of this module gets the JupyterLab page its last test left",
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
    """A browser page and what it said while the test ran.

    ``loaded`` is whether it shows a JupyterLab that ``notebook`` may open
    the next notebook in: one a test of a ``keeps_its_page`` module left, or
    has opened a notebook in.
    """

    def __init__(self, page: Any, keeps_jupyterlab: bool, loaded: bool) -> None:
        self.page = page
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.keeps_jupyterlab = keeps_jupyterlab
        self.loaded = loaded
        page.on("dialog", self._dialog)
        page.on("pageerror", self._error)

    def _error(self, error: Any) -> None:
        # With its stack, which says whose code threw.
        self.errors.append(error.stack or str(error))

    def _dialog(self, dialog: Any) -> None:
        if dialog.type == "beforeunload":
            # "Leave the page?" as a test opens a notebook again: what it
            # needs saved it saved first, and checks that it was.
            dialog.accept()
            return
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    def stop_listening(self) -> None:
        """The next test's ``Page`` hears the page from here on, if it is kept."""
        self.page.remove_listener("dialog", self._dialog)
        self.page.remove_listener("pageerror", self._error)


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


#: The page the last test of a ``keeps_its_page`` module left, by what it
#: shows: (module, server, settings version) -> (page, profile). One at most.
_kept: dict[tuple[str, str, int], tuple[Any, Any]] = {}


def _shown_by(request: pytest.FixtureRequest, server: JupyterLab) -> tuple[str, str, int]:
    """What a page of this test shows, as ``_kept`` keys it."""
    return (request.node.module.__name__, server.base_url, server.settings_version)


def _forget_the_kept_page() -> None:
    for (_, server_url, _), (kept, profile) in _kept.items():
        _forget(kept, server_url, profile)
    _kept.clear()


@pytest.fixture(scope="module", autouse=True)
def no_page_kept_past_its_module() -> Iterator[None]:
    """A kept page is closed with its module: it would go on polling its server."""
    yield
    _forget_the_kept_page()


def _forget(page: Any, server_url: str, profile: Any) -> None:
    """Close ``page``, and clear what it left: the next page finds what a new window would."""
    devtools = profile.new_cdp_session(page)
    devtools.send(
        "Storage.clearDataForOrigin", {"origin": server_url, "storageTypes": LEFT_BY_A_PAGE}
    )
    devtools.detach()
    page.close()
    profile.clear_cookies()
    profile.clear_permissions()


@pytest.fixture
def page(request: pytest.FixtureRequest, server: JupyterLab, profile: Any) -> Iterator[Page]:
    """A fresh page, or the one a ``keeps_its_page`` module's last test left; a failing test
    leaves a screenshot of it, and the server's log, behind."""
    keeps = server.app == "jupyter-lab" and bool(request.node.get_closest_marker("keeps_its_page"))
    kept, _ = _kept.pop(_shown_by(request, server), (None, None)) if keeps else (None, None)
    # One of the module's that shows other settings, or another front end.
    _forget_the_kept_page()
    already_open = list(profile.pages)
    watched = Page(kept or profile.new_page(), keeps_jupyterlab=keeps, loaded=kept is not None)
    yield watched
    watched.stop_listening()
    failed = request.node.stash.get(_FAILED, None)
    if failed:
        OUTPUT.mkdir(parents=True, exist_ok=True)
        watched.page.screenshot(path=str(OUTPUT / f"FAILED-{request.node.name}.png"))
        (OUTPUT / f"FAILED-{request.node.name}.log").write_text(server.log())
    for opened in profile.pages:
        if opened not in already_open and opened is not watched.page:
            opened.close()
    # Kept only after its test ran and passed, and with nothing open: a
    # notebook would see its kernel end below.
    keep = keeps and watched.loaded and failed is False
    if keep:
        close_every_document(watched.page)
    server.shutdown_kernels()
    if keep:
        _kept[_shown_by(request, server)] = (watched.page, profile)
    else:
        _forget(watched.page, server.base_url, profile)


@pytest.fixture
def notebook(server: JupyterLab, page: Page) -> Callable[[str, list[str]], Notebook]:
    """``notebook(name, cells)``: the notebook written, opened, and its kernel idle."""

    def open_notebook(name: str, cells: list[str]) -> Notebook:
        server.write_notebook(name, cells)
        opened = Notebook(server, page.page, name)
        if page.loaded:
            return opened.open_in_the_loaded_page()
        opened.open()
        page.loaded = page.keeps_jupyterlab
        return opened

    return open_notebook
