"""The kernel's big arrays, moved onto shared memory where they lie: sent again for free.

A notebook sends the same big input to cell after cell. The kernel's array
lives in its private memory, which no other process can map, so every
claimed cell copied it into a shared-memory file first: for 512 MB, a copy at
memory speed each cell, and for as long as the file was kept, the value
twice over in the machine's memory.

So the first time a big array is sent, its pages are moved onto a
shared-memory file in place. The file gets a copy of the array's memory, and
is then mapped copy-on-write over the array's own address range
(``MAP_FIXED``): the array is the same object, at the same address, with the
same bytes, and its memory is now the file's. The private pages are given
back as the file takes over, so the value takes its size once, not twice.
From then on:

- **Sending it is a reference to the file**, as long as the kernel has not
  written to the array since: a page the kernel writes becomes its own again
  (copy on write), which the OS tells
  (:func:`~fluksio_nb.written_pages.changed_runs`).
  Only those pages are written into the file before the next send, and
  mapped from the file again.
- **A change a worker makes in place and sends back is in the kernel's array
  already**: the worker writes the pages it changed into the file
  (:func:`fluksio_nb.sent_back.where_received`), and the kernel's array, whose
  pages are the file's, reads them. Nothing is copied back.
- **One receiver at a time**: the file is lent to one parcel at a time and
  written only when no worker maps it (each holds a shared ``flock`` for as
  long as it does). A second cell sending the same array meanwhile, a
  background one say, gets a copy, as before.

Where it is not done, the array is copied as before. It is done only where
what lies under the array is known:

- glibc's ``malloc`` under numpy's default allocator: an array of
  :data:`MOVE_FROM` or more is then the only thing in a mapping of its own
  (glibc's largest threshold for mapping a chunk alone is 32 MiB). The chunk's
  header says so (``IS_MMAPPED``), and ``/proc/self/maps`` must show an
  anonymous private mapping over the whole of it; else nothing is touched.
- The file is far larger than the chunk, and sparse: ``ndarray.resize`` grows
  a mapped chunk with ``mremap``, which past the end of a file would be a
  ``SIGBUS`` at the next touch; inside it, it is more pages of the array's own.
- When the array is freed, ``free`` unmaps its chunk, file mapping and all,
  and the descriptor kept here is closed at the next look, within
  :data:`LOOK_AGAIN_S`: the file goes with them. Nothing here holds the array
  but a parcel it is lent to, and no weak reference is taken to it either:
  numpy refuses to ``resize`` an array that has one.
- A ``fork`` of the kernel sees a copy-on-write mapping, as it saw private
  memory: a child's writes stay its own.

The copy and the remapping run holding the GIL (through ``ctypes.PyDLL``), so
no Python thread can write to the array in between; C code writing to it
from a thread of its own in that instant would lose the write, which is the
one risk taken, for a kernel whose main thread is in the claim's magic.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import mmap
import os
import re
import sys
import threading
from dataclasses import dataclass

from fluksio_nb.written_pages import changed_runs

#: Arrays this big and over are moved: glibc maps every chunk of 32 MiB or
#: more alone, whatever its dynamic threshold has grown to.
MOVE_FROM = 32 << 20

#: Moved only when the buffer sent is at least this share of the array's
#: memory: moving a 10 GB array to send a few rows of it would copy 10 GB.
MOVE_SHARE = 0.5

#: The file's size: room for ``mremap`` to grow the array into (see above);
#: a sparse file takes memory only for pages written.
_FILE_BYTES = 1 << 40

#: How often files whose arrays may be gone are looked at, while there are any.
LOOK_AGAIN_S = 5.0

_PAGE = mmap.PAGESIZE
_IS_MMAPPED = 0x2
_SIZE_BITS = ~0x7

#: C calls that hold the GIL while they run: a Python thread cannot write to
#: the array between its copy and its remapping.
_libc = ctypes.PyDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.pwrite.restype = ctypes.c_ssize_t
_libc.pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass
class _Moved:
    """An array whose memory is a file's now: where, and the file."""

    #: The mapping that is the array's chunk: where it starts and how long it is.
    start: int
    length: int
    #: Where the array's data starts: how a later send knows it.
    data: int
    fd: int
    inode: int
    #: The file's name, one of its own in this process: what
    #: ``/proc/self/map_files`` names the mapping by while it is whole.
    name: str
    #: The array, while a parcel is lent the file (at most one, see above):
    #: what a value sent back on it is rebuilt on.
    lent_to: object | None = None

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"


#: By the path receivers open.
_moved: dict[str, _Moved] = {}
_names = itertools.count()
_lock = threading.Lock()
_timer: threading.Timer | None = None


@dataclass(frozen=True)
class Shared:
    """A buffer as a reference to the file under it: what a parcel sends."""

    path: str
    #: Where the buffer starts in the file.
    offset: int
    #: The bytes copied into the file to send it: all of it the first time,
    #: what the kernel changed since after that, often nothing.
    written: int


