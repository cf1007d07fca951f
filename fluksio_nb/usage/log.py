"""Writing usage records: each process appends its claims' records to a file of its own.

A record is written as a claim ends, from inside the cell's kernel, into a
directory that may be shared by every user of the machine. It must not cost
the cell anything, must not fail it, and must not give anyone else a way to
remove, replace or forge it.

What it decides:

- **A file of its own for each process.** Each process appends to a file it
  creates itself, so that the file's owner, which the reader counts its
  records against (:mod:`fluksio_nb.usage.read`), is the user whose claims
  they are.
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
from typing import Any

from fluksio_nb.identity import user_name
from fluksio_nb.usage.record import SUFFIX, UsageRecord


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
