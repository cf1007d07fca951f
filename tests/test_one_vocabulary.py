"""One finished claim, said the same way in every view: its times, its share, its ending.

A person who reads "ran 8.7 s" in the cell and "ran 9.2 s" in ``%claims``, or
"no share" here and "never started" there, reads two facts where there is
one. These tests end real claims in a real kernel and read every Python view
of them: the cell's record, ``%claims``, ``fluksio-nb`` in a terminal, and
the server's finished claims (which JupyterLab's panel and notices show).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fluksio_nb.records import UsageRecord
from fluksio_nb.vocabulary import ERROR_LINE_MOST, clock, error_line, seconds
from tests.kernels import started_kernel, until_it_exists

#: A machine without cards: no view may say anything of them.
INVENTORY = {
    "FLUKSIO_CPUS": "2",
    "FLUKSIO_GPUS": "0",
    "FLUKSIO_RAM": "4G",
    "FLUKSIO_RESERVE_CPUS": "0",
}

FAILING = (
    "%%claim cpus=1 ram=1G --label long-fail\n"
    "import time\n"
    "time.sleep(1.3)\n"
    "raise ValueError('the model diverged')\n"
)


def terminal(place: Path) -> str:
    """What ``fluksio-nb`` prints in a terminal, reading what the kernel at ``place`` read."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUKSIO_", "JUPYTER"))}
    env.update(
        INVENTORY,
        FLUKSIO_CONFIG=str(place / "fluksio_nb.json"),
        FLUKSIO_LEDGER=str(place / "ledger"),
        JUPYTER_DATA_DIR=str(place / "jupyter-data"),
    )
    return subprocess.run(
        [sys.executable, "-m", "fluksio_nb"], env=env, capture_output=True, text=True, check=True
    ).stdout


def the_line(text: str, label: str) -> str:
    (line,) = [line for line in text.splitlines() if f" {label} (" in line]
    return line.strip()


def test_every_view_of_one_finished_claim_says_the_same_times_share_and_ending(tmp_path):
    """Guards against the record saying "waited 0.1 s … ran 1.3 s" where ``%claims`` and
    the panel say "waited 0.0 s · ran 1.9 s" (each subtracting its own timestamps), a
    share spelled differently in each, a card row on a machine without cards, and the
    failed claim's error line missing from every view but the cell."""
    with started_kernel(tmp_path, **INVENTORY) as kernel:
        ran = kernel.run(FAILING)
        assert ran.error is not None and ran.error["ename"] == "ValueError", ran.error
        (record,) = [text for text in ran.texts if text.startswith("long-fail: error · ")]
        claims = kernel.run("%claims", check=True)
        monitor = "\n".join([*claims.texts, claims.stdout])
        finished = json.loads(
            kernel.run(
                "import json\n"
                "from fluksio_nb.usage.recent import process_recent_usage\n"
                "print(json.dumps(process_recent_usage().finished()['claims']))",
                check=True,
            ).stdout
        )

    # The cell's record: how it ended, then its times, then its share.
    said = re.match(
        r"long-fail: error · (waited [^,]+), (?:.*, )?(ran [^·]+?) · (cpus=.*?) · ", record
    )
    assert said, record
    waited, ran_for, held = said.groups()
    # What held it to its share while it ran ("(cores 0)", "(capped, cgroup v2)") is the
    # live view's and the record's: once it has ended, every view says what it held.
    share = re.sub(r" \([^)]*\)", "", held)
    assert share == "cpus=1 ram=1.0GB", record

    # The server's finished claims carry the same figures, the share and the error line;
    # JupyterLab's panel and notices say them with format.ts's words (tests/browser).
    (entry,) = [claim for claim in finished if claim["label"] == "long-fail"]
    assert f"waited {seconds(entry['waited_s'])}" == waited, (entry, record)
    assert f"ran {seconds(entry['ran_s'])}" == ran_for, (entry, record)
    assert (entry["ending"], entry["mark"], entry["cpus"], entry["gpus"]) == ("error", "bad", 1, [])
    assert entry["error"] == "ValueError: the model diverged", entry

    for view in (monitor, terminal(tmp_path)):
        line = the_line(view, "long-fail")
        # 24-hour clock, the ending's word, then the same figures and share as the record.
        assert line.startswith(f"{clock(entry['ended_at'])} error: long-fail ("), line
        assert f", {waited}, {ran_for}, {share}" in line, (line, record)
        assert line.endswith(": ValueError: the model diverged"), line
        # No cards here: nothing said of them, not "gpus 0/0" nor "GPUs none".
        assert not [row for row in view.splitlines() if row.startswith("gpus")], view


def test_a_claim_that_never_got_its_share_is_said_so_in_the_same_words_everywhere(tmp_path):
    """Guards against "ran 0.0 s · no share" in the cell, "never started" in the panel and
    "never got its share" in ``%claims``: one claim cancelled in the queue, one phrase."""
    with started_kernel(tmp_path, **INVENTORY) as kernel:
        # Stuck behind a claim that holds the whole machine: it times out in the queue.
        go = tmp_path / "go"
        kernel.start_job(
            f"%%claim cpus=2 --background --label holder\n{until_it_exists(go)}", "holder"
        )
        try:
            ran = kernel.run("%%claim cpus=1 --timeout 1 --label late\n1", timeout=60)
        finally:
            go.touch()
        assert kernel.facts("holder.result(30) is not None")
        record = [text for text in ran.texts if text.startswith("late: ")][-1]
        finished = kernel.run("%claims", check=True)
        monitor = "\n".join([*finished.texts, finished.stdout])

    assert re.fullmatch(r"late: timed out · waited [\d.]+ s · never got its share", record), record
    for view in (monitor, terminal(tmp_path)):
        line = the_line(view, "late")
        assert "never got its share" in line and "ran" not in line.split("late (")[1], line


def test_an_error_line_is_one_line_and_cut_to_length_where_it_is_kept():
    """Guards against a cell's error of pages (or a forged record's) filling a panel or a
    notice: the record keeps one line, cut, and refuses a longer one."""
    assert error_line("\n  ValueError: the model diverged\nmore\n") == (
        "ValueError: the model diverged"
    )
    long = error_line("MemoryError: " + "x" * 5000)
    assert long is not None and len(long) == ERROR_LINE_MOST and long.endswith("…")
    assert error_line("") is None and error_line("\n \n") is None
    with pytest.raises(ValueError, match="error"):
        UsageRecord(label="x", asked_at=1, ended_at=2, ending="error", error="x" * 5000)


@pytest.mark.parametrize(
    ("span", "said"),
    [(0.04, "0.0 s"), (0.05, "0.1 s"), (8.75, "8.8 s"), (9.96, "10 s"), (12.4, "12 s"),
     (125, "2 min 5 s"), (120, "2 min"), (3780, "1 h 3 min"), (-1, "0.0 s")],
)  # fmt: skip
def test_a_span_reads_as_format_ts_says_it(span, said):
    """Guards against the cell saying "125.3 s" where the panel says "2 min 5 s"."""
    assert seconds(span) == said
