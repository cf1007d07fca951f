"""A usage record, the one line a claim leaves behind when it ends, and the file it goes in.

Every claim, however it ends, leaves one record (:mod:`fluksio_nb.usage`
reads them back and adds them up). Most are written by the claim's own
kernel; a claim whose kernel was killed outright (SIGKILL, the OOM killer)
is written by the books service that saw its connection close: the
machine's, or the user's own. So the record and its file sit below the
books, which import them, rather than in :mod:`fluksio_nb.usage`, whose
report asks the books where the records are.

The writer and the reader of the records may be different versions of
fluksio_nb, run by different users, and a record outlives the kernel that
wrote it. So a record says only what happened, in plain figures: what was
granted (not what was asked), and the wall-clock times of asking, being
granted and ending. How long a claim waited or ran, and its core- and
card-hours, are worked out from those when the record is read, never
stored, so they cannot disagree with them.

What it decides:

- **One JSON object per line, in a file named ``*.jsonl``.** A line cut
  short by a crash spoils only itself.
- **Fields a record does not know are ignored**, and a field that is not
  known is left out rather than written as ``null``, so records written by
  a later version still count in an earlier one.
- **No duration is below zero**, though the wall clock may be stepped back
  between two readings.
- **What only a dead kernel knew stays unknown.** A record written for a
  killed kernel ends :data:`KERNEL_DIED`, and has no peak memory, rather
  than a peak of nothing.
- **A file of its own for each process.** Each process appends to a file it
  creates itself, so that the file's owner, which the reader counts its
  records against, is the user whose claims they are. Only a file root owns
  may say whose a record is (``uid``): the service's, which writes for
  every user.
- **Only a directory nobody else can tamper with.** Records go into a
  directory of the user's own that no one else may write to (made ``0700``
  when missing), or a root-owned shared one with the sticky bit, where
  others may add files of their own but never remove or rename ours.
  Anything else is refused with what is wrong and how to fix it
  (:class:`UsageDirRefused`). Files are created exclusively, never through
  a symbolic link, readable by their owner alone.
- **Accounting never fails a cell.** A record that cannot be written
  becomes one warning per process naming the directory and the reason
  (:class:`UsageNotRecorded`); the cell ends as it would have. Writing one
  costs one ``write`` to a file kept open, which a warm claimed cell (about
  8 ms) does not notice.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
import warnings
from pathlib import Path
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field

from fluksio_nb.identity import user_name
from fluksio_nb.vocabulary import ERROR_LINE_MOST

#: How a records file's name ends: one record per line, each a JSON object.
SUFFIX = ".jsonl"

#: How a claim ended whose kernel was killed before it could say: written by
#: the books service that saw its connection close. The claim's own worker dying, which its
#: kernel saw and recorded, is ``"died"``.
KERNEL_DIED = "kernel died"
#: How a claim ended that ran for the longest time its user may hold one on
#: the machine, as its admin set (``max_hours``): both its kernel's record and
#: the service's say so.
TIME_LIMIT: Final = "time limit"
#: How a claim ended that the machine's books service ended because its cards
#: sat idle while another claim waited for one (``idle_card_minutes`` in the
#: machine's config): written by the service and by the claim's own kernel alike.
IDLE_CARDS: Final = "idle cards"
#: The endings the books give a claim they stop for an admin's rule, which the
#: kernel's record takes as its own; any other stop is a person's cancel.
BOOKS_ENDINGS: Final = (TIME_LIMIT, IDLE_CARDS)

#: The latest wall-clock time a record (or a reading) may name: the year 2242.
#: A later one, or 1e300, is no time anyone's clock or report can show.
LATEST_TIME = float(1 << 33)
#: The most bytes a figure may say: 4 EiB, more than any machine has.
MOST_BYTES = 1 << 62
#: The most cores or cards a claim may have held: the books service's own limits.
MOST_CPUS = 1 << 20
MOST_GPUS = 1 << 12

# Each figure in range, so that what a report adds up from any number of
# records stays finite: a record is a user's word, and 10**400 cores, or a
# claim that ran since 1e300, is a line to skip, not a report to crash.
_Time = Annotated[float, Field(ge=0, le=LATEST_TIME, allow_inf_nan=False)]
_Bytes = Annotated[int, Field(ge=0, le=MOST_BYTES)]


class UsageRecord(BaseModel):
    """One claim, as it ended: what it held, and when it asked, got and gave back its share."""

    model_config = ConfigDict(extra="ignore")

    label: str
    notebook: str | None = None
    #: The claim's number in the books it queued in; ``None`` in records written
    #: before it was kept. Numbers restart with new books: an id, not a key.
    ticket: Annotated[int, Field(ge=0, le=1 << 62)] | None = None
    #: Granted, not asked: 0 for a claim that never got its share.
    cpus: Annotated[int, Field(ge=0, le=MOST_CPUS)] = 0
    #: The card ids granted.
    gpus: list[Annotated[int, Field(ge=0, le=MOST_GPUS)]] = Field(
        default_factory=list, max_length=MOST_GPUS
    )
    ram_bytes: _Bytes = 0
    #: ``time.time()`` when the claim joined the queue.
    asked_at: _Time
    granted_at: _Time | None = None
    ended_at: _Time
    ending: str
    #: The most memory its processes held; ``None`` where nobody alive knew it
    #: (:data:`KERNEL_DIED`), which is not zero.
    peak_rss_bytes: _Bytes | None = None
    #: The most card memory its processes held, on all its cards; ``None`` where
    #: the cards were not read (or it had none), which is not zero.
    peak_gpu_bytes: _Bytes | None = None
    #: Whose claim it was, by uid, as the machine's books service knew it
    #: (``SO_PEERCRED``). Written only by the service, which writes for every
    #: user into a file of root's; believed only in a file root owns.
    uid: Annotated[int, Field(ge=0, le=(1 << 32) - 1)] | None = None
    #: Written by the books service, which saw the claim itself: who, what it
    #: granted, and when (:mod:`fluksio_nb.machine.accounts`). Believed only
    #: in a file root owns; root's report counts claims from these.
    by_service: bool | None = None
    #: The times the claim's own kernel said in its cell's record, figured once
    #: there from its status (:mod:`fluksio_nb.vocabulary`): every view of the
    #: finished claim says these. ``None`` in the service's records and older ones.
    waited_for_s: Annotated[float, Field(ge=0, le=LATEST_TIME, allow_inf_nan=False)] | None = None
    ran_for_s: Annotated[float, Field(ge=0, le=LATEST_TIME, allow_inf_nan=False)] | None = None
    #: Why it failed, in one line (``ValueError: the model diverged``); ``None``
    #: when it ended well. Only in the user's own records, read by them alone.
    error: Annotated[str, Field(max_length=ERROR_LINE_MOST)] | None = None

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


def open_records_directory(directory: Path) -> int:
    """A descriptor of the machine's records directory, refused as :class:`UsageLog` refuses it."""
    return _open_directory(directory, create=False)


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
        self._in_this_process()
        with self._lock:
            self._file()
            assert self.path is not None
            return self.path

    def write(self, record: UsageRecord) -> None:
        """Append one record. Never raises: a failure is one warning per process."""
        try:
            # Unknown left out, not null: an earlier reader refuses a null
            # where it wants a number, and takes a missing field's default.
            line = (record.model_dump_json(exclude_none=True) + "\n").encode()
            self._in_this_process()
            with self._lock:
                fd = self._file()
                while line:
                    line = line[os.write(fd, line) :]
        except Exception as error:
            self._warn(error)

    def close(self) -> None:
        self._in_this_process()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _in_this_process(self) -> None:
        # Not a context manager around the lock: one made of a generator holds
        # the lock from its yield, and a stop landing as its __enter__ returns
        # would leave it held, and every later record waiting for it.
        if self._pid != os.getpid():
            # A child of fork: the lock may have been held by a thread that does
            # not exist here, and the file is the parent's. Records written
            # there would be the parent's in the report; the child starts its own.
            self._lock = threading.Lock()
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            self._fd, self.path, self._pid = None, None, os.getpid()

    def _file(self) -> int:
        if self._fd is not None:
            if os.fstat(self._fd).st_nlink:
                return self._fd
            # Deleted from under us: records appended to it now would be read by nobody.
            os.close(self._fd)
            self._fd = None
        directory = _open_directory(self.directory, self.create)
        try:
            name = f"{os.geteuid()}-{os.getpid()}-{secrets.token_hex(8)}{SUFFIX}"
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


_logs_lock = threading.Lock()
_logs: dict[tuple[Path, bool], UsageLog] = {}


def process_log(directory: Path, *, create: bool) -> UsageLog:
    """This process's one log in ``directory``: its own claims' records, and the dead's."""
    key = (Path(directory), create)
    with _logs_lock:
        found = _logs.get(key)
        if found is None:
            found = _logs[key] = UsageLog(key[0], create=create)
        return found
