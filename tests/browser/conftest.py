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
def chromium() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


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


@pytest.fixture
def page(request: pytest.FixtureRequest, server: JupyterLab, chromium: Any) -> Iterator[Page]:
    """A fresh page; a failing test leaves a screenshot of it, and the server's log, behind."""
    context = chromium.new_context(viewport={"width": 1280, "height": 1000})
    watched = Page(context.new_page())
    yield watched
    if request.node.stash.get(_FAILED, False):
        OUTPUT.mkdir(parents=True, exist_ok=True)
        watched.page.screenshot(path=str(OUTPUT / f"FAILED-{request.node.name}.png"))
        (OUTPUT / f"FAILED-{request.node.name}.log").write_text(server.log())
    context.close()
    server.shutdown_kernels()


@pytest.fixture
def notebook(server: JupyterLab, page: Page) -> Callable[[str, list[str]], Notebook]:
    """``notebook(name, cells)``: the notebook written, opened, and its kernel idle."""

    def open_notebook(name: str, cells: list[str]) -> Notebook:
        server.write_notebook(name, cells)
        return Notebook(server, page.page, name).open()

    return open_notebook
