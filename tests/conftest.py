"""Every test starts from a kernel that has read no settings.

The accountant is made once per process and reads ``FLUKSIO_*`` and the
user's config file when it is made, so a test that declared two GPUs would
otherwise leak them into the next, and a developer's own ``~/.jupyter`` would
change what the suite sees.

Run in parallel (``pytest -n N --dist loadgroup``, as ``make test`` does), the
tests that share a fixture wider than one test run on one worker, one after
another, as they would without workers: a module's kernel, say, or a
directory's session-wide server. Apart, each worker would start one of its
own, and sharing it is the point of the fixture.

The browser tests are the one exception (:data:`SHARED_BY_MODULE`). As one
group they ran one after another on one worker: 528 s of a 622 s run, more
than the 7 minutes the whole suite is meant to take, so no run could be
shorter. Each browser module is a group of its own, so that every worker may
run some, and a worker that does starts its own JupyterLab and Chromium, once,
for all the browser modules it is given.
"""

import signal

import pytest

from fluksio_nb.kernel import forget_accountant
from fluksio_nb.settings import ENV_VARS

# A shell starts a job in the background (`make test &`) with SIGINT ignored,
# and every Python started from it inherits that: the tests of the stop button
# would send their stops into nothing, and fail waiting. The suite takes
# SIGINT as a run in the foreground does, and so do the processes it starts.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: Directories whose session-wide fixtures are shared by a module's tests on
#: one worker, not by the whole directory's: see the module's docstring.
SHARED_BY_MODULE = frozenset({"tests/browser"})


def shared_with(item: pytest.Item) -> str | None:
    """The group of tests ``item`` shares a fixture of the suite's with; ``None`` if none.

    A session-wide fixture's tests are grouped by the directory whose
    conftest made it (by module in :data:`SHARED_BY_MODULE`), a module's by
    the module. pytest's own session-wide fixtures (``tmp_path_factory``,
    every ``tmp_path`` is made by it) are no reason: they are defined outside
    the suite, with no base id.
    """
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    scopes = {
        fixture.scope: fixture.baseid
        for fixtures in info.name2fixturedefs.values()
        for fixture in fixtures[-1:]
        if fixture.baseid
    }
    if "session" in scopes and scopes["session"] not in SHARED_BY_MODULE:
        return scopes["session"]
    if scopes.keys() & {"session", "package", "module", "class"}:
        return item.nodeid.split("::")[0]
    return None


# Before pytest-xdist's own hook, which reads the groups into each test's id.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = shared_with(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def isolated_settings(monkeypatch, tmp_path):
    for var in ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLUKSIO_CONFIG", str(tmp_path / "fluksio_nb.json"))
    # Tests never touch the user's real books; each gets a service of its own,
    # which ends soon after the test's kernels do.
    monkeypatch.setenv("FLUKSIO_LEDGER", str(tmp_path / "ledger"))
    monkeypatch.setenv("FLUKSIO_BOOKS_LINGER", "2")
    # Nor add usage records to the developer's own (`fluksio-nb usage`).
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter-data"))
    forget_accountant()
    yield tmp_path / "fluksio_nb.json"
    forget_accountant()
