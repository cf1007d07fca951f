"""The books for one machine: what it holds, and what is free of it.

This is arithmetic nobody was doing. Five notebooks each sizing a thread pool
to every core, or three processes each taking most of "GPU 0", are both a
sum that exceeds what the machine has, and nothing anywhere keeps the sum.

The books never block. Waiting belongs to :mod:`fluksio_nb.queue`, which asks
:meth:`ResourceAccountant.try_take` again when something comes free. Keeping the two
apart is what lets the queue decide *who* goes next (first come, first served,
with the overtaking rule) while the books only decide *whether* something fits.
It is also what lets a books service replace the books without touching
the queue's rules.

A card is held whole by one claim, or shared by slices (``gpus=0.5``,
``gpu_ram=`` alone); which card a claim gets is decided by
:mod:`fluksio_nb.card_slices`, the same for these books and the machine's:
whole cards the lowest idle index, so a quiet machine hands out card 0
first, as people expect, and slices best-fit.

Cores are handed out the same way, by id: a claim of ``cpus=2`` holds two
cores no other running claim holds, and its worker runs on exactly those.
A thread count only steers libraries that read it; ``multiprocessing.Pool(8)``,
numba, or ``threadpoolctl`` set to 8 inside the cell would otherwise spread
over every claim's cores. Which cores: all on one NUMA node where one node
has enough free (the fullest such node, so that a big claim later still
finds a whole node), else the most from the emptiest nodes first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fluksio_nb.card_slices import CardAsk, Cards
from fluksio_nb.gpus import GpuId
from fluksio_nb.inventory import Inventory


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one claim was actually given."""

    cpus: int = 1
    gpus: tuple[GpuId, ...] = ()
    ram_bytes: int = 0
    #: The core ids this claim runs on, or ``()`` where cores are not pinned
    #: (a declared inventory larger than the machine, or a Ray node's share).
    cores: tuple[int, ...] = ()
    #: The card memory of a slice of its one card; 0 for cards held whole.
    gpu_bytes: int = 0

    @classmethod
    def from_dict(cls, held: Mapping[str, Any]) -> Allocation:
        """What :meth:`as_dict` wrote, as a books service keeps it."""
        return cls(
            cpus=held["cpus"],
            gpus=tuple(held["gpus"]),
            ram_bytes=held["ram_bytes"],
            cores=tuple(held.get("cores") or ()),
            gpu_bytes=int(held.get("gpu_bytes") or 0),
        )

    def as_dict(self) -> dict[str, object]:
        said: dict[str, object] = {
            "cpus": self.cpus,
            "gpus": list(self.gpus),
            "ram_bytes": self.ram_bytes,
            "cores": list(self.cores),
        }
        if self.gpu_bytes:
            said["gpu_bytes"] = self.gpu_bytes
        return said


def pick_cores(free: Sequence[int], n: int, node_of: Mapping[int, int]) -> tuple[int, ...]:
    """``n`` of the ``free`` cores for one claim, on as few NUMA nodes as will do."""
    if n <= 0 or len(free) < n:
        return ()
    by_node: dict[int, list[int]] = {}
    for core in sorted(free):
        by_node.setdefault(node_of.get(core, 0), []).append(core)
    fitting = [cores for cores in by_node.values() if len(cores) >= n]
    if fitting:
        # The fullest node that fits: the emptier ones stay whole for bigger claims.
        return tuple(min(fitting, key=len)[:n])
    picked: list[int] = []
    for cores in sorted(by_node.values(), key=len, reverse=True):
        picked += cores[: n - len(picked)]
        if len(picked) == n:
            break
    return tuple(sorted(picked))


