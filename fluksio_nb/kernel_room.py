"""Room in the kernel for what a claimed cell made: a result it cannot take is refused.

A claimed cell runs in a worker that may hold far more than the kernel may:
a claim's ``ram=`` is its own, and where the kernel has a memory limit of its
own (a cgroup, as a hub's pod or an admin's ``kernel_ram`` gives it, or an
``RLIMIT_AS``), rebuilding a big result there is the allocation that gets the
kernel killed, and with it every variable the notebook had. So before a name
is unpickled in the kernel, what it will cost there is set against the room
there is, and a name that does not fit is refused by name, with its size and
the room, while every name that fits is still brought back.

What a name costs, decided from measurements on this machine (cgroup v1,
Linux 6.18):

- **Its pickle, in full.** A value that travels in the pickle stream (bytes,
  text, lists and dicts of objects, a torch tensor) is rebuilt by copying, in
  new memory of the kernel's, at least as big as the stream: a list of floats
  takes 32 bytes each against 9 in its pickle. The stream is already in the
  kernel (it came in the worker's message), so what is new is the rebuilt value.
- **Nothing for the buffers in shared memory**, against a cgroup or the
  machine. An array arrives mapped on the file the worker wrote, with no copy
  (:mod:`fluksio_nb.transfer`), and a shared page is charged to the cgroup
  that first wrote it, the worker's: a process in a cgroup limited to 100 MiB
  read and wrote every byte of a 150 MiB ``/dev/shm`` file another cgroup had
  written, and its cgroup's usage stayed at 0.5 MiB. The machine's available
  memory has those pages taken out already, as they were written.
- **Those buffers in full against an address-space limit** (``RLIMIT_AS``),
  since a mapping takes address space whoever owns its pages.

The room is the tightest of the limits in force, each read as the cell ends:
every memory cgroup from the kernel's own up (a parent's limit holds its
children), its usage less its file cache, which the OS gives back under
pressure rather than kill for; the machine's available memory; the address
space left under ``RLIMIT_AS``. The worker has let its cell's values go
before it says the cell is done (:mod:`fluksio_nb.worker.main`), so what it
held for them is room again by the time it is read.

Names are taken smallest first, so that one big value costs only itself.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from fluksio_nb.claim_cgroups import own_memory_cgroup
from fluksio_nb.memory_cap import key_values
from fluksio_nb.transfer import PackedValue, Parcel

#: Every reason a name was refused for starts so: how the notebook knows to
#: say what to do about memory.
TOO_BIG = "too big for the kernel"

#: What to do about a name refused for room, said once however many were.
WHAT_TO_DO = (
    "To bring it back, free memory in the kernel (del what it no longer needs) "
    "or give the kernel more; to leave it, del it at the cell's end, or name "
    "what to bring back with --out (a smaller result, say)."
)

#: Below this in all, nothing is weighed: a kernel with less room than this
#: fails at its own next allocation whatever comes back, and the readings
#: (a few files and /proc/meminfo, about 0.2 ms) are not worth every cell's time.
TOO_SMALL_TO_WEIGH = 1 << 20

#: Kept back from a rebuild's room: the kernel goes on after it, to show the
#: refusal and answer the next cell, and its own threads allocate meanwhile.
KEPT_FOR_THE_KERNEL = 32 << 20

#: A cgroup v1 "no limit" is the largest page-aligned 64-bit count; anything
#: this big is no limit.
_NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class Room:
    """How much more the kernel may take under one limit, and that limit in words."""

    nbytes: int
    #: "its memory cgroup /k holds 330 MiB of its 450 MiB limit"
    said: str
    #: Whether memory mapped from shared memory takes room here.
    counts_mappings: bool = False


@dataclass(frozen=True)
class Weighed:
    """What the kernel will not take, and the room it leaves for the rest."""

    #: Name to why, each starting with :data:`TOO_BIG`.
    refused: dict[str, str]
    #: The tightest room for memory of the kernel's own, if any was weighed.
    room: Room | None = None


def weigh(parcel: Parcel) -> Weighed:
    """The names of ``parcel`` the kernel has no room to rebuild, with why."""
    costs = {name: _cost(value) for name, value in parcel.values.items()}
    if sum(rebuilt + mapped for rebuilt, mapped in costs.values()) < TOO_SMALL_TO_WEIGH:
        return Weighed({})
    rooms = room_in_the_kernel()
    taken = [0] * len(rooms)
    refused: dict[str, str] = {}
    for name in sorted(costs, key=lambda name: sum(costs[name])):
        rebuilt, mapped = costs[name]
        needs = [rebuilt + (mapped if room.counts_mappings else 0) for room in rooms]
        short = [
            (room, need, max(0, room.nbytes - already))
            for room, need, already in zip(rooms, needs, taken, strict=True)
            if already + need > room.nbytes
        ]
        if not short:
            taken = [already + need for already, need in zip(taken, needs, strict=True)]
            continue
        room, need, left = short[0]
        refused[name] = (
            f"{TOO_BIG}: it takes {_size(need)} there, which has room for {_size(left)} "
            f"more ({room.said})"
        )
    own = [room for room in rooms if not room.counts_mappings]
    return Weighed(refused, min(own, key=lambda room: room.nbytes) if own else None)


@contextlib.contextmanager
def rebuilding_within(room: Room | None) -> Iterator[Callable[[str], str]]:
    """Rebuild values with no more than ``room`` of new memory; a value past it is refused.

    A pickle says its size, not the size of what it rebuilds: a list of
    floats takes 3.6 times its pickle, of short strings 8 times. So what
    :func:`weigh` let through is rebuilt under a data limit (``RLIMIT_DATA``)
    at the room there is: an allocation past it fails with ``MemoryError``,
    which drops that one value, where the cgroup's OOM killer would take the
    kernel. Yields how to say why a value that failed so was refused, given
    the failure's own words.
    """

    def why(said: str) -> str:
        if room is None or said != MemoryError.__name__:
            return said
        return (
            f"{TOO_BIG}: rebuilding it took more than the {_size(room.nbytes)} "
            f"there was room for ({room.said})"
        )

    limit = _data_limit_at(room)
    if limit is None:
        yield why
        return
    before = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, before[1]))
    try:
        yield why
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, before)


def _data_limit_at(room: Room | None) -> int | None:
    """The ``RLIMIT_DATA`` that leaves ``room`` to grow into; ``None`` for none to set."""
    if room is None:
        return None
    data = _vm_data()
    if data is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data + max(0, room.nbytes - KEPT_FOR_THE_KERNEL)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:
        return None  # a tighter one is set already, by whoever started the kernel
    return limit


def _vm_data() -> int | None:
    """This process's private writable memory, as ``RLIMIT_DATA`` counts it (Linux 4.7 on)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def room_in_the_kernel() -> list[Room]:
    """Each limit on this process's memory in force now, tightest cgroup first."""
    rooms = []
    cgroup = _cgroup_room()
    if cgroup is not None:
        rooms.append(cgroup)
    with contextlib.suppress(OSError, psutil.Error):
        available = psutil.virtual_memory().available
        rooms.append(Room(available, f"the machine has {_size(available)} available"))
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        with contextlib.suppress(psutil.Error):
            used = psutil.Process().memory_info().vms
            rooms.append(
                Room(
                    limit - used,
                    f"its address space is limited to {_size(limit)} (RLIMIT_AS), "
                    f"{_size(used)} of it in use",
                    counts_mappings=True,
                )
            )
    return rooms


