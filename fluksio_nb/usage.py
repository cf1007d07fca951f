"""Who used how much of the machine: one record per claim, and ``fluksio-nb usage``.

A shared box raises the questions a cluster's ``sacct`` answers: who ran
what, how many core-hours and card-hours it took, how much memory it
peaked at, and how long people waited for their share. The books only know
what is held now, so every claim, however it ends (ok, an error, the stop
button, halted, timed out, a dead worker, cancelled, even while still
waiting), leaves one record behind when it ends.

What it decides:

- **A record is only as true as its file's owner.** Each process appends to
  a file of its own that it creates, and the user a record is counted
  against is the owner of that file, as the kernel says (``fstat``), never a
  name written in it. Nobody can charge their claims to someone else, and a
  file of someone else's can only ever be counted against them.
- **Only a directory nobody else can tamper with.** Records go into a
  directory of the user's own that no one else may write to (made ``0700``
  when missing), or a root-owned shared one with the sticky bit, where
  others may add files of their own but never remove or rename ours.
  Anything else is refused with what is wrong and how to fix it. Files are
  created exclusively, never through a symbolic link, readable by their
  owner alone.
- **Accounting never fails a cell.** A record that cannot be written
  becomes one warning per process naming the directory and the reason; the
  cell ends as it would have. Writing one costs one ``write`` to a file
  kept open, which a warm claimed cell (about 8 ms) does not notice.
- **Reading trusts nothing in the directory.** Links are not followed,
  pipes and devices not opened, lines that are not records skipped and
  counted, and what is read from one file is capped, so a hostile file can
  neither hang the report nor exhaust its memory. Another user's records
  are private to them (and root): they are counted as unreadable, not shown.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import secrets
import stat
import sys
import threading
import time
import warnings
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, NonNegativeInt, ValidationError

from fluksio_nb.budget import human
from fluksio_nb.identity import user_name

#: What is read of one records file at most. A kernel writes about 300 bytes
#: per claim, so this is some 200,000 claims from one process: more than any
#: real one makes, and little enough memory that a hostile file costs nothing.
READ_AT_MOST = 64 * 2**20

_SUFFIX = ".jsonl"


class UsageRecord(BaseModel):
    """One claim, as it ended: what it held, and when it asked, got and gave back its share."""

    model_config = ConfigDict(extra="ignore")

    label: str
    notebook: str | None = None
    #: Granted, not asked: 0 for a claim that never got its share.
    cpus: NonNegativeInt = 0
    #: The card ids granted.
    gpus: list[NonNegativeInt] = Field(default_factory=list)
    ram_bytes: NonNegativeInt = 0
    #: ``time.time()`` when the claim joined the queue.
    asked_at: FiniteFloat
    granted_at: FiniteFloat | None = None
    ended_at: FiniteFloat
    ending: str
    peak_rss_bytes: NonNegativeInt = 0

    # Never below zero: the wall clock may be stepped back between two readings.
    @property
    def waited_s(self) -> float:
        """From joining the queue to the share, or to the end for a claim never granted."""
        until = self.granted_at if self.granted_at is not None else self.ended_at
        return max(0.0, until - self.asked_at)

    @property
    def ran_s(self) -> float:
        """How long the share was held."""
        if self.granted_at is None:
            return 0.0
        return max(0.0, self.ended_at - self.granted_at)

    @property
    def core_hours(self) -> float:
        return self.cpus * self.ran_s / 3600

    @property
    def card_hours(self) -> float:
        return len(self.gpus) * self.ran_s / 3600


class UsageDirRefused(PermissionError):
    """The records directory is one where others could remove or replace the records."""


class UsageNotRecorded(UserWarning):
    """A claim's usage record could not be written; the claim itself was unaffected."""


# -- writing -------------------------------------------------------------------


def default_usage_dir() -> Path:
    """Where a user's own records go when the machine has no shared records directory."""
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "fluksio" / "usage"


