"""nbval compares a notebook's claimed cells by what a person sees when they are done.

A claimed cell that runs past its live view's half second sends the live view
first, then its record as an update of the same display; a saved notebook
holds the record. nbval 0.11 compares first displays and drops updates, so
whether ``notebooks/`` passed depended on how loaded the machine was. The
notebooks' ``conftest.py`` applies the updates before nbval compares: this
runs nbval, as ``make test`` does, on a notebook with a cell that always draws
its live view first.

A claimed cell's status holds its place, blank, from the claim's start; the
live view and then the record take it, above everything the cell printed.
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
    # The cell first held its status's place, blank: nbval alone compares that, and fails.
    compared_as_first_drawn = nbval(notebook)
    assert compared_as_first_drawn.returncode == 1, compared_as_first_drawn.stdout


def test_a_claimed_cell_that_printed_compares_with_its_record_above_its_output(tmp_path):
    notebook = tmp_path / "printing.ipynb"
    printing = "%%claim --label printing\nimport time\ntime.sleep(2)\nprint('done')"
    cells = ["%load_ext fluksio_nb", printing]
    stored = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(stored, timeout=120, resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = stored.cells[1].outputs
    shown = [o.data["text/plain"][:14] for o in outputs if o.output_type == "display_data"]
    # The record in the place its status held from the start, above the output.
    assert shown == ["printing: ok ·"], outputs
    assert outputs[1].text == "done\n", outputs
    nbformat.write(stored, notebook)

    compared_as_shown = nbval(notebook, "notebooks.conftest")
    assert compared_as_shown.returncode == 0, compared_as_shown.stdout
    # nbval alone compares the place as first held, blank: it fails.
    compared_as_sent = nbval(notebook)
    assert compared_as_sent.returncode == 1, compared_as_sent.stdout