def _cost(value: PackedValue) -> tuple[int, int]:
    """What one name takes in the kernel: rebuilt from its pickle, and mapped."""
    return len(value.pickle), sum(segment.offset + segment.nbytes for segment in value.segments)


def _cgroup_room() -> Room | None:
    """The tightest memory cgroup on the way up from this process's own, or ``None``."""
    own = own_memory_cgroup()
    if own is None:
        return None
    tightest = None
    for directory in [own, *own.parents]:
        found = _limit_and_use(directory)
        if found is None:
            break  # past the hierarchy's root, which has no limit file
        limit, in_use = found
        if limit >= _NO_LIMIT:
            continue
        left = limit - in_use
        if tightest is None or left < tightest.nbytes:
            said = (
                f"its memory cgroup {directory} holds {_size(in_use)} of its {_size(limit)} limit"
            )
            tightest = Room(left, said)
    return tightest


def _limit_and_use(directory: Path) -> tuple[int, int] | None:
    """A cgroup's memory limit and what it holds that it cannot give back; v2, then v1."""
    for limit_file, usage_file, file_cache in (
        ("memory.max", "memory.current", ("active_file", "inactive_file")),
        (
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            ("total_active_file", "total_inactive_file"),
        ),
    ):
        try:
            limit_text = (directory / limit_file).read_text().strip()
            usage = int((directory / usage_file).read_text())
            limit = _NO_LIMIT if limit_text == "max" else int(limit_text)
        except (OSError, ValueError):
            continue
        stat = key_values(directory / "memory.stat")
        return limit, max(0, usage - sum(stat.get(key, 0) for key in file_cache))
    return None


def _size(nbytes: int) -> str:
    mib = nbytes / 2**20
    if mib >= 10 * 1024:
        return f"{mib / 1024:.0f} GiB"
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.1f} MiB"