def _why_refused(info: os.stat_result, me: int) -> str | None:
    """What makes a directory unfit for this user's records; ``None`` when it is fit."""
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid == 0 and mode & stat.S_ISVTX:
        # A machine's shared directory: others may add files, never remove ours.
        return None
    if info.st_uid == me:
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            return (
                f"is writable by its group or others (mode {mode:04o}), so they could remove "
                "or replace your records; run `chmod go-w` on it"
            )
        return None
    if info.st_uid == 0:
        return (
            f"belongs to root but has no sticky bit (mode {mode:04o}), so anyone who may write "
            "there may also remove your records; an admin fixes it with `chmod +t`"
        )
    return (
        f"belongs to {user_name(info.st_uid)!r}, not to you ({user_name(me)!r}), who could "
        "read, remove or replace your records; use a directory of your own, or a root-owned "
        "shared one with the sticky bit (mode 1777)"
    )


def _open_directory(directory: Path, create: bool) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(directory, flags)
    except FileNotFoundError:
        if not create:
            # A shared directory made by a user would be theirs, not root's.
            raise FileNotFoundError(
                errno.ENOENT,
                f"the machine's records directory {directory} does not exist; an admin makes it",
            ) from None
        directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        fd = os.open(directory, flags)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UsageDirRefused(
                f"usage records directory {directory} is a symbolic link or not a directory; "
                "records are written only into a real directory, so replace it with one"
            ) from None
        raise
    try:
        why = _why_refused(os.fstat(fd), os.geteuid())
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        raise UsageDirRefused(f"usage records directory {directory} {why}")
    return fd


class UsageLog:
    """Where this process appends its claims' records: one file of its own, kept open.

    ``create`` makes the directory (``0700``) if it is missing: right for a
    user's own, wrong for a machine's shared one, which an admin makes.
    """

    def __init__(self, directory: Path, *, create: bool = True) -> None:
        self.directory = Path(directory)
        self.create = create
        #: This process's file, once it has one.
        self.path: Path | None = None
        self._fd: int | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._warned = False

    def open(self) -> Path:
        """Open this process's file now; raise what is wrong with the directory if it cannot."""
        with self._for_this_process():
            self._file()
            assert self.path is not None
            return self.path

    def write(self, record: UsageRecord) -> None:
        """Append one record. Never raises: a failure is one warning per process."""
        try:
            line = (record.model_dump_json() + "\n").encode()
            with self._for_this_process():
                fd = self._file()
                while line:
                    line = line[os.write(fd, line) :]
        except Exception as error:
            self._warn(error)

    def close(self) -> None:
        with self._for_this_process():
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    @contextlib.contextmanager
    def _for_this_process(self):
        if self._pid != os.getpid():
            # A child of fork: the lock may have been held by a thread that does
            # not exist here, and the file is the parent's. Records written
            # there would be the parent's in the report; the child starts its own.
            self._lock = threading.Lock()
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            self._fd, self.path, self._pid = None, None, os.getpid()
        with self._lock:
            yield

    def _file(self) -> int:
        if self._fd is not None:
            if os.fstat(self._fd).st_nlink:
                return self._fd
            # Deleted from under us: records appended to it now would be read by nobody.
            os.close(self._fd)
            self._fd = None
        directory = _open_directory(self.directory, self.create)
        try:
            name = f"{os.geteuid()}-{os.getpid()}-{secrets.token_hex(8)}{_SUFFIX}"
            self._fd = os.open(
                name,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=directory,
            )
        finally:
            os.close(directory)
        self.path = self.directory / name
        return self._fd

    def _warn(self, error: Exception) -> None:
        if self._warned:
            return
        self._warned = True
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        # A refusal names the directory already, with what to do about it.
        where = "" if str(self.directory) in reason else f" in {self.directory}"
        warnings.warn(
            f"fluksio_nb could not record this kernel's claims{where}: {reason}. The claims "
            "themselves are unaffected, but `fluksio-nb usage` will not count them.",
            UsageNotRecorded,
            stacklevel=2,
        )


_log_lock = threading.Lock()
_log: UsageLog | None = None
_log_key: tuple[Any, str | None] | None = None