def share(raw: memoryview, address: int) -> Shared | None:
    """``raw``, at ``address`` in memory, as a reference to a file under it; ``None`` to copy it.

    Lends the file until :func:`give_back`.
    """
    owner = _owner_of(raw)
    if owner is None:
        return None
    data = owner.__array_interface__["data"][0]  # type: ignore[attr-defined]
    if not (data <= address and address + raw.nbytes <= data + owner.nbytes):  # type: ignore[attr-defined]
        return None
    with _lock:
        _forget_the_gone()
        moved = next((moved for moved in _moved.values() if moved.data == data), None)
        if moved is None:
            if raw.nbytes < MOVE_SHARE * owner.nbytes or not _known_allocator(owner):  # type: ignore[attr-defined]
                return None
            moved = _move(owner, data)
            if moved is None:
                return None
            written = moved.length
        else:
            if moved.lent_to is not None:
                return None
            written = _bring_up_to_date(moved)
            if written is None:
                return None
        moved.lent_to = owner
        _look_again_later()
        return Shared(moved.path, address - moved.start, written)


def give_back(path: str) -> None:
    """The parcel that was lent the file at ``path`` is done with it."""
    with _lock:
        moved = _moved.get(path)
        if moved is not None:
            moved.lent_to = None


def view_of(path: str, offset: int, nbytes: int) -> memoryview | None:
    """``nbytes`` at ``offset`` in a moved file, as a view of the array that owns them.

    What a value sent back on the file is rebuilt on: ``b = data`` in a
    claimed cell is then a view of the kernel's ``data``, as it would be an
    alias of it in a normal cell, rather than a second mapping of the file,
    which a later writing of the file would change behind its back.
    ``None`` for a path that is not a moved file of this process's lent now.
    """
    with _lock:
        moved = _moved.get(path)
        owner = None if moved is None else moved.lent_to
    if moved is None or owner is None:
        return None
    numpy = sys.modules["numpy"]
    if not (owner.flags.c_contiguous or owner.flags.f_contiguous):  # type: ignore[attr-defined]
        return None
    start = offset - (moved.data - moved.start)
    if start < 0 or start + nbytes > owner.nbytes:  # type: ignore[attr-defined]
        return None
    flat = owner.reshape(-1, order="A").view(numpy.uint8)  # type: ignore[attr-defined]
    return memoryview(flat)[start : start + nbytes]


def _owner_of(raw: memoryview) -> object | None:
    """The numpy array owning ``raw``'s memory, if it is one worth moving."""
    numpy = sys.modules.get("numpy")
    exporter = raw.obj
    if numpy is None or not isinstance(exporter, numpy.ndarray):
        return None
    owner = exporter
    while not owner.flags.owndata:
        owner = owner.base
        if not isinstance(owner, numpy.ndarray):
            return None
    if type(owner) is not numpy.ndarray or owner.nbytes < MOVE_FROM:
        return None
    return owner


def _known_allocator(owner: object) -> bool:
    """glibc's malloc, through numpy's default allocator: what lies under the array is known."""
    if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
        return False
    numpy = sys.modules["numpy"]
    core = getattr(numpy, "_core", None) or numpy.core
    try:
        return core.multiarray.get_handler_name(owner) == "default_allocator"
    except (AttributeError, TypeError):
        return False


def _move(owner: object, data: int) -> _Moved | None:
    """Copy the array's chunk into a new file and map the file over it."""
    start, length = _chunk(data, owner.nbytes)  # type: ignore[attr-defined]
    if length == 0:
        return None
    name = f"fluksio-{os.getpid()}-own-{next(_names)}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, _FILE_BYTES)
        if not _copy_into(fd, start, length, 0):
            raise OSError("the array could not be written into its file")
        _map_over(fd, start, length, 0)
    except OSError:
        os.close(fd)
        return None
    moved = _Moved(start, length, data, fd, os.fstat(fd).st_ino, name)
    _moved[moved.path] = moved
    return moved


