"""Every test starts from a kernel that has read no settings.

The accountant is made once per process and reads ``FLUKSIO_*`` and the
user's config file when it is made, so a test that declared two GPUs would
otherwise leak them into the next, and a developer's own ``~/.jupyter`` would
change what the suite sees.
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