def kernel_usage_log() -> UsageLog:
    """This process's log, in the machine's shared records directory if it has one."""
    import fluksio_nb.kernel

    global _log, _log_key
    books = fluksio_nb.kernel.accountant()
    # Finding the directory costs about 60 µs (jupyter_core); the same books
    # and the same data dir mean the same directory, so it is found once.
    key = (books, os.environ.get("JUPYTER_DATA_DIR"))
    with _log_lock:
        if _log is None or _log_key is None or _log_key[0] is not books or _log_key[1] != key[1]:
            shared = getattr(books, "records_dir", None)
            if _log is not None:
                _log.close()
            _log = UsageLog(Path(shared or default_usage_dir()), create=shared is None)
            _log_key = key
        return _log


# -- reading -------------------------------------------------------------------


class UsageRows(list):
    """``(user, record)`` pairs read from records files, and what could not be read."""

    def __init__(self, rows: Iterable[tuple[str, UsageRecord]] = ()) -> None:
        super().__init__(rows)
        #: Files we may not open: another user's, private to them and root.
        self.unreadable_files = 0
        #: Entries named like records that are links, pipes or directories.
        self.not_plain_files = 0
        #: Lines that are not records: cut short by a crash, or written by hand.
        self.bad_lines = 0

    @property
    def skipped_files(self) -> int:
        return self.unreadable_files + self.not_plain_files

    def absorb(self, other: UsageRows) -> None:
        self.extend(other)
        self.unreadable_files += other.unreadable_files
        self.not_plain_files += other.not_plain_files
        self.bad_lines += other.bad_lines


