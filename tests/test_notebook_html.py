"""A notebook run by nbconvert and turned into a web page reads as the person saw it.

nbconvert's HTML is what nbviewer serves and what a notebook mailed around as
a web page shows; it has no kernel and no widget manager to ask. Each claimed
cell must be there as its record, the line that says how it went, and none as
a live widget with nothing behind it: a background cell's too, in its own
place, though it ended while a later cell ran.
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
from pathlib import Path

JUPYTER = [sys.executable, "-m", "jupyter"]

CELLS = [
    ("%load_ext fluksio_nb", []),
    ("%%claim cpus=1 --label long\nimport time\ntime.sleep(2)\nlong_done = True", []),
    ("%%claim cpus=1 --label quick\nx = 1", []),
    ("%%claim cpus=1 --label boom\n1/0", ["raises-exception"]),
    # Prints and ends while the next cell runs, whose messages are all nbclient reads.
    ("%%claim cpus=1 --background --label later\nimport time\ntime.sleep(1)\nprint(1)", []),
    ("later = _\nlater.result(60)\nprint('the job is over')", []),
]


def written(path: Path, cells: list[tuple[str, list[str]]]) -> Path:
    """A notebook at ``path`` of code cells, each its source and its tags, never run."""
    path.write_text(
        json.dumps(
            {
                "cells": [
                    {
                        "cell_type": "code",
                        "execution_count": None,
                        "id": f"cell-{n}",
                        "metadata": {"tags": tags},
                        "outputs": [],
                        "source": source,
                    }
                    for n, (source, tags) in enumerate(cells)
                ],
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
                "nbformat": 4,
                "nbformat_minor": 5,
            }
        )
    )
    return path


def test_nbconvert_html_of_an_executed_notebook_shows_each_claims_record(tmp_path: Path):
    notebook = written(tmp_path / "claims.ipynb", CELLS)
    subprocess.run(
        [*JUPYTER, "nbconvert", "--to", "html", "--execute", str(notebook)],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    page = html.unescape((tmp_path / "claims.html").read_text())
    for said in (
        "long: ok · waited ",
        "quick: ok · waited ",
        "boom: error · waited ",
        "later: ok · waited ",
    ):
        assert page.count(said) == 1, f"{said!r} is on the page {page.count(said)} times"
    assert "running when this was saved" not in page, (
        "a live widget's fallback was kept in place of its record"
    )
    assert page.index("later: ok · waited ") < page.index("the job is over"), "not in its cell"
    # How nbconvert places a widget view, for a widget manager that is not there.
    assert '<script type="application/vnd.jupyter.widget-view+json">' not in page
    assert page.count("division by zero") == 1


def test_an_executed_notebook_keeps_no_ended_claims_widget_code(tmp_path: Path):
    """Guards against nbconvert, papermill and nbval (nbclient, which keeps the last
    state of every widget a notebook made, closed ones too) saving each ended claim's
    ES module and stylesheet in the notebook: 45 KB for every claimed cell that ran
    long enough to show its live view."""
    cells = [
        ("%load_ext fluksio_nb", []),
        *((f"%%claim cpus=1 --label long{n}\nimport time\ntime.sleep(1)", []) for n in range(3)),
    ]
    notebook = written(tmp_path / "claims.ipynb", cells)
    subprocess.run(
        [
            *JUPYTER,
            "nbconvert",
            "--to",
            "notebook",
            "--execute",
            "--output",
            "executed.ipynb",
            notebook,
        ],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
    )
    executed = json.loads((tmp_path / "executed.ipynb").read_text())
    states = executed["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    claims = [m["state"] for m in states.values() if m["state"].get("kind") == "claim"]
    assert sorted(state["label"] for state in claims) == ["long0", "long1", "long2"]
    for state in claims:
        assert len(state["_esm"]) < 100 and state["_css"] == "", "a live view's code was kept"
    records = [
        "".join(output["data"]["text/plain"])
        for cell in executed["cells"]
        for output in cell["outputs"]
        if "text/plain" in output.get("data", {})
    ]
    assert sum("· waited " in record for record in records) == 3, records
