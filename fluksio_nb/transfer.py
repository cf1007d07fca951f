"""Moving a cell's variables between the kernel and its worker on one machine.

Every name is pickled on its own, with cloudpickle. One value that cannot
travel — a lock, an open connection, an instance of a class the other side
cannot import — is then reported by name with the reason, and every other
name still arrives. The price is identity: two names for one list arrive as
two lists. cloudpickle is what lets the notebook's own functions and classes
(defined in ``__main__``) go by value while installed modules go by reference
and are imported again on the other side; where they land, they are bound to
the namespace they land in (:mod:`fluksio_nb.namespaces`).

Big buffers do not go through the pickle stream. Pickle protocol 5 hands them
out of band, and each one above :data:`INLINE_LIMIT` is copied once into a
file in ``/dev/shm``. The receiver maps the file and unpickles straight onto
the mapping, so a numpy array arrives writable and backed by that mapping,
with no copy on the receiving side at all. Below the limit a buffer stays in
the stream: for a few tens of kilobytes, a file, a mapping and their system
calls cost more than the copies.

The files are the one thing here that can outlive both processes, so every way
out removes them. :func:`unpack` unlinks each file as soon as it is mapped —
from then on the memory lives exactly as long as the arrays on it — unless
its sender keeps it (below). :meth:`Parcel.discard` removes the files of a
parcel that will never be unpacked. A sender that died between writing and
the receiver mapping is covered by the file name, which records the
creating process: :func:`sweep_orphans` removes the files whose creator is
gone, and a worker runs it when its kernel dies.

Measured with a 256 MiB float64 array on a 2-core machine, against 79–82 ms
for ``arr.copy()``: packing into a new file takes 83–100 ms, its one copy;
unpacking 0.1 ms, plus 11 ms of page faults the first time the array is
touched. Most of a new file's cost is the kernel finding and clearing 65,536
fresh pages, not the copy.

What takes that cost away for a notebook that sends the same arrays to
cell after cell, which is what notebooks do:

- **A big array of the kernel's moves onto its file** the first time it is
  sent (``pack(..., in_place=True)``, :mod:`fluksio_nb.shared_in_place`): its
  memory becomes the file's, at the same address, so sending it again costs
  only the pages the kernel changed since, usually none, and the machine
  holds it once.
- **The kernel keeps the files it sends** (``pack(..., reuse=True)``), on a
  shelf of its own, and writes the next parcel of the same size into one of
  them, whose pages are already there: a copy at memory speed. A receiver
  holds a shared ``flock`` on a kept file for as long as anything is mapped on
  it (the lock belongs to the mapping's own descriptor, so it goes when the
  last array on it does, or when the process dies); the shelf only reuses a
  file it can lock exclusively. Kept files are few and short-lived
  (:data:`SHELF_BYTES`, :data:`SHELF_IDLE_S`). They are memfd files, which
  receivers open through ``/proc/<pid>/fd/<n>``: with no name anywhere, they
  go with the last process holding them, however it ends.
- **What was sent is mapped copy-on-write** (``unpack(..., remember=True)``
  in the worker): a page the cell writes becomes its own, and which ones it
  wrote is the OS's to tell. An input the cell did not change is then known
  unchanged for the price of reading its page table (:func:`unchanged`), and
  does not go back at all.
- **A value that comes back on the memory it was sent on goes back as a
  reference** (``pack(..., refer_back=True)`` in the worker): ``b = a``, or
  ``a *= 2`` then sending ``a`` back, costs only the pages the cell changed,
  written into the kernel's file, and the kernel reads them there: on its
  own array, where it was moved onto the file, or on a mapping of the file.
  Only whole buffers, or most of one, go back this way: a small slice would
  keep a big file alive.

- **A worker keeps the files it sends back** (``pack(..., reuse=True,
  unmapped=True, room_in_segment_dir=True)``), lent to the kernel, which
  holds its lock on each for as long as its arrays are there. A cell run
  again writes its new value into a second set while the kernel still holds
  the last one, and the run after that into the first, warm. These files are
  made in ``/dev/shm`` and unlinked before a byte is written: nameless, so
  nothing is left there however the worker ends, yet taking its room, so a
  value too big for it still fails by name. They are written with
  ``write()``, never mapped in the worker, so they do not count in its
  resident memory, which a sampler holds to the claim's budget.

Measured the same way: 256 MiB into a claimed cell and back (``b = a``) went
from 200 ms (two new files) to about 35 ms once warm. 800 MB made in a
claimed cell: written into a new file in 590-650 ms, into a warm one in
180-240 ms (a copy into a warm mapping takes about 110 ms, but would count in
the worker's memory).

It is long because the files' whole life is kept in one place: where a
buffer is written, how it is mapped, reused, referred back and removed are
one set of promises about files in ``/dev/shm``, and each way out has to
know all of them.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import mmap
import os
import pickle
import re
import secrets
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import psutil

from fluksio_nb import pickling, shared_in_place
from fluksio_nb.shared_in_place import changed_runs
from fluksio_nb.stop_button import stop_held_back

#: Buffers at least this big travel through shared memory rather than inline.
#: Where the two cost the same, measured as pack, pickle the parcel, unpack and
#: touch every page: 64 KiB took 47 µs inline against 106 µs through a file,
#: 256 KiB 250 µs against 173 µs, 1 MiB 1.1 ms against 0.5 ms.
INLINE_LIMIT = 256 * 1024

#: Where the files go: memory-backed on Linux, so a file there is shared memory.
SEGMENT_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

#: ``fluksio-<pid of the creator>-<random>``: recognisable, and enough to tell
#: from the name alone whether anyone can still be waiting for the file.
SEGMENT_PREFIX = "fluksio-"
_SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d+)-[0-9a-f]+")

#: Slack when comparing a file's age with a process's start: psutil derives
#: start times from the boot time, which is whole seconds.
_CLOCK_SLACK_S = 2.0

_PROTOCOL = 5

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

#: A buffer goes back as a reference only if it covers at least this share of
#: the file it lies in; a smaller slice is cheaper to copy than to pin the file.
REFER_BACK_SHARE = 0.5

#: Types whose pickle is the standard library's whether cloudpickle makes it or not.
_PLAIN_TYPES = frozenset({int, float, complex, bool, str, bytes, type(None)})


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
    #: cell changed it (:func:`_where_received`), often nowhere.
    written: int | None = None
    #: The file is the sender's own array's memory
    #: (:mod:`~fluksio_nb.shared_in_place`), lent to this parcel alone.
    in_place: bool = False


@dataclass(frozen=True)
class PackedValue:
    """One name's pickle, and the big buffers it refers to, in order."""

    pickle: bytes
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class Parcel:
    """A set of named values on their way to another process.

    Small enough to pickle and send anywhere: the big buffers are only
    referred to. ``failures`` holds the names that could not be packed and why.
    """

    values: dict[str, PackedValue] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """How much the values take in transit, pickles and shared memory together."""
        return sum(
            len(value.pickle) + sum(segment.nbytes for segment in value.segments)
            for value in self.values.values()
        )

    @property
    def moved_bytes(self) -> int:
        """How much was copied to send the values: what a person is told moved.

        Less than :attr:`nbytes` where a buffer went back on the file it came
        on, which costs only what the cell changed in it.
        """
        return sum(
            len(value.pickle)
            + sum(
                segment.nbytes if segment.written is None else segment.written
                for segment in value.segments
            )
            for value in self.values.values()
        )

    def discard(self) -> None:
        """Remove the shared-memory files of a parcel that will not be unpacked.

        Only for a parcel nobody will unpack: a receiver still holding a copy
        finds its big values gone. Once: whoever gives up on the parcel
        discards it, and a second call does nothing, where it would put a
        kept file back on the shelf twice, for two parcels to write at once.
        """
        # Marked before its files go: a stop landing in between leaves a file
        # lent, never one let go twice. The values stay, for whoever reads
        # what was sent (a worker comparing what it was sent with what it has).
        if self.__dict__.get("_discarded"):
            return
        object.__setattr__(self, "_discarded", True)
        for value in self.values.values():
            _let_go(value.segments)

    def __repr__(self) -> str:
        shared = sum(len(value.segments) for value in self.values.values())
        return (
            f"<Parcel of {len(self.values)} names, {self.nbytes / 2**20:.1f} MiB, "
            f"{shared} shared-memory segments, {len(self.failures)} failed>"
        )