def read_usage(directory: Path, since: float | None = None, user: str | None = None) -> UsageRows:
    """Every record in ``directory`` that ended at or after ``since``, of ``user`` if given.

    A directory that does not exist has no records. One that may not be
    listed raises :class:`PermissionError`.
    """
    rows = UsageRows()
    try:
        where = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return rows
    names: dict[int, str] = {}
    try:
        for name in sorted(os.listdir(where)):
            if not name.endswith(_SUFFIX):
                continue
            try:
                found = os.stat(name, dir_fd=where, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(found.st_mode):
                rows.not_plain_files += 1
                continue
            if user is not None and _named(found.st_uid, names) != user:
                continue
            _read_file(where, name, since, user, names, rows)
    finally:
        os.close(where)
    return rows


def _named(uid: int, names: dict[int, str]) -> str:
    if uid not in names:
        names[uid] = user_name(uid)
    return names[uid]


def _read_file(
    where: int,
    name: str,
    since: float | None,
    user: str | None,
    names: dict[int, str],
    rows: UsageRows,
) -> None:
    try:
        # O_NONBLOCK: a pipe swapped in since the stat must not hang the report.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=where)
    except PermissionError:
        rows.unreadable_files += 1
        return
    except FileNotFoundError:
        return
    except OSError:
        # ELOOP: swapped for a link since the stat; ENXIO: a socket.
        rows.not_plain_files += 1
        return
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            rows.not_plain_files += 1
            return
        # The file as opened, not as first seen, says whose records these are.
        owner = _named(info.st_uid, names)
        if user is not None and owner != user:
            return
        data = bytearray()
        while len(data) < READ_AT_MOST:
            chunk = os.read(fd, min(2**20, READ_AT_MOST - len(data)))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    for line in bytes(data).splitlines():
        if not line.strip():
            continue
        try:
            record = UsageRecord.model_validate_json(line)
        except ValidationError:
            rows.bad_lines += 1
            continue
        if since is None or record.ended_at >= since:
            rows.append((owner, record))


# -- adding up -----------------------------------------------------------------


def _totals(**keys: Any) -> dict[str, Any]:
    return {
        **keys,
        "claims": 0,
        "core_hours": 0.0,
        "card_hours": 0.0,
        "peak_rss_bytes": 0,
        "waited_s": 0.0,
        "ran_s": 0.0,
        "endings": {},
    }


def _add(into: dict[str, Any], part: dict[str, Any]) -> None:
    into["claims"] += part["claims"]
    for name in ("core_hours", "card_hours", "waited_s", "ran_s"):
        into[name] += part[name]
    into["peak_rss_bytes"] = max(into["peak_rss_bytes"], part["peak_rss_bytes"])
    for ending, count in part["endings"].items():
        into["endings"][ending] = into["endings"].get(ending, 0) + count


def _one(record: UsageRecord) -> dict[str, Any]:
    return {
        "claims": 1,
        "core_hours": record.core_hours,
        "card_hours": record.card_hours,
        "peak_rss_bytes": record.peak_rss_bytes,
        "waited_s": record.waited_s,
        "ran_s": record.ran_s,
        "endings": {record.ending: 1},
    }


def summarise(rows: Iterable[tuple[str, UsageRecord]]) -> list[dict[str, Any]]:
    """One row per user and notebook: claims, core- and card-hours, peak memory, time waited.

    Peak memory is the largest any one claim reached; times and hours add up.
    """
    groups: dict[tuple[str, str | None], dict[str, Any]] = {}
    for user, record in rows:
        row = groups.get((user, record.notebook))
        if row is None:
            row = groups[(user, record.notebook)] = _totals(user=user, notebook=record.notebook)
        _add(row, _one(record))
    return [groups[key] for key in sorted(groups, key=_by_user_then_notebook)]


def _by_user_then_notebook(key: tuple[str, str | None]) -> tuple[str, bool, str]:
    user, notebook = key
    return (user, notebook is None, notebook or "")


def user_totals(summary: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary's rows added up per user, with how many notebooks each used."""
    users: dict[str, dict[str, Any]] = {}
    for row in summary:
        total = users.get(row["user"])
        if total is None:
            total = users[row["user"]] = _totals(user=row["user"], notebooks=0)
        total["notebooks"] += 1
        _add(total, row)
    return [users[name] for name in sorted(users)]


# -- telling -------------------------------------------------------------------


def _span(seconds: float) -> str:
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _endings(endings: dict[str, int]) -> str:
    return ", ".join(f"{count} {ending}" for ending, count in sorted(endings.items()))


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def describe_usage(
    summary: list[dict[str, Any]], skipped: int = 0, *, not_plain: int = 0, bad_lines: int = 0
) -> str:
    """The summary as a table, a total for each user with several notebooks, and what was not read.

    ``skipped`` counts other users' files that could not be read.
    """
    lines: list[str] = []
    if summary:
        header = [
            "USER",
            "NOTEBOOK",
            "CLAIMS",
            "CORE-H",
            "CARD-H",
            "PEAK RSS",
            "WAITED",
            "RAN",
            "ENDINGS",
        ]
        table = [header]
        totals = {total["user"]: total for total in user_totals(summary)}
        for index, row in enumerate(summary):
            table.append(_cells(row, row["user"], row["notebook"] or "-"))
            last_of_user = index + 1 == len(summary) or summary[index + 1]["user"] != row["user"]
            if last_of_user and totals[row["user"]]["notebooks"] > 1:
                table.append(_cells(totals[row["user"]], row["user"], "(all notebooks)"))
        widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
        for cells in table:
            # Names left, numbers right, how the claims ended last, as it is ragged.
            text = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
            text += [cell.rjust(width) for cell, width in zip(cells[2:8], widths[2:8], strict=True)]
            lines.append("  ".join(text + cells[8:]).rstrip())
    else:
        lines.append("No claims recorded.")
    if skipped:
        lines.append(
            f"{_plural(skipped, 'file', 'files')} of other users "
            f"{'is' if skipped == 1 else 'are'} not readable: records are private to their "
            "owner and root."
        )
    if not_plain:
        lines.append(
            f"{_plural(not_plain, 'entry', 'entries')} named like records "
            f"{'is' if not_plain == 1 else 'are'} not a plain file (a link, a pipe) and "
            f"{'was' if not_plain == 1 else 'were'} not read."
        )
    if bad_lines:
        lines.append(
            f"{_plural(bad_lines, 'line', 'lines')} that {'is' if bad_lines == 1 else 'are'} "
            "not a usage record (cut short by a crash, or not written by fluksio_nb) "
            f"{'was' if bad_lines == 1 else 'were'} skipped."
        )
    return "\n".join(lines)


def _cells(row: dict[str, Any], user: str, notebook: str) -> list[str]:
    return [
        user,
        notebook,
        str(row["claims"]),
        f"{row['core_hours']:.2f}",
        f"{row['card_hours']:.2f}",
        human(row["peak_rss_bytes"]),
        _span(row["waited_s"]),
        _span(row["ran_s"]),
        _endings(row["endings"]),
    ]


# -- the command ---------------------------------------------------------------


class BadSince(ValueError):
    """``--since`` is neither a date nor a span back from now."""


_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([mhdw])\s*$")
_SPAN_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """``--since`` as a ``time.time()``: an ISO date or time (local unless it says), or ``7d``."""
    span = _SPAN.match(text)
    if span:
        now = time.time() if now is None else now
        return now - float(span.group(1)) * _SPAN_SECONDS[span.group(2)]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise BadSince(
            f"--since {text!r} is neither a date nor a span: give a date or time like "
            "2026-11-30 or 2026-11-30T12:00, or a span back from now like 90m, 24h or 7d"
        ) from None


def usage_dirs() -> list[Path]:
    """The directories ``fluksio-nb usage`` reads when given no ``--dir``.

    The user's own, and on a machine whose books every user shares, the
    machine's records directory, as its service names it. No accountant is
    made: a terminal makes no claims.
    """
    from fluksio_nb.errors import ServiceUnavailable
    from fluksio_nb.kernel import books_in_force
    from fluksio_nb.machine.client import ask_once

    dirs = [default_usage_dir()]
    books = books_in_force()
    found = books.socket
    if found is not None:
        try:
            records = ask_once(found, {"op": "snapshot"})["welcome"].get("records")
        except (ServiceUnavailable, OSError) as error:
            warnings.warn(f"the machine's usage records were not read: {error}", stacklevel=2)
            records = None
        if records:
            dirs.insert(0, Path(records))
    return dirs


def usage_main(argv: list[str]) -> int:
    """``fluksio-nb usage``: claims, core-hours, card-hours, peak memory and waits, per notebook."""
    parser = argparse.ArgumentParser(
        prog="fluksio-nb usage",
        description="What past claims used, per user and notebook, like Slurm's sacct.",
    )
    parser.add_argument(
        "--since", metavar="WHEN", help="claims ended since: 2026-11-30, 2026-11-30T12:00, 24h, 7d"
    )
    parser.add_argument("--user", metavar="NAME", help="only this user's claims")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--dir",
        metavar="DIR",
        action="append",
        type=Path,
        help="read the records in DIR (repeatable); by default, your own",
    )
    options = parser.parse_args(argv)
    try:
        since = None if options.since is None else parse_since(options.since)
    except BadSince as error:
        print(f"fluksio-nb usage: {error}", file=sys.stderr)
        return 2
    rows = UsageRows()
    for directory in options.dir or usage_dirs():
        try:
            rows.absorb(read_usage(directory, since=since, user=options.user))
        except OSError as error:
            print(
                f"fluksio-nb usage: cannot read the records in {directory}: "
                f"{error.strerror or error}",
                file=sys.stderr,
            )
            return 1
    summary = summarise(rows)
    if options.json:
        report = {
            "rows": summary,
            "users": user_totals(summary),
            "skipped_files": rows.skipped_files,
            "unreadable_files": rows.unreadable_files,
            "not_plain_files": rows.not_plain_files,
            "bad_lines": rows.bad_lines,
        }
        print(json.dumps(report, indent=1))
    else:
        print(
            describe_usage(
                summary,
                rows.unreadable_files,
                not_plain=rows.not_plain_files,
                bad_lines=rows.bad_lines,
            )
        )
    return 0
