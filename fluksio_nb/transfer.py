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
file in ``/dev/shm`` (:mod:`fluksio_nb.segments`). The receiver maps the file
and unpickles straight onto the mapping, so a numpy array arrives writable
and backed by that mapping, with no copy on the receiving side at all. Below
the limit a buffer stays in the stream: for a few tens of kilobytes, a file,
a mapping and their system calls cost more than the copies.

The files are the one thing here that can outlive both processes, so every way
out removes them. :func:`unpack` unlinks each file as soon as it is mapped —
from then on the memory lives exactly as long as the arrays on it — unless
its sender keeps it (below). :meth:`Parcel.discard` removes the files of a
parcel that will never be unpacked. A sender that died between writing and
the receiver mapping is covered by the file name, which records the
creating process: :func:`~fluksio_nb.segments.sweep_orphans` removes the
files whose creator is gone, and a worker runs it when its kernel dies.

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
  shelf of its own (:mod:`fluksio_nb.shelf`), and writes the next parcel of
  the same size into one of them, whose pages are already there, once no
  receiver maps it: a copy at memory speed.
- **What was sent is mapped copy-on-write** (``unpack(..., remember=True)``
  in the worker): an input the cell did not change is known unchanged for
  the price of reading its page table (:func:`unchanged`), and does not go
  back at all.
- **A value that comes back on the memory it was sent on goes back as a
  reference** (``pack(..., refer_back=True)`` in the worker,
  :mod:`fluksio_nb.sent_back`): ``b = a``, or ``a *= 2`` then sending ``a``
  back, costs only the pages the cell changed.
- **A worker keeps the files it sends back** (``pack(..., reuse=True,
  unmapped=True, room_in_segment_dir=True)``), lent to the kernel, which
  holds them for as long as its arrays are there; written, never mapped, in
  the worker, so that they do not count in its resident memory.

Measured the same way: 256 MiB into a claimed cell and back (``b = a``) went
from 200 ms (two new files) to about 35 ms once warm.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from fluksio_nb import pickling, sent_back, shared_in_place, shelf
from fluksio_nb.segments import Segment, Written, write_segment

#: Buffers at least this big travel through shared memory rather than inline.
#: Where the two cost the same, measured as pack, pickle the parcel, unpack and
#: touch every page: 64 KiB took 47 µs inline against 106 µs through a file,
#: 256 KiB 250 µs against 173 µs, 1 MiB 1.1 ms against 0.5 ms.
INLINE_LIMIT = 256 * 1024

_PROTOCOL = 5

#: Types whose pickle is the standard library's whether cloudpickle makes it or not.
_PLAIN_TYPES = frozenset({int, float, complex, bool, str, bytes, type(None)})


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
    ``room_in_segment_dir`` makes new kept files in
    :data:`~fluksio_nb.segments.SEGMENT_DIR`, nameless from the start, so that
    they take their room there and a full one is a
    :class:`~fluksio_nb.segments.NoRoom` for the name, as a file that is not
    kept would be.

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
    written = Written(total, progress)
    packed: dict[str, PackedValue] = {}
    for name, (data, parts) in planned.items():
        segments: list[Segment] = []
        try:
            for part in parts:
                if isinstance(part, Segment):
                    segments.append(part)
                elif reuse:
                    segments.append(
                        shelf.write(
                            part,
                            unmapped=unmapped,
                            in_segment_dir=room_in_segment_dir,
                            written=written,
                        )
                    )
                else:
                    segments.append(write_segment(part, written))
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
            segments.append(shelf.write(raw) if reuse else write_segment(raw))
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
    (:func:`~fluksio_nb.written_pages.changed_runs`). Finding that out costs a
    pickle of the value without its buffers and a walk of its page table
    (0.01 ms for 512 MiB the cell did not touch, 1.3 ms if it read every
    page), where sending it back would cost a copy or a comparison of every
    byte.

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
        sent_back.lies_unwritten_on(raw, segment)
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
        sent_back.forget()
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
        return sent_back.where_received(raw)
    if in_place and (address := sent_back.address_of(raw)) is not None:
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
        sent_back.remember(mapping, segment)
    view = memoryview(mapping)
    return view[segment.offset : end] if segment.offset else view


def _let_go(segments: list[Segment] | tuple[Segment, ...]) -> None:
    """Remove the files of ``segments``, or put them back on the shelf if kept."""
    for segment in segments:
        if segment.in_place:
            shared_in_place.give_back(segment.path)
            continue
        if segment.kept:
            shelf.give_back(segment.path)
            continue
        with suppress(FileNotFoundError):
            os.unlink(segment.path)


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__
