"""The claims that ended lately and each label's past runs, from real records files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fluksio_nb.usage import UsageLog, UsageRecord
from fluksio_nb.usage.read import read_usage
from fluksio_nb.usage.recent import RecentUsage


def record(label: str, ended_at: float, ran_s: float | None = 10.0, **fields) -> UsageRecord:
    granted = None if ran_s is None else ended_at - ran_s
    return UsageRecord(
        label=label,
        asked_at=(granted or ended_at) - 2,
        granted_at=granted,
        ended_at=ended_at,
        ending="ok" if ran_s is not None else "cancelled",
        peak_rss_bytes=5000 if ran_s is not None else 0,
        **fields,
    )


def write(directory: Path, *records: UsageRecord) -> None:
    log = UsageLog(directory)
    for one in records:
        log.write(one)
    log.close()


def test_a_record_written_before_tickets_were_kept_still_reads(tmp_path):
    """Guards against older records files dropping out of the report and the panel."""
    tmp_path.chmod(0o700)
    old = {"label": "old", "asked_at": 1.0, "granted_at": 2.0, "ended_at": 3.0, "ending": "ok"}
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
    ((_, found),) = read_usage(tmp_path)
    assert found.ticket is None and found.label == "old"


def test_the_finished_are_newest_first_and_a_claim_that_never_ran_has_no_peak(tmp_path):
    """Guards against a never-granted claim shown as having run for 0 s with a 0 B peak."""
    directory = tmp_path / "usage"
    now = time.time()
    write(
        directory,
        record("first", now - 30, ticket=1, notebook="a.ipynb"),
        record("gave-up", now - 10, ran_s=None, ticket=2),
        record("second", now - 20, ticket=3, peak_gpu_bytes=7000),
    )
    finished = RecentUsage(lambda: [directory]).finished()["claims"]
    assert [c["label"] for c in finished] == ["gave-up", "second", "first"]
    gave_up, second, first = finished
    assert gave_up["ran_s"] is None and gave_up["peak_rss_bytes"] is None
    assert gave_up["started_at"] is None and gave_up["ending"] == "cancelled"
    assert second["ran_s"] == 10.0 and second["peak_gpu_bytes"] == 7000
    assert first["notebook"] == "a.ipynb" and first["ticket"] == 1
    assert first["user"] == gave_up["user"] != ""


def test_only_the_last_20_are_kept(tmp_path):
    directory = tmp_path / "usage"
    write(directory, *[record(f"run-{n}", 1000.0 + n) for n in range(30)])
    finished = RecentUsage(lambda: [directory]).finished()["claims"]
    assert [c["label"] for c in finished] == [f"run-{n}" for n in range(29, 9, -1)]


def test_records_are_read_again_when_a_file_changes_and_not_before(tmp_path):
    """Guards against a panel that never sees a claim end, or rereads every file every second."""
    directory = tmp_path / "usage"
    write(directory, record("before", 100.0))
    recent = RecentUsage(lambda: [directory])
    assert [c["label"] for c in recent.finished()["claims"]] == ["before"]
    first_read = recent._read[directory][1]
    recent.finished()
    assert recent._read[directory][1] is first_read, "nothing changed, and it was read again"

    # Another process of the user's: a file of its own, as a second kernel writes.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\nfrom fluksio_nb.usage import UsageLog, UsageRecord\n"
            "log = UsageLog(sys.argv[1])\n"
            "log.write(UsageRecord(label='after', asked_at=1.0, granted_at=2.0, ended_at=200.0,"
            " ending='error'))\nlog.close()",
            str(directory),
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert [c["label"] for c in recent.finished()["claims"]] == ["after", "before"]


def test_a_labels_past_runs_are_its_latest_granted_ones(tmp_path):
    directory = tmp_path / "usage"
    write(
        directory,
        record("fit", 100.0, ran_s=50.0),
        record("fit", 300.0, ran_s=70.0),
        record("fit", 400.0, ran_s=None),
        record("prep", 200.0, ran_s=5.0),
    )
    assert RecentUsage(lambda: [directory]).durations() == {"fit": [70.0, 50.0], "prep": [5.0]}


def test_the_terminal_shows_the_machine_used_over_total_and_what_finished(tmp_path):
    """Guards against `fluksio-nb` saying free where the bar says used, or forgetting the ended."""
    data = tmp_path / "data"
    write(data / "fluksio" / "usage", record("last-night", time.time() - 60, ticket=9))
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("FLUKSIO_", "JUPYTER"))
    }
    env.update(
        JUPYTER_DATA_DIR=str(data),
        FLUKSIO_LEDGER=str(tmp_path / "ledger"),
        FLUKSIO_CONFIG=str(tmp_path / "none.json"),
        FLUKSIO_CPUS="4",
        FLUKSIO_GPUS="0",
        FLUKSIO_RAM="8G",
        FLUKSIO_RESERVE_CPUS="0",
    )
    shown = subprocess.run(
        [sys.executable, "-m", "fluksio_nb"], env=env, capture_output=True, text=True, check=True
    ).stdout
    lines = shown.splitlines()
    assert lines[0] == "cpus  0/4 used" and lines[2] == "ram   0B/8.0GB used"
    assert "finished (last 1, newest first)" in lines
    (said,) = [line for line in lines if "last-night" in line]
    assert " ok: last-night (" in said and "waited 2.0 s, ran 10.0 s, peak RSS 5.0KB" in said
