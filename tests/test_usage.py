"""Accounting: every claim's record, and ``fluksio-nb usage`` adding them up.

The failures guarded against: a claim that ends some way (an error, a
timeout while still waiting) and is never counted; hours or waits that do
not add up to what happened; records counted against someone other than
the owner of their file; a reader that follows links, hangs on a pipe or
dies on a bad line; a record file in a directory where another user could
remove or replace it; and a cell that fails because its record could not
be written.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from fluksio_nb import claim
from fluksio_nb.local_claim import Claim
from fluksio_nb.resources import ask
from fluksio_nb.usage import (
    UsageDirRefused,
    UsageLog,
    UsageNotRecorded,
    UsageRecord,
    default_usage_dir,
    describe_usage,
    parse_since,
    read_usage,
    summarise,
    usage_main,
    user_totals,
)
from fluksio_nb.usage import report as usage_report
from fluksio_nb.usage.read import UsageRows, each_usage, kernel_deaths
from tests.kernels import Kernel, until_it_exists
from tests.stops import said_by
from tests.unix_users import USER_A, ready_user, run_as, shared_tmp_dir
from tests.waiting import gone, wait_until

pytestmark = pytest.mark.timeout(120)

ME = pwd.getpwuid(os.geteuid()).pw_name
HOUR = 3600.0


def record(
    cpus: int = 1,
    gpus: tuple[int, ...] = (),
    ran_s: float = HOUR,
    waited_s: float = 0.0,
    ended_at: float | None = None,
    notebook: str | None = None,
    ending: str = "ok",
    peak_rss_bytes: int = 0,
    peak_gpu_bytes: int | None = None,
) -> UsageRecord:
    ended_at = time.time() if ended_at is None else ended_at
    granted_at = ended_at - ran_s
    return UsageRecord(
        label="claim",
        notebook=notebook,
        cpus=cpus,
        gpus=list(gpus),
        asked_at=granted_at - waited_s,
        granted_at=granted_at,
        ended_at=ended_at,
        ending=ending,
        peak_rss_bytes=peak_rss_bytes,
        peak_gpu_bytes=peak_gpu_bytes,
    )


def nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as a second user")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this machine has no user 'nobody'")


def in_child_as(user: pwd.struct_passwd, work) -> object:
    """``work()``'s JSON-able result, run in a forked child that became ``user``."""
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(readable)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            answer = json.dumps({"result": work()})
            code = 0
        except BaseException as error:
            answer = json.dumps({"error": repr(error)})
        finally:
            try:
                os.write(writable, answer.encode())
            finally:
                os._exit(code)
    os.close(writable)
    with os.fdopen(readable, "rb") as pipe:
        said = json.loads(pipe.read() or b'{"error": "the child said nothing"}')
    os.waitpid(pid, 0)
    assert "error" not in said, said["error"]
    return said["result"]


