"""Kept files: the shared-memory files a process sends, written again for its next parcel.

Most of a new file's cost is the kernel finding and clearing fresh pages, not
the copy into them: 256 MiB into a new file took 83–100 ms, about what
``arr.copy()`` takes. A notebook sends the same arrays to cell after cell,
and a cell run again sends back values of the same size, so a process that
packs with ``reuse=True`` (:func:`fluksio_nb.transfer.pack`) keeps the files
it sends on a shelf, and writes the next buffer of the same size into one
of them, whose pages are already there: a copy at memory speed. What is
decided here:

- **A file is written again only once nobody maps it.** A receiver holds a
  shared ``flock`` on a kept file for as long as anything is mapped on it
  (the lock belongs to the mapping's own descriptor, so it goes when the
  last array on it does, or when the process dies); the shelf reuses a file
  only if it can lock it exclusively. A held file is not idle: its memory
  is the receiver's arrays.
- **Kept files are few and short-lived** (:data:`SHELF_BYTES`,
  :data:`SHELF_FILES`, :data:`SHELF_IDLE_S`): shared memory is everyone's.
- **They have no name anywhere**, so they go with the last process holding
  them, however it ends. An anonymous ``memfd`` by default, which receivers
  open through ``/proc/<pid>/fd/<n>``; for a worker's, a file made in
  :data:`~fluksio_nb.segments.SEGMENT_DIR` and unlinked before a byte is
  written, which takes its room there, so a value too big for it still fails
  by name (:class:`~fluksio_nb.segments.NoRoom`), once the idle kept files
  have been given up for it.
- **A worker's are written with** ``write()``, never mapped in the worker
  (``unmapped``), so they do not count in its resident memory, which a
  sampler holds to the claim's budget. A cell run again writes its new value
  into a second set while the kernel still holds the last one, and the run
  after that into the first, warm.

Measured with 256 MiB into a claimed cell and back (``b = a``): 200 ms with
two new files, about 35 ms once warm. 800 MB made in a claimed cell: written
into a new file in 590-650 ms, into a warm one in 180-240 ms (a copy into a
warm mapping takes about 110 ms, but would count in the worker's memory).
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import secrets
import threading
import time
from contextlib import suppress
from dataclasses import dataclass

from fluksio_nb.segments import (
    SEGMENT_DIR,
    SEGMENT_PREFIX,
    WRITE_PIECE,
    NoRoom,
    Segment,
    Written,
    create_own_file,
    write_all,
    write_segment,
)
from fluksio_nb.stop_button import stop_held_back

#: At most this much kept on the shelf while idle: enough for a couple of big
#: arrays sent cell after cell, little next to what they take in the kernel.
SHELF_BYTES = 1 << 30

#: At most this many kept files, held by receivers or not: each is a
#: descriptor in this process.
SHELF_FILES = 256

#: An idle kept file goes after this long: a notebook sending the same array
#: again does so within seconds (Run All, a loop of claimed cells); one that
#: stopped gives the machine its memory back while a person is still reading
#: the result. Shared memory is everyone's: 3 kernels each keeping 1.2 GB
#: idle for a minute, as they did with a minute here, was 3.6 GB nobody used.
SHELF_IDLE_S = 5.0


@dataclass
class _Kept:
    fd: int
    nbytes: int
    lent: bool
    since: float
    #: Made at the first reuse, and kept: copying into a mapping whose pages
    #: are already in place runs at memory speed (256 MiB: 24 ms, against 59 ms
    #: for write() into the same warm file).
    mapping: mmap.mmap | None = None


class _Shelf:
    """This process's kept files: written again once nobody maps them, removed when idle.

    A file a receiver still holds is not idle: its memory is the receiver's
    arrays, not memory kept for nothing, so it counts against neither
    :data:`SHELF_BYTES` nor :data:`SHELF_IDLE_S` until the receiver lets go.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, _Kept] = {}
        self._timer: threading.Timer | None = None

    def write(
        self,
        raw: memoryview,
        *,
        unmapped: bool = False,
        in_segment_dir: bool = False,
        written: Written | None = None,
    ) -> Segment:
        path = None
        try:
            with self._lock:
                path = self._free_of_size(raw.nbytes)
                if path is not None:
                    self._files[path].lent = True
        except BaseException:
            # Stopped as it was taken off the shelf: back on it.
            if path is not None:
                self.give_back(path)
            raise
        if path is None:
            path, fd = self._new_file(raw, in_segment_dir, written)
            try:
                with self._lock:
                    self._files[path] = _Kept(fd, raw.nbytes, True, time.monotonic())
                    self._trim(time.monotonic())
            except BaseException:
                # Stopped as it was shelved, lent to nobody: it goes.
                with self._lock:
                    if path in self._files:
                        self._drop(path)
                    else:
                        os.close(fd)
                raise
            return Segment(path, raw.nbytes, kept=True)
        kept = self._files[path]
        try:
            if unmapped:
                # Into pages the file already has: 8 MB took 1.0 ms, against
                # 2.2 ms into a new file (0.6 ms through a warm mapping); 800 MB
                # 200-240 ms, against 600 ms.
                write_all(kept.fd, raw, written)
                return Segment(path, raw.nbytes, kept=True)
            if kept.mapping is None:
                # Populated in one go: faulting 65,536 pages in one by one on
                # the first copy took longer than the copy.
                kept.mapping = mmap.mmap(
                    kept.fd,
                    kept.nbytes,
                    flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                    prot=mmap.PROT_READ | mmap.PROT_WRITE,
                )
            for start in range(0, raw.nbytes, WRITE_PIECE):
                piece = raw[start : start + WRITE_PIECE]
                kept.mapping[start : start + piece.nbytes] = piece
                if written is not None:
                    written.add(piece.nbytes)
        except BaseException:
            self.give_back(path)
            raise
        return Segment(path, raw.nbytes, kept=True)

    def _new_file(
        self, raw: memoryview, in_segment_dir: bool, written: Written | None
    ) -> tuple[str, int]:
        before = None if written is None else written.done
        try:
            return _new_kept_file(raw, in_segment_dir, written)
        except NoRoom:
            # Files kept idle take room in the same place: given up, before
            # the value is.
            with self._lock:
                idle = [path for path, kept in self._files.items() if not kept.lent]
                for path in idle:
                    self._drop(path)
            if not idle:
                raise
        if written is not None and before is not None:
            written.done = before  # this one is counted again from its start
        return _new_kept_file(raw, in_segment_dir, written)

    def give_back(self, path: str) -> None:
        with self._lock:
            kept = self._files.get(path)
            if kept is None or not kept.lent:
                return
            kept.lent, kept.since = False, time.monotonic()
            self._trim(time.monotonic())
            if self._timer is None:
                self._expire_in_time()

    def clear(self) -> None:
        """Remove every kept file; mappings of them stay valid until they go."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for path in list(self._files):
                self._drop(path)

    def _free_of_size(self, nbytes: int) -> str | None:
        for path, kept in list(self._files.items()):
            if kept.lent or kept.nbytes != nbytes:
                continue
            if not _still_there(path, kept.fd):
                self._drop(path)  # removed behind our back: receivers could not open it
                continue
            if _held(kept.fd):
                continue  # somebody still has arrays on it
            return path
        return None

    def _trim(self, now: float) -> None:
        idle = []
        for path, kept in self._files.items():
            if kept.lent:
                continue
            if _held(kept.fd):
                kept.since = now  # idle from when the receiver lets go
                continue
            idle.append((kept.since, path))
        idle.sort()
        total = sum(self._files[path].nbytes for _, path in idle)
        for since, path in idle:
            if total <= SHELF_BYTES and now - since < SHELF_IDLE_S:
                continue
            total -= self._files[path].nbytes
            self._drop(path)
        # Each kept file is a descriptor here, and a receiver holding
        # thousands of small arrays must not run this process out of them:
        # past the limit, the oldest are let go (a receiver's mapping keeps
        # the memory, not our descriptor).
        spare = sorted((kept.since, path) for path, kept in self._files.items() if not kept.lent)
        for _, path in spare[: max(0, len(self._files) - SHELF_FILES)]:
            self._drop(path)

    def _drop(self, path: str) -> None:
        kept = self._files.pop(path)
        if kept.mapping is not None:
            kept.mapping.close()
        os.close(kept.fd)
        if not path.startswith("/proc/"):
            with suppress(FileNotFoundError):
                os.unlink(path)

    def _expire(self) -> None:
        with self._lock:
            self._timer = None
            self._trim(time.monotonic())
            self._expire_in_time()

    def _expire_in_time(self) -> None:
        """Look again when the first idle file is due to go, not a whole idle time later.

        With the lock held. A file a receiver still holds is looked at again
        then too: nothing says when the receiver lets go.
        """
        idle = [kept.since for kept in self._files.values() if not kept.lent]
        if not idle:
            return
        due = max(0.05, min(idle) + SHELF_IDLE_S - time.monotonic())
        self._timer = threading.Timer(due, self._expire)
        self._timer.daemon = True
        self._timer.start()


def _held(fd: int) -> bool:
    """Whether a receiver has arrays on the kept file: it holds a shared lock for as long."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _new_kept_file(
    raw: memoryview, in_segment_dir: bool = False, written: Written | None = None
) -> tuple[str, int]:
    """A new file holding ``raw``, to keep: its path for receivers, and our descriptor.

    Nameless, and opened by receivers through ``/proc/<pid>/fd/<n>``: with no
    name to remove, however this process ends, even killed, the memory goes
    with the last mapping of it. An anonymous ``memfd`` by default; with
    ``in_segment_dir``, a file made in :data:`SEGMENT_DIR` and unlinked before
    a byte is written, which takes its room there like any segment, so that a
    full one is a :class:`NoRoom` rather than memory taken from wherever.
    Where there is no ``/proc``, a named file, which
    :func:`~fluksio_nb.segments.sweep_orphans` removes after a kill.
    """
    pid = os.getpid()
    if not hasattr(os, "memfd_create") or not os.path.isdir(f"/proc/{pid}/fd"):
        segment = write_segment(raw, written)
        return segment.path, os.open(segment.path, os.O_RDWR | os.O_NOFOLLOW)
    fd = None
    try:
        # Made, unnamed and known as one step, so that a stop landing on the
        # way leaves neither a name in the directory nor a descriptor.
        with stop_held_back():
            if in_segment_dir:
                path = os.path.join(SEGMENT_DIR, f"{SEGMENT_PREFIX}{pid}-{secrets.token_hex(8)}")
                fd = create_own_file(path)
                os.unlink(path)
            else:
                fd = os.memfd_create(f"{SEGMENT_PREFIX}{pid}-kept", os.MFD_CLOEXEC)
        write_all(fd, raw, written)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return f"/proc/{pid}/fd/{fd}", fd


def _still_there(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


_shelf = _Shelf()
atexit.register(_shelf.clear)


def write(
    raw: memoryview,
    *,
    unmapped: bool = False,
    in_segment_dir: bool = False,
    written: Written | None = None,
) -> Segment:
    """``raw`` in a kept file, a warm one of its size where one is free; lent until given back."""
    return _shelf.write(raw, unmapped=unmapped, in_segment_dir=in_segment_dir, written=written)


def give_back(path: str) -> None:
    """Put a lent kept file back on the shelf, to be written again once nobody maps it."""
    _shelf.give_back(path)


def clear_shelf() -> None:
    """Remove every file this process keeps for reuse; arrays mapped on them stay valid."""
    _shelf.clear()
