"""The run's own places, for ``tests`` and for the notebooks nbval runs as tests.

Here rather than in ``tests/conftest.py``: pytest reads a conftest in the
directories it is given and in their parents up to the rootdir, and
``--nbval notebooks`` is given ``notebooks/`` alone. Each run writes its
usage records, runtime files and temporary files in a directory of its own,
removed when it ends, and fails if it left any in the user's data directory
or the machine's temporary places anyway (:mod:`tests.leaks`).

Run in parallel (``pytest -n``, as ``make test`` does), the run is the
controller's: it redirects the environment before it starts its workers, which
inherit it, and it alone lists the places before and after, with a watcher that
sees every worker and kernel as one of its descendants. A worker that listed
them too would take another worker's files, still there as it ended, for its
own leaks.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.leaks import Run, leaks, redirect

_RUN = pytest.StashKey[Run]()
_LEFT = pytest.StashKey[list[Path]]()


def _is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker, whose controller holds the run."""
    return hasattr(config, "workerinput")


# Before pytest-xdist's own sessionstart, which starts the workers.
@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_worker(session.config):
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


_UNGROUPED = pytest.StashKey[set[str]]()


# After pytest-xdist's own hook, on a worker: what it made of the groups.
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup``, the tests whose group did not get into their id.

    That id is all the run's controller schedules by. A pytest-xdist that can
    no longer write it (pyproject.toml) spreads a notebook's cells over workers
    that each start its kernel afresh, and they fail as if the notebook did:
    they fail saying why instead.
    """
    if getattr(session.config.option, "loadgroup", False):
        session.config.stash[_UNGROUPED] = {
            item.nodeid
            for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
        }


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.nodeid in item.config.stash.get(_UNGROUPED, set()):
        pytest.fail(
            "pytest-xdist did not keep this test with its group (xdist_group): with this "
            "pytest, run without workers (-n 0), or see pyproject.toml's pin of pytest",
            pytrace=False,
        )
