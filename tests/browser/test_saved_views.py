"""A saved ``%claims`` and a saved running background claim, opened again in a real JupyterLab.

The checks are in :mod:`tests.browser.saved_views`, shared with Notebook 7's tests.
"""

from __future__ import annotations

import pytest

from tests.browser.saved_views import live_views_read_as_saved

pytestmark = pytest.mark.timeout(300)


def test_a_saved_monitor_and_running_claim_read_as_saved_with_a_new_kernel_or_none(
    notebook, page, server
):
    """Guards against "Error displaying widget: model not found" (new kernel) and
    "Loading widget..." for good (no kernel) where a saved live widget was."""
    live_views_read_as_saved(notebook, server)
    assert page.errors == [], page.errors