class ResourceAccountant:
    """How much of one machine is handed out, and which cards.

    Memory is accounted only for claims that name it: a claim without ``ram=``
    takes none from the books, since a zero would make every such claim wait
    behind every claim that did name one.
    """

    def __init__(
        self,
        cpus: int,
        gpus: int | Iterable[GpuId] = 0,
        ram_bytes: int = 0,
        *,
        cores: Sequence[int] = (),
        core_nodes: Mapping[int, int] | None = None,
        card_bytes: Mapping[GpuId, int | None] | None = None,
    ):
        if cpus < 1:
            raise ValueError(f"a machine has at least one core, not {cpus}")
        if cores and len(cores) != cpus:
            raise ValueError(f"{len(cores)} core ids for {cpus} cpus: one id per cpu")
        self.cpus = cpus
        self.core_ids = tuple(sorted(cores))
        self.core_nodes = dict(core_nodes or {})
        self._free_cores = list(self.core_ids)
        self.gpu_ids: tuple[GpuId, ...] = (
            tuple(range(gpus)) if isinstance(gpus, int) else tuple(sorted(gpus))
        )
        self.ram_bytes = max(0, ram_bytes)
        self._free_cpus = cpus
        self._cards = Cards({g: (card_bytes or {}).get(g) for g in self.gpu_ids})
        self._free_ram = self.ram_bytes
        self._lock = threading.Lock()

    @classmethod
    def from_inventory(cls, found: Inventory) -> ResourceAccountant:
        """The books for what :func:`~fluksio_nb.inventory.take_inventory` found."""
        return cls(
            cpus=found.cpus,
            gpus=found.gpu_ids,
            ram_bytes=found.ram_bytes,
            cores=found.core_ids,
            core_nodes=found.core_nodes,
            card_bytes={gpu.index: gpu.memory_bytes for gpu in found.gpus},
        )

    @property
    def gpus(self) -> int:
        return len(self.gpu_ids)

    def fits(self, cpus: int, gpus: int | CardAsk = 0, ram_bytes: int = 0) -> bool:
        """Whether this machine could ever grant that much, busy or not.

        Waiting for a card that is merely busy is queueing; waiting for one the
        machine does not have is a cell that never runs.
        """
        ask = gpus if isinstance(gpus, CardAsk) else CardAsk(whole=gpus)
        return cpus <= self.cpus and self._cards.fits_ever(ask) and ram_bytes <= self.ram_bytes

    def cards_now(self) -> Cards:
        """The cards as they are held now, for a walk over the waiting claims to place on."""
        with self._lock:
            return self._cards.copy()

    def try_take(
        self,
        cpus: int,
        gpus: int | CardAsk = 0,
        ram_bytes: int = 0,
        *,
        on: tuple[tuple[GpuId, ...], int] | None = None,
    ) -> Allocation | None:
        """Take this much if it is free right now, or answer that it is not.

        ``on`` is where a walk over the waiting claims placed its cards
        (:meth:`cards_now`); without it, these books place them.
        """
        ask = gpus if isinstance(gpus, CardAsk) else CardAsk(whole=gpus)
        with self._lock:
            if self._free_cpus < cpus or self._free_ram < ram_bytes:
                return None
            placed = on if on is not None else (self._cards.place(ask) if ask else ((), 0))
            if placed is None:
                return None
            self._cards.take(*placed)
            self._free_cpus -= cpus
            self._free_ram -= ram_bytes
            cores = pick_cores(self._free_cores, cpus, self.core_nodes)
            self._free_cores = [core for core in self._free_cores if core not in cores]
        taken, nbytes = placed
        return Allocation(cpus=cpus, gpus=taken, ram_bytes=ram_bytes, cores=cores, gpu_bytes=nbytes)

    def give_back(self, allocation: Allocation) -> None:
        """Return what a claim held, however it ended."""
        with self._lock:
            stray = set(allocation.gpus) - set(self.gpu_ids)
            doubled = set(allocation.cores) & set(self._free_cores)
            stray |= set(allocation.cores) - set(self.core_ids)
            if stray or doubled or self._free_cpus + allocation.cpus > self.cpus:
                # Giving back twice would hand the same card to two claims
                # later, which is the one thing these books exist to prevent.
                raise ValueError(f"{allocation} was not taken from these books")
            try:
                self._cards.give_back(allocation.gpus, allocation.gpu_bytes)
            except ValueError:
                raise ValueError(f"{allocation} was not taken from these books") from None
            self._free_cpus += allocation.cpus
            self._free_cores = sorted([*self._free_cores, *allocation.cores])
            self._free_ram += allocation.ram_bytes

    def free(self) -> tuple[int, tuple[GpuId, ...], int]:
        """Free cores, idle cards (held by no claim, whole or sliced) and free bytes."""
        with self._lock:
            idle = tuple(c for c in self._cards.size if self._cards.idle(c))
            return self._free_cpus, idle, self._free_ram

    def snapshot(self) -> dict[str, dict[str, object]]:
        """What this machine holds and what is free of it."""
        free_cpus, free_gpus, free_ram = self.free()
        with self._lock:
            free_cores = list(self._free_cores)
        return {
            "cpus": {"total": self.cpus, "free": free_cpus, "free_ids": free_cores},
            "gpus": {
                "total": self.gpus,
                "free": len(free_gpus),
                "free_ids": list(free_gpus),
                "cards": self.cards_now().rows(),
            },
            "ram_bytes": {"total": self.ram_bytes, "free": free_ram},
        }
