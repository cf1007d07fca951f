"""The run's own places, for ``tests`` and for the notebooks nbval runs as tests.

Here rather than in ``tests/conftest.py``: pytest reads a conftest in the
directories it is given and in their parents up to the rootdir, and
``--nbval notebooks`` is given ``notebooks/`` alone. Each run writes its
usage records, runtime files and temporary files in a directory of its own,
removed when it ends, and fails if it left any in the user's data directory
or the machine's temporary places anyway (:mod:`tests.leaks`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.leaks import Run, leaks, redirect

_RUN = pytest.StashKey[Run]()
_LEFT = pytest.StashKey[list[Path]]()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_RUN] = redirect(os.environ)


def pytest_sessionfinish(session: pytest.Session) -> None:
    run = session.stash.get(_RUN, None)
    if run is None:
        return
    left = session.config.stash[_LEFT] = leaks(run)
    if left and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    left = config.stash.get(_LEFT, [])
    if left:
        terminalreporter.section("written outside the run's own places", red=True)
        for path in left:
            terminalreporter.write_line(str(path))
