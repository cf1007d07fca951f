"""``fluksio-nb usage --json`` and ``--csv``: the shapes other programs read.

The failures guarded against: a JSON report that drifts from its
written-down schema, so a billing script breaks on the day a field moves;
a CSV whose figures disagree with the JSON's, or that a spreadsheet cannot
read because a note was printed into it; and a notebook name another user
chose that a spreadsheet runs as a formula.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from fluksio_nb.usage import UsageLog
from fluksio_nb.usage.export import report_schema
from tests.test_usage import HOUR, ME, record

SCHEMA = Path(__file__).parent.parent / "docs" / "usage-report.schema.json"


def usage(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluksio_nb", "usage", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def records(tmp_path) -> Path:
    """Two notebooks' claims of this user, one of them a halt, and a line that is no record."""
    directory = tmp_path / "usage"
    log = UsageLog(directory)
    log.write(record(cpus=2, gpus=(0,), notebook="a.ipynb", peak_rss_bytes=3 << 20))
    log.write(record(cpus=1, ran_s=HOUR / 2, waited_s=30, notebook="a.ipynb", ending="halted"))
    log.write(record(cpus=4, notebook="b.ipynb", peak_gpu_bytes=1 << 30))
    log.close()
    [written] = directory.iterdir()
    with written.open("a") as file:
        file.write("not a record\n")
    return directory


def test_the_written_down_schema_is_the_one_the_report_is_checked_against():
    """Guards against docs/usage-report.schema.json going stale when the report changes."""
    assert json.loads(SCHEMA.read_text()) == report_schema(), (
        "docs/usage-report.schema.json is out of date; write it again with "
        "fluksio_nb.usage.export.report_schema()"
    )


def test_a_real_json_report_validates_against_the_written_down_schema(records):
    """Guards against a report a script reads by the schema and finds otherwise."""
    done = usage("--dir", str(records), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    assert [(row["notebook"], row["claims"]) for row in report["rows"]] == [
        ("a.ipynb", 2),
        ("b.ipynb", 1),
    ]
    assert report["bad_lines"] == 1
    # And the schema says no to what the report never holds.
    broken = {**report, "rows": [{**report["rows"][0], "claims": -1}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(SCHEMA.read_text()))


def test_csv_has_the_json_rows_figures_unrounded_and_nothing_else(records):
    """Guards against a CSV that disagrees with the JSON, or with a note printed into it."""
    as_json = json.loads(usage("--dir", str(records), "--json").stdout)
    done = usage("--dir", str(records), "--csv")
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert len(rows) == len(as_json["rows"]) == 2
    for got, want in zip(rows, as_json["rows"], strict=True):
        assert (got["user"], got["notebook"]) == (ME, want["notebook"])
        assert int(got["claims"]) == want["claims"]
        for figure in ("core_hours", "card_hours", "waited_s", "ran_s"):
            assert float(got[figure]) == pytest.approx(want[figure], rel=1e-6)
        for peak in ("peak_rss_bytes", "peak_gpu_bytes"):
            assert got[peak] == ("" if want[peak] is None else str(want[peak]))
        assert dict(pair.split("=") for pair in got["endings"].split(";")) == {
            ending: str(count) for ending, count in want["endings"].items()
        }
    a = rows[0]
    assert float(a["core_hours"]) == pytest.approx(2.5) and a["endings"] == "halted=1;ok=1"
    # What was not read is said, beside the file rather than in it.
    assert "not a usage record" in done.stderr


def test_a_name_another_user_wrote_like_a_formula_is_never_a_formula_in_the_csv(tmp_path):
    """Guards against CSV injection: root opens a notebook called ``=HYPERLINK(...)``
    in a spreadsheet, which runs it."""
    directory = tmp_path / "usage"
    log = UsageLog(directory)
    for name in ('=HYPERLINK("http://example.invalid","x")', "+1", "-2+3", "@SUM(A1)", "ok.ipynb"):
        log.write(record(notebook=name))
    log.close()
    done = usage("--dir", str(directory), "--csv")
    assert done.returncode == 0, done.stderr
    cells = [row["notebook"] for row in csv.DictReader(io.StringIO(done.stdout))]
    assert sorted(cells) == sorted(
        ['\'=HYPERLINK("http://example.invalid","x")', "'+1", "'-2+3", "'@SUM(A1)", "ok.ipynb"]
    )


def test_json_and_csv_together_are_refused_in_one_line_that_says_so(tmp_path):
    """Guards against one of two asked-for shapes silently winning."""
    done = usage("--dir", str(tmp_path), "--json", "--csv")
    assert done.returncode == 2
    assert "--csv: not allowed with argument --json" in done.stderr