def pack(
    values: Mapping[str, object],
    *,
    reuse: bool = False,
    refer_back: bool = False,
    in_place: bool = False,
    unmapped: bool = False,
    room_in_segment_dir: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Parcel:
    """Pickle each value on its own; report the ones that cannot travel by name.

    ``reuse`` writes big buffers into this process's kept files, warm from
    earlier parcels, and keeps them for later ones; the parcel's
    :meth:`~Parcel.discard` puts them back. ``refer_back`` sends a buffer that
    lies in a kept file this process was sent, unpacked with ``remember=True``,
    as a reference to that file instead of a copy. ``in_place`` sends a big
    array of this process's own as a reference to the file its memory was
    moved onto (:mod:`fluksio_nb.shared_in_place`), moving it the first time.
    ``unmapped`` writes kept
    files without mapping them here, so they stay out of this process's
    resident memory, which a sampler may be holding to a budget.
    ``room_in_segment_dir`` makes new kept files in :data:`SEGMENT_DIR`, nameless
    from the start, so that they take their room there and a full one is a
    :class:`NoRoom` for the name, as a file that is not kept would be.

    Every value is pickled before any big buffer is written, so that
    ``progress(written, total)`` is told the bytes to write before the first
    is: once with nothing written, then as the writing goes.
    """
    planned: dict[str, tuple[bytes, list[Segment | memoryview]]] = {}
    failures: dict[str, str] = {}
    for name, value in values.items():
        try:
            planned[name] = _plan_one(value, refer_back, in_place)
        except Exception as error:
            failures[name] = _reason(error)
    total = sum(
        part.nbytes
        for _, parts in planned.values()
        for part in parts
        if isinstance(part, memoryview)
    )
    written = _Written(total, progress)
    packed: dict[str, PackedValue] = {}
    for name, (data, parts) in planned.items():
        segments: list[Segment] = []
        try:
            for part in parts:
                if isinstance(part, Segment):
                    segments.append(part)
                elif reuse:
                    segments.append(
                        _shelf.write(
                            part,
                            unmapped=unmapped,
                            in_segment_dir=room_in_segment_dir,
                            written=written,
                        )
                    )
                else:
                    segments.append(_write_segment(part, written))
        except Exception as error:
            _let_go(segments)
            failures[name] = _reason(error)
            continue
        except BaseException:
            _let_go(segments)
            for done in packed.values():
                _let_go(done.segments)
            # Files lent while planning values not reached yet go back too:
            # lent for good, an array would be copied at every send after.
            for _, later in planned.values():
                _let_go([part for part in later if isinstance(part, Segment) and part.in_place])
            raise
        packed[name] = PackedValue(data, tuple(segments))
    return Parcel(packed, failures)


class _Written:
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
_WRITE_PIECE = 32 << 20


def pack_pickled(data: bytes, buffers: Sequence[Any], *, reuse: bool = False) -> PackedValue:
    """A value pickled elsewhere with its big buffers out of band, those put in shared memory.

    For values that arrive already pickled (a Ray task's inputs): unpickling
    and pickling them again would copy every buffer twice. ``reuse`` writes
    into this process's kept files, as :func:`pack` does.
    """
    segments: list[Segment] = []
    try:
        for buffer in buffers:
            raw = memoryview(buffer).cast("B")
            segments.append(_shelf.write(raw) if reuse else _write_segment(raw))
    except BaseException:
        _let_go(segments)
        raise
    return PackedValue(data, tuple(segments))


def unchanged(value: object, sent: PackedValue) -> bool:
    """Whether ``value`` is still exactly what was sent for it: nothing need go back.

    Its pickle must be the same bytes, and each big buffer must still lie
    where it arrived, on its own received file, with not one page of it
    written since: the files a receiver remembers are mapped copy-on-write,
    so a page the cell wrote is a page of its own, which the OS tells apart
    (:func:`~fluksio_nb.shared_in_place.changed_runs`). Finding that out costs a pickle of the value
    without its buffers and a read of 8 bytes a page (1.5 ms for 512 MiB),
    where sending it back would cost a copy or a comparison of every byte.

    A value that no longer pickles, pickles differently for any reason, or
    whose pages cannot be read, counts as changed: taking a changed value for
    unchanged loses the change, the other way round only costs a copy.
    """
    buffers: list[memoryview] = []

    def spill(buffer: pickle.PickleBuffer) -> bool:
        raw = out_of_band(buffer)
        if raw is None:
            return True
        buffers.append(raw)
        return False

    try:
        again = dumps(value, spill)
    except Exception:
        return False
    if again != sent.pickle or len(buffers) != len(sent.segments):
        return False
    return all(
        _lies_unwritten_on(raw, segment)
        for raw, segment in zip(buffers, sent.segments, strict=True)
    )


def unpack(parcel: Parcel, *, remember: bool = False) -> tuple[dict[str, object], dict[str, str]]:
    """The values that arrived, and for each that did not, why.

    Removes every shared-memory file of the parcel that is not kept by its
    sender, whether its value arrived or not, so a parcel can be unpacked
    once. ``remember`` notes the kept files mapped here, for the next
    ``pack(..., refer_back=True)``, forgetting those of the parcel before.
    """
    values: dict[str, object] = {}
    failures = dict(parcel.failures)
    if remember:
        _received.clear()
    try:
        for name, packed in parcel.values.items():
            try:
                buffers = [_map(segment, remember) for segment in packed.segments]
                values[name] = pickle.loads(packed.pickle, buffers=buffers)
            except Exception as error:
                failures[name] = _reason(error)
    finally:
        # The files of a value whose first segment could not be mapped are
        # still there.
        parcel.discard()
    return values, failures


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


def out_of_band(buffer: pickle.PickleBuffer) -> memoryview | None:
    """The bytes of a buffer big enough to travel beside its pickle; ``None`` to keep it inside.

    A buffer that is not contiguous cannot be handed out as one run of bytes,
    and one under :data:`INLINE_LIMIT` costs less in the stream.
    """
    try:
        raw = buffer.raw()
    except BufferError:
        return None
    return raw if raw.nbytes >= INLINE_LIMIT else None


def dumps(value: object, buffer_callback: Any = None) -> bytes:
    """``value``'s pickle as cloudpickle makes it, by the standard library where that is the same.

    Most names a cell binds are numbers and strings. cloudpickle gives them
    the same bytes, but runs its Python hooks on the way: in a worker that
    sat idle 100 ms, pickling the number 1 took 1.7 ms that way, 0.9 ms the
    other. A claimed cell pays this for every name it sends back.

    The notebook's functions keep their cells' lines on the way
    (:mod:`fluksio_nb.pickling`), so that a traceback through one shows them,
    and big ``bytes`` are offered to ``buffer_callback``, as arrays are.
    """
    if type(value) in _PLAIN_TYPES and not (
        buffer_callback is not None and type(value) is bytes and len(value) >= INLINE_LIMIT
    ):
        return pickle.dumps(value, protocol=_PROTOCOL)
    return pickling.dumps(value, _PROTOCOL, buffer_callback)


#: Items of one value looked at to guess its size: a list of ten million
#: numbers is guessed from a sample, in microseconds, rather than walked.
_ITEMS_LOOKED_AT = 2000


def size_held(value: object) -> int:
    """About how many bytes ``value`` holds: what a person is told is being sent.

    A buffer (bytes, arrays) counts its bytes; a list, tuple, set or dict
    its own size and its items', from a sample of them; anything else what
    it says of itself (``nbytes``, or ``sys.getsizeof``). A guess, but one
    of the right order, made before the value is pickled.
    """
    return _size_of(value, [_ITEMS_LOOKED_AT])


def _size_of(value: Any, left: list[int]) -> int:
    try:
        return memoryview(value).nbytes
    except Exception:
        pass
    try:
        own = sys.getsizeof(value)
        if isinstance(value, dict):
            items: Any = [*value.keys(), *value.values()] if len(value) <= left[0] else None
        elif isinstance(value, list | tuple | set | frozenset):
            items = value
        else:
            nbytes = getattr(value, "nbytes", None)
            return nbytes if isinstance(nbytes, int) else own
        if not items or left[0] <= 0:
            return own
        looked, held = 0, 0
        for item in items:
            if left[0] <= 0:
                break
            left[0] -= 1
            looked += 1
            held += _size_of(item, left)
        return own + held * len(items) // looked
    except Exception:
        # A value whose own answers raise is still sent; only its size goes unsaid.
        return 0


def _plan_one(
    value: object, refer_back: bool, in_place: bool = False
) -> tuple[bytes, list[Segment | memoryview]]:
    """``value``'s pickle, and its big buffers in order: each to write, or a file to refer to."""
    parts: list[Segment | memoryview] = []

    def spill(buffer: pickle.PickleBuffer) -> bool:
        # Returning True keeps the buffer in the stream.
        raw = out_of_band(buffer)
        if raw is None:
            return True
        parts.append(_referred(raw, refer_back, in_place) or raw)
        return False

    try:
        return dumps(value, spill), parts
    except BaseException:
        # A file lent to a part already planned goes back to its lender.
        _let_go([part for part in parts if isinstance(part, Segment) and part.in_place])
        raise


def _referred(raw: memoryview, refer_back: bool, in_place: bool) -> Segment | None:
    """A file ``raw`` lies in, to send instead of a copy of it, if there is one."""
    if refer_back:
        return _where_received(raw)
    if in_place and (address := _address(raw)) is not None:
        shared = shared_in_place.share(raw, address)
        if shared is not None:
            return Segment(
                shared.path,
                raw.nbytes,
                shared.offset,
                kept=True,
                written=shared.written,
                in_place=True,
            )
    return None


def _write_segment(raw: memoryview, written: _Written | None = None) -> Segment:
    path = os.path.join(SEGMENT_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    fd = None
    try:
        # Made and known as one step: a stop landing as the file is made
        # would otherwise leave it there, with nobody to remove it.
        with stop_held_back():
            fd = _create(path)
        _write_all(fd, raw, written)
    except BaseException:
        if fd is not None:
            os.close(fd)
            os.unlink(path)
        raise
    os.close(fd)
    return Segment(path, raw.nbytes)


def _create(path: str) -> int:
    # Only ever a new file of our own: another user's symlink or file of the
    # same name in the shared directory is an error, never something to open.
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _write_all(fd: int, raw: memoryview, written: _Written | None = None, at: int = 0) -> None:
    # write() rather than filling a mapping: a full /dev/shm is then an
    # ENOSPC here instead of a SIGBUS at some later page, and it is faster
    # (256 MiB: 91 ms, against 199 ms copying into a fresh mapping).
    try:
        done = 0
        while done < raw.nbytes:
            n = os.pwrite(fd, raw[done : done + _WRITE_PIECE], at + done)
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


def _map(segment: Segment, remember: bool = False) -> memoryview:
    own = (
        None if remember else shared_in_place.view_of(segment.path, segment.offset, segment.nbytes)
    )
    if own is not None:
        return own
    try:
        fd = os.open(segment.path, os.O_RDWR)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"its shared memory {segment.path} is gone — the parcel was discarded, "
            "unpacked already, or swept after its sender died; run the cell again"
        ) from None
    try:
        if segment.kept:
            # Held for as long as the mapping is: the mapping keeps its own
            # duplicate of this descriptor, and the lock goes with the last of
            # them. The sender reuses the file only once nobody holds it.
            fcntl.flock(fd, fcntl.LOCK_SH)
        size = os.fstat(fd).st_size
        end = segment.offset + segment.nbytes
        if size != segment.nbytes and not (segment.kept and size >= end):
            raise ValueError(
                f"its shared memory {segment.path} holds {size} bytes, not the "
                f"{segment.nbytes} that were sent — something else wrote there; run the cell again"
            )
        # Writable either way, so arrays on it are writable. A remembered file
        # (a cell's inputs) is mapped copy-on-write: a page the cell writes
        # becomes its own, the sender's file keeps what was sent, and which
        # pages the cell changed is the OS's to tell (:func:`unchanged`).
        # Otherwise shared: a file that is not kept is unlinked next, so
        # nobody else sees the writes, and a kept one is only written again
        # once every mapping of it has gone.
        # Mapped lazily: for 256 MiB, faulting every page in on first touch
        # took 11 ms, against 13 ms for MAP_POPULATE up front.
        flags = mmap.MAP_PRIVATE if remember else mmap.MAP_SHARED
        mapping = mmap.mmap(fd, end, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        if not segment.kept:
            with suppress(FileNotFoundError):
                os.unlink(segment.path)
    if remember:
        _received.append(_Received(weakref.ref(mapping), _address(memoryview(mapping)), segment))
    view = memoryview(mapping)
    return view[segment.offset : end] if segment.offset else view


# -----------------------------------------------------------------------------
# Sending back what was sent
# -----------------------------------------------------------------------------


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


def _address(view: memoryview) -> int | None:
    """Where a buffer starts in this process's memory; ``None`` if read-only."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:
        return None


def _lies_unwritten_on(raw: memoryview, segment: Segment) -> bool:
    """Whether ``raw`` is where ``segment`` arrived, whole, with no page of it written since."""
    start = _address(raw)
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


def _where_received(raw: memoryview) -> Segment | None:
    """The kept file ``raw`` lies in, as a reference to send back, if it does.

    The file is brought up to date first: the pages the cell wrote on its
    copy-on-write mapping are written into it, and only those, then given
    back, so the mapping reads the file again and nothing is written twice.
    Where that cannot be done (the pages cannot be read, the sender has gone)
    the buffer is copied as any other.
    """
    start = _address(raw) if _received else None
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
            _write_all(fd, view[offset : offset + length], at=offset)
            written += length
            # The mapping's own copies go: it reads the file again, which now
            # says the same, and the next look finds nothing changed.
            mapping.madvise(mmap.MADV_DONTNEED, offset, length)
        view.release()
    finally:
        os.close(fd)
    return written


# -----------------------------------------------------------------------------
# The shelf: kept files, warm for the next parcel
# -----------------------------------------------------------------------------


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
        written: _Written | None = None,
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
                _write_all(kept.fd, raw, written)
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
            for start in range(0, raw.nbytes, _WRITE_PIECE):
                piece = raw[start : start + _WRITE_PIECE]
                kept.mapping[start : start + piece.nbytes] = piece
                if written is not None:
                    written.add(piece.nbytes)
        except BaseException:
            self.give_back(path)
            raise
        return Segment(path, raw.nbytes, kept=True)

    def _new_file(
        self, raw: memoryview, in_segment_dir: bool, written: _Written | None
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
    raw: memoryview, in_segment_dir: bool = False, written: _Written | None = None
) -> tuple[str, int]:
    """A new file holding ``raw``, to keep: its path for receivers, and our descriptor.

    Nameless, and opened by receivers through ``/proc/<pid>/fd/<n>``: with no
    name to remove, however this process ends, even killed, the memory goes
    with the last mapping of it. An anonymous ``memfd`` by default; with
    ``in_segment_dir``, a file made in :data:`SEGMENT_DIR` and unlinked before
    a byte is written, which takes its room there like any segment, so that a
    full one is a :class:`NoRoom` rather than memory taken from wherever.
    Where there is no ``/proc``, a named file, which :func:`sweep_orphans`
    removes after a kill.
    """
    pid = os.getpid()
    if not hasattr(os, "memfd_create") or not os.path.isdir(f"/proc/{pid}/fd"):
        segment = _write_segment(raw, written)
        return segment.path, os.open(segment.path, os.O_RDWR | os.O_NOFOLLOW)
    fd = None
    try:
        # Made, unnamed and known as one step, so that a stop landing on the
        # way leaves neither a name in the directory nor a descriptor.
        with stop_held_back():
            if in_segment_dir:
                path = os.path.join(SEGMENT_DIR, f"{SEGMENT_PREFIX}{pid}-{secrets.token_hex(8)}")
                fd = _create(path)
                os.unlink(path)
            else:
                fd = os.memfd_create(f"{SEGMENT_PREFIX}{pid}-kept", os.MFD_CLOEXEC)
        _write_all(fd, raw, written)
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


def clear_shelf() -> None:
    """Remove every file this process keeps for reuse; arrays mapped on them stay valid."""
    _shelf.clear()


def _let_go(segments: list[Segment] | tuple[Segment, ...]) -> None:
    """Remove the files of ``segments``, or put them back on the shelf if kept."""
    for segment in segments:
        if segment.in_place:
            shared_in_place.give_back(segment.path)
            continue
        if segment.kept:
            _shelf.give_back(segment.path)
            continue
        with suppress(FileNotFoundError):
            os.unlink(segment.path)


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


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__
