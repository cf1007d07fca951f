"""nbval compares a notebook's claimed cells by what a person sees when they are done.

A claimed cell that runs past its live view's half second sends the live view
first, then its record as an update of the same display; a saved notebook
holds the record. nbval 0.11 compares first displays and drops updates, so
whether ``notebooks/`` passed depended on how loaded the machine was. The
notebooks' ``conftest.py`` applies the updates before nbval compares: this
runs nbval, as ``make test`` does, on a notebook with a cell that always draws
its live view first.

A cell that prints after its live view was drawn ends with the view emptied
and the record below the output; one that ended before its view was due has
the record alone. Both look the same to a person, and compare the same.
"""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
from nbclient import NotebookClient

from tests.local_ray import REPO

SLOW_CLAIM = "%%claim --label slow\nimport time\ntime.sleep(2)\nanswer = 42"


def nbval(notebook, *plugins: str) -> subprocess.CompletedProcess[str]:
    """nbval on ``notebook``, with ``plugins`` loaded as the notebooks' conftest is."""
    loaded = [arg for plugin in plugins for arg in ("-p", plugin)]
    sanitized = ["--nbval-sanitize-with", str(REPO / "notebooks" / "sanitize.cfg")]
    alone = ["--rootdir", str(notebook.parent), "-c", os.devnull, "-p", "no:cacheprovider"]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            *alone,
            *loaded,
            "--nbval",
            *sanitized,
            str(notebook),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_claimed_cell_that_drew_its_live_view_is_compared_by_the_record_that_replaced_it(
    tmp_path,
):
    notebook = tmp_path / "slow.ipynb"
    cells = ["%load_ext fluksio_nb", SLOW_CLAIM, "answer"]
    stored = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(stored, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    (record,) = stored.cells[1].outputs
    assert record.data["text/plain"].startswith("slow: ok · waited"), record
    nbformat.write(stored, notebook)

    compared_as_shown = nbval(notebook, "notebooks.conftest")
    assert compared_as_shown.returncode == 0, compared_as_shown.stdout
    # The cell did draw its live view first: nbval alone compares that, and fails.
    compared_as_first_drawn = nbval(notebook)
    assert compared_as_first_drawn.returncode == 1, compared_as_first_drawn.stdout
    assert "live status (its record replaces it when the claim ends)" in (
        compared_as_first_drawn.stdout
    )


def test_a_claimed_cell_whose_record_moved_below_its_output_compares_with_one_that_ended_first(
    tmp_path,
):
    notebook = tmp_path / "printing.ipynb"
    printing = "%%claim --label printing\nimport time\ntime.sleep(2)\nprint('done')"
    cells = ["%load_ext fluksio_nb", printing]
    stored = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(stored, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = stored.cells[1].outputs
    shown = [o.data["text/plain"][:14] for o in outputs if o.output_type == "display_data"]
    assert shown == ["", "printing: ok ·"], outputs
    # Stored as a cell that ended before its view was due is: the record alone.
    outputs[:] = [o for o in outputs if o.get("data") != {"text/plain": ""}]
    nbformat.write(stored, notebook)

    compared_as_shown = nbval(notebook, "notebooks.conftest")
    assert compared_as_shown.returncode == 0, compared_as_shown.stdout
    # The view was drawn, and emptied when the output came: nbval alone counts it.
    compared_as_sent = nbval(notebook)
    assert compared_as_sent.returncode == 1, compared_as_sent.stdout
    assert "dissimilar number of outputs" in compared_as_sent.stdout, compared_as_sent.stdout