@pytest.fixture
def shared_dir():
    """A machine's shared records directory: root's, mode 1777, reachable by everyone."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to make a root-owned shared directory")
    # Not under tmp_path: pytest's own directories are closed to other users.
    directory = Path(tempfile.mkdtemp(prefix="fluksio-usage-", dir="/tmp"))
    os.chmod(directory, 0o1777)
    yield directory
    shutil.rmtree(directory)


# -----------------------------------------------------------------------------
# Records, and whose they are
# -----------------------------------------------------------------------------


def test_records_are_counted_against_the_owner_of_their_file(shared_dir):
    """Guards against a claim charged to the wrong person, and against a forked
    child appending to its parent's file, where its claims would be the parent's."""
    user = nobody()
    log = UsageLog(shared_dir, create=False)
    log.write(record(cpus=2, gpus=(0,), ran_s=HOUR, notebook="a.ipynb", peak_rss_bytes=3 * 10**9))

    def as_nobody():
        # The same log, inherited through fork, as a kernel's worker would inherit it.
        log.write(record(cpus=4, ran_s=HOUR / 2, notebook="b.ipynb", waited_s=60))
        seen = read_usage(shared_dir)
        return {
            "rows": [[name, r.cpus] for name, r in seen],
            "unreadable": seen.unreadable_files,
            "path": str(log.path),
        }

    child = in_child_as(user, as_nobody)
    assert child["rows"] == [[user.pw_name, 4]]
    assert child["unreadable"] == 1, "root's records were readable by another user"
    assert child["path"] != str(log.path)
    assert os.stat(child["path"]).st_uid == user.pw_uid

    rows = read_usage(shared_dir)
    assert sorted((name, r.cpus) for name, r in rows) == [(user.pw_name, 4), ("root", 2)]
    totals = {t["user"]: t for t in user_totals(summarise(rows))}
    assert totals["root"]["core_hours"] == pytest.approx(2.0)
    assert totals["root"]["card_hours"] == pytest.approx(1.0)
    assert totals["root"]["peak_rss_bytes"] == 3 * 10**9
    assert totals[user.pw_name]["core_hours"] == pytest.approx(2.0)
    assert totals[user.pw_name]["card_hours"] == 0
    assert totals[user.pw_name]["waited_s"] == pytest.approx(60)


def test_a_user_of_their_own_directory_gets_it_made_private_and_one_file_per_process(tmp_path):
    """Guards against records made readable to others, and a file opened per record."""
    directory = tmp_path / "data" / "fluksio" / "usage"
    log = UsageLog(directory)
    for _ in range(3):
        log.write(record())
    assert os.stat(directory).st_mode & 0o777 == 0o700
    [path] = directory.iterdir()
    assert path == log.path
    assert path.name.startswith(f"{os.geteuid()}-{os.getpid()}-")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(path.read_text().splitlines()) == 3


def test_a_records_file_removed_under_a_running_kernel_is_started_again(tmp_path):
    """Guards against records appended, from then on, to a file nobody can read."""
    log = UsageLog(tmp_path / "usage")
    log.write(record())
    first = log.path
    assert first is not None
    first.unlink()
    log.write(record())
    assert log.path != first
    assert len(read_usage(tmp_path / "usage")) == 1


def test_a_claim_that_never_queued_leaves_no_record_and_one_that_did_leaves_one(monkeypatch):
    """Guards against counting claims that never asked, or missing ones that did."""
    monkeypatch.setenv("FLUKSIO_CPUS", "2")
    monkeypatch.setenv("FLUKSIO_RESERVE_CPUS", "0")
    monkeypatch.setenv("FLUKSIO_LEDGER", "kernel")
    Claim(ask(cpus=1)).release()
    assert list(read_usage(default_usage_dir())) == []
    with claim(cpus=1, label="counted") as held:
        held.run(pow, 2, 3)
    [(user, counted)] = read_usage(default_usage_dir())
    assert (user, counted.label, counted.cpus, counted.ending) == (ME, "counted", 1, "ok")
    assert counted.peak_rss_bytes > 0, "the worker's peak memory was not recorded"


# -----------------------------------------------------------------------------
# Directories that are refused
# -----------------------------------------------------------------------------


def test_a_directory_others_may_write_to_is_refused(tmp_path):
    """Guards against records kept where another user could remove or replace them."""
    directory = tmp_path / "usage"
    directory.mkdir()
    os.chmod(directory, 0o775)
    with pytest.raises(UsageDirRefused, match="writable by its group or others") as refused:
        UsageLog(directory).open()
    assert str(directory) in str(refused.value) and "chmod go-w" in str(refused.value)
    assert list(directory.iterdir()) == []


def test_a_refused_directory_warns_once_and_never_fails_the_claim(tmp_path, monkeypatch):
    """Guards against a cell failing, or warning on every run, because of its accounting."""
    monkeypatch.setenv("FLUKSIO_CPUS", "2")
    monkeypatch.setenv("FLUKSIO_RESERVE_CPUS", "0")
    monkeypatch.setenv("FLUKSIO_LEDGER", "kernel")
    default_usage_dir().mkdir(parents=True)
    os.chmod(default_usage_dir(), 0o777)
    with pytest.warns(UsageNotRecorded, match=str(default_usage_dir())), claim(cpus=1) as held:
        assert held.run(pow, 2, 3) == 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with claim(cpus=1):
            pass
    assert [w for w in caught if issubclass(w.category, UsageNotRecorded)] == []


def test_a_directory_of_another_user_is_refused_unless_roots_and_sticky(tmp_path):
    """Guards against writing into a directory whose owner could tamper with the records."""
    user = nobody()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, user.pw_uid, user.pw_gid)
    for mode in (0o755, 0o1777):
        os.chmod(theirs, mode)
        with pytest.raises(UsageDirRefused, match="belongs to 'nobody'") as refused:
            UsageLog(theirs).open()
        assert str(theirs) in str(refused.value)
    roots = tmp_path / "roots"
    roots.mkdir()
    os.chmod(roots, 0o1777)
    assert UsageLog(roots).open().parent == roots


def test_a_directory_that_is_a_symbolic_link_is_refused(tmp_path):
    """Guards against records written wherever someone pointed a link."""
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "usage").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UsageDirRefused, match="symbolic link"):
        UsageLog(tmp_path / "usage").open()
    assert list((tmp_path / "elsewhere").iterdir()) == []


# -----------------------------------------------------------------------------
# Reading what is there
# -----------------------------------------------------------------------------


def test_bad_lines_are_skipped_and_links_and_pipes_are_not_followed(tmp_path):
    """Guards against a report that dies on a bad line, hangs on a pipe, or counts
    a file someone linked in as the linker's own."""
    directory = tmp_path / "usage"
    directory.mkdir(mode=0o700)
    good = record(cpus=3).model_dump_json()
    (directory / "0-1-a.jsonl").write_text(
        "\n".join(
            [
                good,
                "not json at all",
                '{"label": "no times"}',
                good.replace('"cpus":3', '"cpus":-1'),
                good.replace(good.split('"ended_at":')[1].split(",")[0], "NaN"),
                "",
                good,
                good[:40],  # the line a kernel killed mid-write leaves
            ]
        )
    )
    outside = tmp_path / "someone-elses.jsonl"
    outside.write_text(record(cpus=50).model_dump_json() + "\n")
    (directory / "x.jsonl").symlink_to(outside)
    os.mkfifo(directory / "pipe.jsonl")
    (directory / "notes.txt").write_text("not a records file\n")

    rows = read_usage(directory)
    assert [r.cpus for _, r in rows] == [3, 3]
    assert rows.bad_lines == 5
    assert rows.not_plain_files == 2
    text = describe_usage(summarise(rows), 0, not_plain=2, bad_lines=5)
    assert "2 entries named like records are not a plain file" in text
    assert "5 lines that are not a usage record" in text


