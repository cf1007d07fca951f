"""The claims that ended lately and each label's past runs, from real records files.

Besides what is shown, the failures guarded against are those of a reader
that runs unasked, in every kernel and server: reading a file another user
planted in the shared directory, and keeping or reading without bound
whatever the directory holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from fluksio_nb.usage import UsageLog, UsageRecord, recent
from fluksio_nb.usage.read import read_usage
from fluksio_nb.usage.recent import RecentUsage
from tests.unix_users import REPO_ROOT, USER_A, USER_B, ready_user, run_as, shared_tmp_dir


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


def test_the_runs_of_each_shape_are_kept_for_labels_never_run_before(tmp_path):
    """Guards against a new label's expected wait having nothing to go by when claims of
    its shape (as many cpus and cards) have finished."""
    directory = tmp_path / "usage"
    write(
        directory,
        record("a", 100.0, ran_s=50.0, cpus=1),
        record("b", 300.0, ran_s=70.0, cpus=1),
        record("c", 400.0, ran_s=None, cpus=1),
        record("d", 200.0, ran_s=5.0, cpus=2, gpus=[0]),
    )
    assert RecentUsage(lambda: [directory]).shapes() == {(1, 0): [70.0, 50.0], (2, 1): [5.0]}


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
    # No cards on this machine: nothing said of them, as in every view.
    assert lines[0] == "cpus  0/4 used" and lines[1] == "ram   0B/8.0GB used"
    assert "finished (last 1, newest first)" in lines
    (said,) = [line for line in lines if "last-night" in line]
    assert " ok: last-night (" in said and "waited 2.0 s, ran 10 s, peak RSS 5.0KB" in said


# -----------------------------------------------------------------------------
# What is read and kept, whatever is in the directory
# -----------------------------------------------------------------------------


def plant(directory: Path) -> str:
    """An attacker's code: a thousand records in a file every user may read, as audited."""
    return textwrap.dedent(
        f"""
        import json, os
        fake = {{"label": "planted", "asked_at": 0, "granted_at": 0, "ended_at": 9e9,
                 "ending": "ok"}}
        path = os.path.join({str(directory)!r}, "planted.jsonl")
        with open(path, "w") as planted:
            planted.write((json.dumps(fake) + "\\n") * 1000)
        os.chmod(path, 0o644)
        """
    )


def look(directory: Path) -> str:
    """A user's kernel: records one claim of its own, then reads what the panel shows."""
    return textwrap.dedent(
        f"""
        import json
        from pathlib import Path
        from fluksio_nb.usage import UsageLog, UsageRecord
        from fluksio_nb.usage.recent import RecentUsage
        directory = Path({str(directory)!r})
        log = UsageLog(directory, create=False)
        log.write(UsageRecord(label="fit", asked_at=1.0, granted_at=2.0, ended_at=12.0,
                              ending="ok"))
        log.close()
        recent = RecentUsage(lambda: [directory])
        finished = recent.finished()
        print(json.dumps({{
            "finished": [claim["label"] for claim in finished["claims"]],
            "unreadable": finished["unreadable_files"],
            "durations": recent.durations(),
            "kept": len(recent._read[directory][1]),
        }}))
        """
    )


def test_a_records_file_another_user_made_readable_is_never_read():
    """Guards against one user's planted file costing every other user's kernel,
    and root's server, its memory and CPU while their claims wait (as audited:
    gigabytes and a minute for three files)."""
    attacker, victim = ready_user(USER_A), ready_user(USER_B)
    with shared_tmp_dir() as shared:
        shared.chmod(0o1777)  # root's and sticky, as `fluksio-nb machine init` makes it
        planted = run_as(attacker, plant(shared))
        assert planted.returncode == 0, planted.stderr
        assert os.stat(shared / "planted.jsonl").st_mode & 0o777 == 0o644

        # This checkout's fluksio_nb, whichever the venv would import.
        seen = run_as(victim, look(shared), env={"PYTHONPATH": str(REPO_ROOT)})
        assert seen.returncode == 0, seen.stderr
        assert json.loads(seen.stdout) == {
            "finished": ["fit"],
            "unreadable": 1,  # the planted file, said, not read
            "durations": {"fit": [10.0]},
            "kept": 2,  # the one record, once as finished and once as a run of "fit"
        }

        # Root's server: root reads everyone's files, but here only its own.
        by_root = RecentUsage(lambda: [shared])
        assert by_root.finished() == {"claims": [], "unreadable_files": 2}
        assert by_root.durations() == {}


def test_only_the_finished_shown_and_each_labels_latest_runs_are_kept(tmp_path, monkeypatch):
    """Guards against a reader whose memory grows with every record ever written."""
    monkeypatch.setattr(recent, "LABELS", 10, raising=False)
    directory = tmp_path / "usage"
    write(
        directory,
        *[record(f"once-{n}", 1000.0 + n) for n in range(100)],
        *[record("fit", 2000.0 + n, ran_s=float(n)) for n in range(100)],
        *[record("gave-up", 3000.0 + n, ran_s=None) for n in range(100)],
    )
    reader = RecentUsage(lambda: [directory])
    finished = reader.finished()["claims"]
    assert [c["label"] for c in finished] == ["gave-up"] * 20
    assert [c["ended_at"] for c in finished] == [3000.0 + n for n in range(99, 79, -1)]
    durations = reader.durations()
    # The 10 labels run last: "fit", and the last 9 run once.
    assert sorted(durations) == sorted(["fit", *(f"once-{n}" for n in range(91, 100))])
    assert durations["fit"] == [float(n) for n in range(99, 79, -1)]
    # 20 finished, 20 runs of "fit" and one of each other label: of 300 records.
    assert len(reader._read[directory][1]) == 20 + 20 + 9


def test_a_directory_past_the_byte_budget_is_read_newest_first_and_warns_once(
    tmp_path, monkeypatch
):
    """Guards against a reader whose time grows with the records ever written, and
    against records left out without a word."""
    monkeypatch.setattr(recent, "READ_AT_MOST", 3000, raising=False)
    directory = tmp_path / "usage"
    directory.mkdir(mode=0o700)
    now = time.time()
    files = {
        "old": ([record("old", 100.0 + n) for n in range(5)], now - 200),
        "mid": ([record("mid", 200.0 + n) for n in range(5)], now - 100),
        "new": ([record(f"new-{n}", 300.0 + n) for n in range(20)], now),
    }
    for name, (records, mtime) in files.items():
        path = directory / f"{name}.jsonl"
        path.write_text("".join(one.model_dump_json() + "\n" for one in records))
        os.utime(path, (mtime, mtime))
    assert (directory / "new.jsonl").stat().st_size > 3000, "the newest file fits the budget"

    reader = RecentUsage(lambda: [directory])
    with pytest.warns(UserWarning, match=f"only the newest .* in {directory}") as said:
        labels = [c["label"] for c in reader.finished()["claims"]]
    assert [w.category.__name__ for w in said] == ["RecentUsageCut"]
    # Only the end of the newest file: its last records, whole, and nothing older.
    assert 5 <= len(labels) < 20
    assert labels == [f"new-{n}" for n in range(19, 19 - len(labels), -1)]
    kept = reader._read[directory][1]
    assert (kept.counts.files_cut, kept.counts.bad_lines) == (3, 0)
    assert set(reader.durations()) == set(labels)

    # Read again when a file changed, and cut again, but said once.
    os.utime(directory / "old.jsonl", (now - 300, now - 300))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [c["label"] for c in reader.finished()["claims"]] == labels
    assert reader._read[directory][1] is not kept
