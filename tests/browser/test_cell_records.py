"""What a claimed cell leaves behind, read in a real JupyterLab as a person reads it.

The checks themselves are in :mod:`tests.browser.cell_records`, shared with
Notebook 7's tests.
"""

from __future__ import annotations

import pytest

from tests.browser.cell_records import each_ending_said_once, records_survive_saving

pytestmark = pytest.mark.timeout(300)


def test_each_ending_is_said_once_with_none_of_fluksio_nbs_frames(notebook, page, server):
    """The record, then the why, once each; the user's traceback at the user's line."""
    each_ending_said_once(notebook, page.page, server)
    assert page.errors == [], page.errors


def test_a_saved_notebook_opened_again_without_its_kernel_shows_each_record(notebook, page, server):
    """No "model not found": the widget's display became the record, and that is what was saved."""
    records_survive_saving(notebook, server)
    assert page.errors == [], page.errors
