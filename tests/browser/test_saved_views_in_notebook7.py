"""A saved ``%claims`` and a saved running background claim, opened again in a real Notebook 7.

Notebook 7 has its own build of the widget manager and its own page; the
checks are those of JupyterLab's (:mod:`tests.browser.saved_views`).
"""

from __future__ import annotations

import pytest

from tests.browser.lab import JupyterLab, not_notebook7s_own
from tests.browser.saved_views import live_views_read_as_saved

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def server(notebook7: JupyterLab) -> JupyterLab:
    """``page`` and ``notebook`` drive Notebook 7 in this module."""
    return notebook7


def test_a_saved_monitor_and_running_claim_read_as_saved_in_notebook_7(notebook, page, server):
    """Guards against "Error displaying widget: model not found" (new kernel) and
    "Loading widget..." for good (no kernel) where a saved live widget was, in Notebook 7."""
    live_views_read_as_saved(notebook, server)
    assert not_notebook7s_own(page.errors) == [], page.errors
