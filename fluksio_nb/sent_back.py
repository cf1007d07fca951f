"""A cell's inputs sent back on the files they came on: not at all if unchanged, else by reference.

A worker maps the files of a cell's inputs copy-on-write
(``unpack(..., remember=True)``, :mod:`fluksio_nb.transfer`): a page the
cell writes becomes its own, the sender's file keeps what was sent, and
which pages the cell wrote is the OS's to tell
(:func:`~fluksio_nb.written_pages.changed_runs`). The files of the parcel
last unpacked so are remembered here, and what is decided is:

- **An input the cell did not change does not go back at all**
  (:func:`lies_unwritten_on`): it still lies where it arrived, whole, with no
  page of it written since, which is known for the price of reading its page
  table.
- **A value that comes back on the memory it was sent on goes back as a
  reference** (:func:`where_received`): ``b = a``, or ``a *= 2`` then sending
  ``a`` back, costs only the pages the cell changed, written into the
  sender's kept file, and the kernel reads them there: on its own array,
  where it was moved onto the file, or on a mapping of the file.
- **Only whole buffers, or most of one, go back this way**
  (:data:`REFER_BACK_SHARE`): a small slice would keep a big file alive, and
  is copied as any other.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from dataclasses import dataclass

from fluksio_nb.segments import Segment, write_all
from fluksio_nb.written_pages import changed_runs

#: A buffer goes back as a reference only if it covers at least this share of
#: the file it lies in; a smaller slice is cheaper to copy than to pin the file.
REFER_BACK_SHARE = 0.5


@dataclass(frozen=True)
class _Received:
    """A file of the parcel last unpacked with ``remember``, mapped copy-on-write here."""

    mapping: weakref.ref
    #: Where the mapping starts in this process's memory; ``None`` if unknown.
    base: int | None
    segment: Segment

    @property
    def length(self) -> int:
        """The mapping's length: from the file's start to the buffer's end."""
        return self.segment.offset + self.segment.nbytes

    def holds(self, start: int, nbytes: int) -> bool:
        """Whether the bytes from ``start`` lie wholly on this mapping, while it lasts."""
        if self.base is None or self.mapping() is None:
            return False
        return self.base <= start and start + nbytes <= self.base + self.length


#: The files of the parcel last unpacked with ``remember``.
_received: list[_Received] = []


def remember(mapping: mmap.mmap, segment: Segment) -> None:
    """Note a file of the parcel being unpacked with ``remember``, mapped here as ``mapping``."""
    _received.append(_Received(weakref.ref(mapping), address_of(memoryview(mapping)), segment))


def forget() -> None:
    """Forget the files of the parcel unpacked before: only the last one's are sent back on."""
    _received.clear()


def address_of(view: memoryview) -> int | None:
    """Where a buffer starts in this process's memory; ``None`` if read-only."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:
        return None


def lies_unwritten_on(raw: memoryview, segment: Segment) -> bool:
    """Whether ``raw`` is where ``segment`` arrived, whole, with no page of it written since."""
    start = address_of(raw)
    if start is None or raw.nbytes != segment.nbytes:
        return False
    for received in _received:
        if received.segment.path == segment.path:
            offset = received.segment.offset
            return (
                received.holds(start, raw.nbytes)
                and start - received.base == offset  # type: ignore[operator]
                and changed_runs(start, raw.nbytes) == []
            )
    return False


def where_received(raw: memoryview) -> Segment | None:
    """The kept file ``raw`` lies in, as a reference to send back, if it does.

    The file is brought up to date first: the pages the cell wrote on its
    copy-on-write mapping are written into it, and only those, then given
    back, so the mapping reads the file again and nothing is written twice.
    Where that cannot be done (the pages cannot be read, the sender has gone)
    the buffer is copied as any other.
    """
    start = address_of(raw) if _received else None
    if start is None:
        return None
    for received in _received:
        segment = received.segment
        if not (segment.kept and received.holds(start, raw.nbytes)):
            continue
        if raw.nbytes < REFER_BACK_SHARE * segment.nbytes:
            return None
        written = _write_changes_into_the_file(received)
        if written is None:
            return None
        offset = start - received.base  # type: ignore[operator]
        return Segment(segment.path, raw.nbytes, offset, kept=True, written=written)
    return None


def _write_changes_into_the_file(received: _Received) -> int | None:
    """Write the pages changed on ``received``'s mapping into its file; the bytes written."""
    mapping, base = received.mapping(), received.base
    if mapping is None or base is None:
        return None
    runs = changed_runs(base, received.length)
    if runs is None:
        return None
    if not runs:
        return 0
    try:
        fd = os.open(received.segment.path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return None
    written = 0
    try:
        view = memoryview(mapping)
        for address, length in runs:
            offset = address - base
            write_all(fd, view[offset : offset + length], at=offset)
            written += length
            # The mapping's own copies go: it reads the file again, which now
            # says the same, and the next look finds nothing changed.
            mapping.madvise(mmap.MADV_DONTNEED, offset, length)
        view.release()
    finally:
        os.close(fd)
    return written