def test_peak_card_memory_is_the_largest_any_claim_held_and_unread_is_not_zero(tmp_path):
    log = UsageLog(tmp_path / "records", create=True)
    log.write(record(gpus=(0,), notebook="a.ipynb", peak_gpu_bytes=3 * 10**9))
    log.write(record(gpus=(1,), notebook="a.ipynb", peak_gpu_bytes=5 * 10**9))
    log.write(record(gpus=(0,), notebook="a.ipynb"))
    log.write(record(notebook="b.ipynb"))
    rows = summarise(read_usage(tmp_path / "records"))
    assert {row["notebook"]: row["peak_gpu_bytes"] for row in rows} == {
        "a.ipynb": 5 * 10**9,
        "b.ipynb": None,
    }
    header, first, second, *_ = describe_usage(rows).splitlines()
    assert "PEAK RSS  PEAK GPU" in header
    # USER NOTEBOOK CLAIMS CORE-H CARD-H, then the two peaks.
    assert first.split()[5:7] == ["0B", "5.0GB"]
    assert second.split()[5:7] == ["0B", "-"]


def test_a_missing_directory_has_no_records():
    """Guards against `fluksio-nb usage` failing for someone who never claimed."""
    rows = read_usage(Path("/nonexistent/fluksio/usage"))
    assert list(rows) == [] and rows.skipped_files == 0
    assert describe_usage(summarise(rows)) == "No claims recorded."