def _bring_up_to_date(moved: _Moved) -> int | None:
    """Write the pages the kernel changed since into the file; the bytes written, or ``None``.

    ``None`` where it cannot tell which changed, or a worker still maps the file.
    """
    runs = changed_runs(moved.start, moved.length)
    if runs is None:
        return None
    if not runs:
        return 0
    try:
        fcntl.flock(moved.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    try:
        written = 0
        for address, length in runs:
            offset = address - moved.start
            if not _copy_into(moved.fd, address, length, offset):
                return None
            _map_over(moved.fd, address, length, offset)
            written += length
        return written
    finally:
        fcntl.flock(moved.fd, fcntl.LOCK_UN)


def _chunk(data: int, nbytes: int) -> tuple[int, int]:
    """The mapping glibc made for the chunk at ``data``, as (start, length); length 0 if not one."""
    size_field = ctypes.c_size_t.from_address(data - ctypes.sizeof(ctypes.c_size_t)).value
    if not size_field & _IS_MMAPPED:
        return 0, 0
    before = ctypes.c_size_t.from_address(data - 2 * ctypes.sizeof(ctypes.c_size_t)).value
    start = data - 2 * ctypes.sizeof(ctypes.c_size_t) - before
    length = (size_field & _SIZE_BITS) + before
    if start % _PAGE or length % _PAGE or data + nbytes > start + length:
        return 0, 0
    if not _anonymous_and_private(start, length):
        return 0, 0
    return start, length


_MAPS_LINE = re.compile(r"([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+)\s*(.*)")


def _anonymous_and_private(start: int, length: int) -> bool:
    """Whether every byte of the range lies in anonymous, private, writable mappings."""
    covered = start
    end = start + length
    with open("/proc/self/maps") as maps:
        for line in maps:
            match = _MAPS_LINE.match(line)
            if match is None:
                continue
            low, high = int(match[1], 16), int(match[2], 16)
            if high <= covered or low > covered:
                continue
            if match[3] != "rw-p" or match[4] != "0" or match[5]:
                return False
            covered = high
            if covered >= end:
                return True
    return False


def _copy_into(fd: int, address: int, length: int, offset: int) -> bool:
    done = 0
    while done < length:
        n = _libc.pwrite(fd, address + done, length - done, offset + done)
        if n <= 0:
            return False
        done += n
    return True


def _map_over(fd: int, address: int, length: int, offset: int) -> None:
    got = _libc.mmap(
        address,
        length,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_PRIVATE | 0x10,  # MAP_FIXED: replace what is there, atomically
        fd,
        offset,
    )
    if got == _MAP_FAILED or got != address:
        raise OSError(ctypes.get_errno(), "mapping the file over the array failed")


def _forget_the_gone() -> None:
    """Close the files whose arrays are gone: freed (unmapped), or resized away from them.

    Every send asks, so the cheap question comes first: a mapping still whole
    is named by its exact bounds in ``/proc/self/map_files`` (a microsecond).
    Only a file whose mapping is not, split by :func:`_bring_up_to_date` or
    gone, is looked for in ``/proc/self/maps``, which a kernel's hundreds of
    mappings make cost 0.1–0.5 ms.
    """
    unsure = [moved for moved in _moved.values() if moved.lent_to is None and not _whole(moved)]
    if not unsure:
        return
    mapped = _mapped_starts()
    for moved in unsure:
        if mapped.get(moved.start) != (moved.inode, moved.length):
            del _moved[moved.path]
            with contextlib.suppress(OSError):
                os.close(moved.fd)


def _whole(moved: _Moved) -> bool:
    """Whether one mapping of ``moved``'s file covers exactly its array's chunk."""
    bounds = f"{moved.start:x}-{moved.start + moved.length:x}"
    try:
        return os.readlink(f"/proc/self/map_files/{bounds}") == f"/memfd:{moved.name} (deleted)"
    except OSError:
        return False


def _mapped_starts() -> dict[int, tuple[int, int]]:
    """For each mapping of a file of ours: where it starts, the file's inode and its length.

    Adjacent pieces of one mapping (a page run mapped again by
    :func:`_bring_up_to_date` splits it) are joined while they go on in the
    file. Only the lines that name a file of ours are parsed: a kernel has
    hundreds of mappings, and every send reads them (0.1 ms, against 1.1 ms
    parsing each line).
    """
    with open("/proc/self/maps", "rb") as maps:
        text = maps.read()
    found: dict[int, tuple[int, int]] = {}
    first: tuple[int, int, int, int] | None = None  # start, end, inode, file offset at start
    at = text.find(_OURS)
    while at != -1:
        line_start = text.rfind(b"\n", 0, at) + 1
        fields = text[line_start:at].split()
        low, high = (int(bound, 16) for bound in fields[0].split(b"-"))
        offset, inode = int(fields[2], 16), int(fields[4])
        goes_on = first is not None and (first[1], first[2]) == (low, inode)
        if goes_on and first[3] + (low - first[0]) == offset:  # type: ignore[index]
            found[first[0]] = (inode, high - first[0])  # type: ignore[index]
            first = (first[0], high, inode, first[3])  # type: ignore[index]
            at = text.find(_OURS, at + 1)
            continue
        first = (low, high, inode, offset)
        found[low] = (inode, high - low)
        at = text.find(_OURS, at + 1)
    return found


#: How our files are named in ``/proc/self/maps``.
_OURS = b"/memfd:fluksio-"


def _look_again_later() -> None:
    """Close the files of arrays freed meanwhile, at the latest :data:`LOOK_AGAIN_S` on."""
    global _timer
    if _timer is None:
        _timer = threading.Timer(LOOK_AGAIN_S, _look_again)
        _timer.daemon = True
        _timer.start()


def _look_again() -> None:
    global _timer
    with _lock:
        _timer = None
        _forget_the_gone()
        if _moved:
            _look_again_later()
