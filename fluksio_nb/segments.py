"""A big buffer in a shared-memory file of its own: made, written, and removed after a dead sender.

Big buffers travel between the kernel and its workers as files in
``/dev/shm`` (:mod:`fluksio_nb.transfer`), and a file there is the one
thing of a transfer that can outlive both processes. What is decided here
is what every such file is, whoever writes it:

- **Its name says who made it**: ``fluksio-<pid>-<random>``, so that
  :func:`sweep_orphans` can tell from the name alone whether anyone can
  still be waiting for it, and a worker removes its dead kernel's.
- **Only ever a new file of our own**: the directory is shared with every
  user, so another user's file or symlink of the same name is an error,
  never something to open, and nobody else may read ours.
- **Made and known as one step**, so that a stop landing as it is made
  never leaves a file with nobody to remove it.
- **Written with** ``write()``, a piece at a time: a full ``/dev/shm`` is
  then :class:`NoRoom`, said in words as the value is sent, rather than a
  ``SIGBUS`` at some later page, and how much is written can be told
  between the pieces (:class:`Written`).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

import psutil

from fluksio_nb.stop_button import stop_held_back

#: Where the files go: memory-backed on Linux, so a file there is shared memory.
SEGMENT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

#: ``fluksio-<pid of the creator>-<random>``: recognisable, and enough to tell
#: from the name alone whether anyone can still be waiting for the file.
SEGMENT_PREFIX = "fluksio-"
_SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)-[0-9a-f]+")

#: Slack when comparing a file's age with a process's start: psutil derives
#: start times from the boot time, which is whole seconds.
_CLOCK_SLACK_S = 2.0


@dataclass(frozen=True)
class Segment:
    """One big buffer, waiting in a shared-memory file for its receiver.

    ``kept`` files belong to the process that wrote them, which reuses them:
    a receiver maps one but never removes it. The buffer starts ``offset``
    bytes in, which is only ever non-zero for a buffer sent back.
    """

    path: str
    nbytes: int
    offset: int = 0
    kept: bool = False
    #: The bytes written to put the buffer there, where that is not all of it:
    #: a buffer sent back on the file it came on was written only where the
    #: cell changed it (:func:`~fluksio_nb.sent_back.where_received`), often nowhere.
    written: int | None = None
    #: The file is the sender's own array's memory
    #: (:mod:`~fluksio_nb.shared_in_place`), lent to this parcel alone.
    in_place: bool = False


class Written:
    """How much of a parcel's big buffers is written, told to whoever asked as it grows."""

    def __init__(self, total: int, progress: Callable[[int, int], None] | None) -> None:
        self.total, self.done, self._progress = total, 0, progress
        if progress is not None:
            progress(0, total)

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self._progress is not None:
            self._progress(self.done, self.total)


#: Big buffers are written this much at a time, so that progress can be told
#: between the pieces; big enough that the system calls do not show.
WRITE_PIECE = 32 << 20


def sweep_orphans(directory: str = SEGMENT_DIR, gone: int | None = None) -> list[str]:
    """Remove shared-memory files whose creating process is gone; return their paths.

    A live creator's files are left alone even if nobody will ever unpack
    them: it may still be sending the parcel. ``gone`` names a process the
    caller knows has died, such as a worker's kernel: its files written until
    now are removed without asking, because a process still tearing itself
    down does not look dead yet.
    """
    now = time.time()
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _SEGMENT_NAME.fullmatch(entry.name)
            if match is None:
                continue
            try:
                written = entry.stat().st_mtime
            except FileNotFoundError:
                continue
            creator = int(match[1])
            if creator == gone and written <= now:
                pass
            elif _creator_alive(creator, written):
                continue
            # Another user's file in the shared directory is not ours to remove.
            with suppress(FileNotFoundError, PermissionError):
                os.unlink(entry.path)
                removed.append(entry.path)
    return removed


def write_segment(raw: memoryview, written: Written | None = None) -> Segment:
    """A new file holding ``raw``, for its receiver to map and remove."""
    path = os.path.join(SEGMENT_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = None
    try:
        # Made and known as one step: a stop landing as the file is made
        # would otherwise leave it there, with nobody to remove it.
        with stop_held_back():
            fd = create_own_file(path)
        write_all(fd, raw, written)
    except BaseException:
        if fd is not None:
            os.close(fd)
            os.unlink(path)
        raise
    os.close(fd)
    return Segment(path, raw.nbytes)


def create_own_file(path: str) -> int:
    # Only ever a new file of our own: another user's symlink or file of the
    # same name in the shared directory is an error, never something to open.
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def write_all(fd: int, raw: memoryview, written: Written | None = None, at: int = 0) -> None:
    # write() rather than filling a mapping: a full /dev/shm is then an
    # ENOSPC here instead of a SIGBUS at some later page, and it is faster
    # (256 MiB: 91 ms, against 199 ms copying into a fresh mapping).
    try:
        done = 0
        while done < raw.nbytes:
            n = os.pwrite(fd, raw[done : done + WRITE_PIECE], at + done)
            done += n
            if written is not None:
                written.add(n)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise NoRoom(raw.nbytes) from None
        raise


class NoRoom(OSError):
    """The shared memory values travel through is full: said in words, not as ``[Errno 28]``.

    Said the same way whichever way the value was going, since the reader
    is told which name it was by whoever caught this.
    """

    def __init__(self, nbytes: int) -> None:
        try:
            stats = os.statvfs(SEGMENT_DIR)
            whole = f" ({_size(stats.f_blocks * stats.f_frsize)} in all)"
        except OSError:
            whole = ""
        super().__init__(
            errno.ENOSPC,
            f"{SEGMENT_DIR} has no room for {_size(nbytes)}{whole}, and values travel "
            f"between the kernel and its workers through it — make room there "
            f"(`df -h {SEGMENT_DIR}`), or pass this one through a file on disk",
        )

    def __str__(self) -> str:
        return str(self.strerror)


def _size(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.1f} MiB"


def _creator_alive(pid: int, written: float) -> bool:
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        # A process started after the file was last written cannot have
        # written it: the creator died and its pid was given to another.
        return process.create_time() <= written + _CLOCK_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