def test_unreadable_files_of_other_users_are_said_to_be_private():
    """Guards against a report that silently leaves out what it could not read."""
    assert describe_usage([], 3).splitlines() == [
        "No claims recorded.",
        "3 files of other users are not readable: records are private to their owner and root.",
    ]


# -----------------------------------------------------------------------------
# Root's report of everyone, whatever one user wrote
# -----------------------------------------------------------------------------


@contextmanager
def plant_as_a_user(records: str) -> Iterator[Path]:
    """A shared records directory where a real second user left ``records``'s lines.

    ``records`` is a Python expression, evaluated as that user, giving an
    iterable of records as dicts. The caller removes the directory.
    """
    attacker = ready_user(USER_A)
    with shared_tmp_dir() as shared:
        shared.chmod(0o1777)
        planted = run_as(
            attacker,
            textwrap.dedent(
                f"""
                import json, os
                path = os.path.join({str(shared)!r}, "planted.jsonl")
                with open(path, "w") as planted:
                    for one in {records}:
                        planted.write(json.dumps(one) + "\\n")
                os.chmod(path, 0o644)
                """
            ),
        )
        assert planted.returncode == 0, planted.stderr
        yield shared


def test_a_users_notebooks_and_endings_are_told_apart_up_to_a_bound_and_all_counted(
    capsys, monkeypatch
):
    """Guards against root's report growing a row, or an ending, for every line a
    user writes: notebook names and endings are the user's to choose."""
    monkeypatch.setattr(usage_report, "NOTEBOOKS_AT_MOST", 50, raising=False)
    monkeypatch.setattr(usage_report, "ENDINGS_AT_MOST", 5, raising=False)
    with plant_as_a_user(
        '({"label": "x", "notebook": f"n{i}.ipynb", "asked_at": 0, "granted_at": 0,'
        ' "ended_at": 3600, "ending": f"e{i}", "cpus": 1} for i in range(3000))'
    ) as shared:
        assert usage_main(["--dir", str(shared), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    notebooks = [row["notebook"] for row in report["rows"] if row["user"] == USER_A]
    assert notebooks[:2] == ["(other notebooks)", "n0.ipynb"] and len(notebooks) == 51
    [total] = report["users"]
    assert (total["user"], total["claims"]) == (USER_A, 3000), "a claim went uncounted"
    assert total["core_hours"] == pytest.approx(3000.0)
    assert total["endings"] == {**{f"e{i}": 1 for i in range(5)}, "(other)": 2995}


def test_the_report_holds_no_records_while_it_reads_a_planted_file():
    """Guards against root's report keeping every line of a file a user filled
    with minimal records (as audited: 1.3 million rows, 1.5 GB from 64 MiB)."""
    with plant_as_a_user(
        '[{"label": "", "asked_at": 0, "ended_at": 0, "ending": ""}] * 60_000'
    ) as shared:
        size = (shared / "planted.jsonl").stat().st_size
        assert size > 3 * 2**20
        tracemalloc.start()
        try:
            assert usage_main(["--dir", str(shared), "--json"]) == 0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # A piece of the file at a time, and one row: less than the file, let alone its records.
    assert peak < 4 * 2**20, f"{peak / 2**20:.0f} MiB held reading {size / 2**20:.0f} MiB"


# -----------------------------------------------------------------------------
# The command
# -----------------------------------------------------------------------------


def test_since_takes_dates_times_and_spans_back_from_now():
    now = 1_800_000_000.0
    assert parse_since("2026-11-30", now) == datetime(2026, 11, 30).timestamp()
    assert parse_since("2026-11-30T12:00", now) == datetime(2026, 11, 30, 12).timestamp()
    assert parse_since("45s", now) == now - 45
    assert parse_since("90m", now) == now - 90 * 60
    assert parse_since("24h", now) == now - 86400
    assert parse_since("7d", now) == now - 7 * 86400


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--dir", "/nonexistent/records"], "no directory /nonexistent/records"),
        (["--user", "nobody-by-this-name"], "there is no user 'nobody-by-this-name'"),
        (["--user", ""], "there is no user ''"),
    ],
)
def test_a_mistyped_directory_or_user_is_refused_not_reported_as_no_claims(
    capsys, tmp_path, argv, words
):
    """Guards against "No claims recorded." for a typo, which reads as an idle machine."""
    assert usage_main([*argv, "--dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and words in error, error


def test_a_bad_since_is_one_line_that_says_what_is_accepted(capsys, tmp_path):
    """Guards against a traceback, or an error that does not say what would do."""
    assert usage_main(["--since", "last tuesday", "--dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "'last tuesday'" in error
    assert all(form in error for form in ("2026-11-30", "2026-11-30T12:00", "90m", "24h", "7d"))


def test_since_user_and_json_pick_and_shape_the_report(tmp_path, capsys):
    """Guards against filters that let through what they should not, and a JSON
    report whose shape scripts cannot rely on."""
    user = nobody()
    directory = tmp_path / "usage"
    mine = UsageLog(directory)
    mine.write(record(cpus=2, notebook="a.ipynb", ended_at=time.time() - 10 * 86400))
    mine.write(record(cpus=2, notebook="a.ipynb"))
    mine.write(record(cpus=1, notebook="b.ipynb", ending="error"))
    mine.close()
    theirs = directory / f"{user.pw_uid}-1-b.jsonl"
    theirs.write_text(record(cpus=8, notebook="c.ipynb").model_dump_json() + "\n")
    os.chown(theirs, user.pw_uid, user.pw_gid)

    def report(*argv: str) -> dict:
        assert usage_main(["--dir", str(directory), "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    everything = report()
    assert set(everything) >= {"rows", "users", "skipped_files"}
    assert [(r["user"], r["notebook"], r["claims"]) for r in everything["rows"]] == [
        (user.pw_name, "c.ipynb", 1),
        (ME, "a.ipynb", 2),
        (ME, "b.ipynb", 1),
    ]
    assert everything["skipped_files"] == 0
    recent = report("--since", "7d", "--user", ME)
    assert [(r["notebook"], r["claims"], r["core_hours"]) for r in recent["rows"]] == [
        ("a.ipynb", 1, pytest.approx(2.0)),
        ("b.ipynb", 1, pytest.approx(1.0)),
    ]
    [total] = recent["users"]
    assert (total["user"], total["notebooks"], total["claims"]) == (ME, 2, 2)
    assert total["core_hours"] == pytest.approx(3.0)
    assert total["endings"] == {"ok": 1, "error": 1}
    assert [r["user"] for r in report("--user", user.pw_name)["rows"]] == [user.pw_name]

    assert usage_main(["--dir", str(directory), "--user", ME]) == 0
    table = capsys.readouterr().out
    assert "(all notebooks)" in table and "c.ipynb" not in table


def test_the_usage_subcommand_leaves_the_others_as_they_were(tmp_path):
    """Guards against `fluksio-nb usage` breaking `fluksio-nb flavors` or the snapshot."""
    run = [sys.executable, "-m", "fluksio_nb"]
    flavors = subprocess.run([*run, "flavors"], capture_output=True, text=True, timeout=60)
    assert flavors.returncode == 0 and "flavor" in flavors.stdout
    snapshot = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert snapshot.returncode == 0 and snapshot.stdout.startswith("cpus")
    usage = subprocess.run([*run, "usage"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and usage.stdout.strip() == "No claims recorded."


# -----------------------------------------------------------------------------
# End to end, in a real kernel
# -----------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_every_ending_of_a_claimed_cell_is_counted_by_fluksio_nb_usage(tmp_path):
    """Guards against the endings most easily missed (an error, a timeout while
    still waiting) going uncounted, and totals that disagree with the clock."""
    kernel = Kernel(
        FLUKSIO_CPUS="2",
        FLUKSIO_RESERVE_CPUS="0",
        FLUKSIO_LEDGER="kernel",
        FLUKSIO_CONFIG=str(tmp_path / "fluksio_nb.json"),
        JPY_SESSION_NAME="analysis.ipynb",
    )
    go = tmp_path / "go"
    try:
        kernel.run(f"GO = {str(go)!r}", check=True)
        holder_asked = time.time()
        kernel.start_job(
            "%%claim cpus=2 --background --label holder\n"
            "import os, time\n"
            "while not os.path.exists(GO):\n"
            "    time.sleep(0.02)",
            "holder",
        )
        holder_queued = time.time()

        impatient_asked = time.time()
        impatient = kernel.run("%%claim cpus=2 --timeout 1 --label impatient\nprint('never')")
        impatient_done = time.time()
        assert impatient.status == "error" and "never" not in impatient.stdout

        go.touch()
        released = time.time()
        assert kernel.facts("[holder.result(30) is not None, holder.status]") == [True, "ok"]
        holder_done = time.time()

        raising_asked = time.time()
        raising = kernel.run("%%claim cpus=1 --label raising\nraise ValueError('no')")
        raising_done = time.time()
        assert raising.error["ename"] == "ValueError"
    finally:
        kernel.shutdown()

    out = subprocess.run(
        [sys.executable, "-m", "fluksio_nb", "usage", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    [row] = report["rows"]
    assert (row["user"], row["notebook"], row["claims"]) == (ME, "analysis.ipynb", 3)
    assert row["endings"] == {"ok": 1, "timed out": 1, "error": 1}
    assert report["skipped_files"] == 0

    by_label = {r.label: r for _, r in read_usage(default_usage_dir())}
    holder, timed_out, raised = by_label["holder"], by_label["impatient"], by_label["raising"]
    assert (holder.cpus, holder.ending) == (2, "ok")
    assert (timed_out.cpus, timed_out.granted_at, timed_out.ending) == (0, None, "timed out")
    assert (raised.cpus, raised.ending) == (1, "error")
    # Each under the number its kernel's queue gave it, which the panel's notices match.
    assert len({holder.ticket, timed_out.ticket, raised.ticket}) == 3
    assert all(isinstance(r.ticket, int) for r in (holder, timed_out, raised))
    # The holder held its share from before it was queued to after it was let go,
    # and the impatient cell waited its whole second and no longer than it took.
    assert released - holder_queued <= holder.ran_s <= holder_done - holder_asked
    assert 0.95 <= timed_out.waited_s <= impatient_done - impatient_asked
    assert 0 <= raised.ran_s <= raising_done - raising_asked
    assert row["ran_s"] == pytest.approx(holder.ran_s + raised.ran_s)
    assert row["core_hours"] * HOUR == pytest.approx(2 * holder.ran_s + raised.ran_s)
    assert row["waited_s"] == pytest.approx(holder.waited_s + timed_out.waited_s + raised.waited_s)
    assert row["waited_s"] <= (
        (holder_queued - holder_asked)
        + (impatient_done - impatient_asked)
        + (raising_done - raising_asked)
    )


@pytest.mark.timeout(180)
def test_background_claims_are_ended_and_counted_when_their_kernel_is_restarted(tmp_path):
    """Guards against the restart button losing the books of a kernel's background
    work: a waiting job's record never written, a running one's left to a race
    with the interpreter's exit, and its worker left behind."""
    kernel = Kernel(
        FLUKSIO_CPUS="2",
        FLUKSIO_RESERVE_CPUS="0",
        FLUKSIO_LEDGER="kernel",
        FLUKSIO_CONFIG=str(tmp_path / "fluksio_nb.json"),
    )
    pid_file = tmp_path / "worker.pid"
    try:
        kernel.start_job(
            "%%claim cpus=2 --background --label holder\n"
            f"import os\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            + until_it_exists(tmp_path / "never"),
            "holder",
        )
        kernel.start_job("%%claim cpus=2 --background --label waiter\nx = 1", "waiter")
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 60)
        worker = int(pid_file.read_text())
        assert kernel.facts("[holder.status, waiter.status]") == ["running", "waiting"]
        asked_to_restart = time.time()

        kernel.manager.restart_kernel(now=False)
        kernel.client.wait_for_ready(timeout=60)
    finally:
        kernel.shutdown()

    by_label = {r.label: r for _, r in read_usage(default_usage_dir())}
    holder, waiter = by_label["holder"], by_label["waiter"]
    assert (holder.ending, holder.cpus) == ("cancelled", 2)
    assert holder.ended_at >= asked_to_restart
    assert (waiter.ending, waiter.granted_at) == ("cancelled", None)
    assert gone(worker)


# -----------------------------------------------------------------------------
# A kernel killed outright
# -----------------------------------------------------------------------------


def records_by_file(directory: Path) -> dict[str, list[UsageRecord]]:
    """Each records file's records, by its name, which starts with its writer's uid and pid."""
    return {
        path.name: [UsageRecord.model_validate_json(line) for line in path.read_text().splitlines()]
        for path in directory.glob("*.jsonl")
    }


@pytest.mark.timeout(180)
def test_a_kernel_killed_holding_and_waiting_is_recorded_once_by_its_users_books_service(
    tmp_path,
):
    """Guards against a kernel killed with SIGKILL (the OOM killer, `kill -9`) taking
    its claims' core-hours with it, since it writes its records itself; against a
    peak memory made up for it; and against a claim it ended itself counted twice."""
    books = {
        "FLUKSIO_CPUS": "2",
        "FLUKSIO_GPUS": "1",
        "FLUKSIO_RESERVE_CPUS": "0",
        "FLUKSIO_LEDGER": str(tmp_path / "ledger"),
        "FLUKSIO_CONFIG": str(tmp_path / "fluksio_nb.json"),
        "JPY_SESSION_NAME": "doomed.ipynb",
    }
    doomed, other = Kernel(**books), Kernel(**{**books, "JPY_SESSION_NAME": "other.ipynb"})
    try:
        doomed.run("%%claim cpus=1 --label fine\nx = 1", check=True)
        doomed.start_job(
            f"%%claim gpus=1 --background --label held\n{until_it_exists(tmp_path / 'never')}",
            "held",
        )
        doomed.start_job("%%claim gpus=1 --background --label queued\nx = 2", "queued")
        assert doomed.facts("[held.status, queued.status]") == ["running", "waiting"]
        other.start_job("%%claim gpus=1 --background --label next\nx = 3", "next")
        assert other.facts("next.status") == "waiting"

        os.kill(doomed.pid, signal.SIGKILL)
        assert gone(doomed.pid, 30)
        assert other.facts("[next.result(60) is not None, next.status]") == [True, "ok"]
        directory = default_usage_dir()
        assert wait_until(lambda: len([r for _, r in read_usage(directory)]) == 4, 30), (
            "the killed kernel's claims were not recorded"
        )
        found_at = time.time()
        # The user's books service, found while the kernel it serves lives.
        (service,) = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "--books" in (p.info["cmdline"] or [])
            and books["FLUKSIO_LEDGER"] in p.info["cmdline"]
        ]
    finally:
        doomed.shutdown()
        other.shutdown()

    files = records_by_file(directory)
    by_label = {r.label: r for records in files.values() for r in records}
    assert sorted(r.label for records in files.values() for r in records) == [
        "fine",
        "held",
        "next",
        "queued",
    ], "a claim recorded twice, or not at all"
    # Written by the user's books service, which saw the kernel's connection
    # close, as the same user: counted against them.
    [(reaper, records)] = [(n, rs) for n, rs in files.items() if any(r.label == "held" for r in rs)]
    assert reaper.startswith(f"{os.geteuid()}-{service.pid}-")
    assert sorted(r.label for r in records) == ["held", "queued"]

    held, queued = by_label["held"], by_label["queued"]
    assert (held.ending, held.cpus, held.gpus, held.notebook) == (
        "kernel died",
        1,
        [0],
        "doomed.ipynb",
    )
    assert held.granted_at is not None and held.granted_at < held.ended_at <= found_at
    assert held.peak_rss_bytes is None, "a peak memory nobody alive knew was made up"
    assert (queued.ending, queued.cpus, queued.gpus, queued.granted_at) == (
        "kernel died",
        0,
        [],
        None,
    )
    assert by_label["fine"].ending == "ok"

    out = subprocess.run(
        [sys.executable, "-m", "fluksio_nb", "usage", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = {row["notebook"]: row for row in json.loads(out.stdout)["rows"]}
    assert rows["doomed.ipynb"]["endings"] == {"ok": 1, "kernel died": 2}
    assert rows["doomed.ipynb"]["core_hours"] * HOUR == pytest.approx(
        by_label["fine"].ran_s + held.ran_s
    )
    table = subprocess.run(
        [sys.executable, "-m", "fluksio_nb", "usage"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "1 ok, 2 kernel died" in table.replace("2 kernel died, 1 ok", "1 ok, 2 kernel died")


def test_only_a_file_of_roots_may_say_whose_records_it_holds(shared_dir):
    """Guards against a user charging claims to someone else by writing records that
    say they are the books service's, for that someone; and against the service's
    records of a killed kernel charged to root, who wrote them."""
    forger = nobody()
    victim = ready_user(USER_A)

    def died(cpus: int) -> UsageRecord:
        return record(cpus=cpus, ending="kernel died").model_copy(update={"uid": victim.uid})

    service = UsageLog(shared_dir, create=False)
    service.write(died(cpus=2))
    service.close()

    def forge() -> bool:
        UsageLog(shared_dir, create=False).write(died(cpus=8))
        return True

    in_child_as(forger, forge)
    rows = read_usage(shared_dir)
    assert sorted((r.cpus, name) for name, r in rows) == [(2, USER_A), (8, forger.pw_name)]
    assert [r.cpus for _, r in read_usage(shared_dir, user=USER_A)] == [2]
    assert [r.cpus for _, r in read_usage(shared_dir, user=forger.pw_name)] == [8]
    assert read_usage(shared_dir, user="root") == []
    # What reads root's own records unasked (its panel) is not shown others' in root's file.
    counts = UsageRows()
    assert list(each_usage(shared_dir, counts, owner=0)) == []
    # What the books service reads for a user: root's records of theirs, not a forgery.
    deaths, more = kernel_deaths(shared_dir, victim.uid)
    assert ([r.cpus for r in deaths], more) == ([2], 0)
    assert kernel_deaths(shared_dir, forger.pw_uid) == ([], 0)


def test_a_records_file_is_counted_once_whatever_its_names(tmp_path):
    """Guards against a hard link to a records file (another user's, in a shared
    directory) counting its claims twice."""
    log = UsageLog(tmp_path / "usage")
    log.write(record(cpus=3))
    log.close()
    assert log.path is not None
    os.link(log.path, log.path.with_name("again.jsonl"))
    assert [r.cpus for _, r in read_usage(tmp_path / "usage")] == [3]


#: Records written with the stop pressed at every moment it could land in the
#: records' code, in contextlib's and in threading's: after each, another thread
#: must still write one.
STOP_AT_EVERY_MOMENT_OF_A_RECORD = """
import contextlib, tempfile, threading
import fluksio_nb.records as records
from fluksio_nb.records import UsageLog, UsageRecord

log = UsageLog(Path(tempfile.mkdtemp()) / "usage")
record = UsageRecord(label="stopped", asked_at=0.0, ended_at=1.0, ending="ok")

def attempt(made):
    log.write(record)

def check():
    if not finishes(log.write, record):
        return "records_stuck_after_a_stop"

watched = [records.__file__, contextlib.__file__, threading.__file__]
each_moment(watched, attempt, lambda made: None, check)
"""


def test_a_stop_at_any_moment_of_writing_a_record_leaves_the_next_one_written():
    """Guards against a stop landing as the record file's lock was taken in a context
    manager made of a generator: the lock stayed held, and the kernel's every later
    claim waited for it as it ended."""
    said = said_by("from pathlib import Path\n" + STOP_AT_EVERY_MOMENT_OF_A_RECORD, timeout=100)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 3, said
