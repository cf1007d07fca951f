"""Holding one claim's processes to its share with the OS, not with their good manners.

Much of the code on a shared machine ignores ``OMP_NUM_THREADS``. So a claim
on this machine is also held by the kernel: its processes run on its own
cores (affinity, and a cpuset a cell cannot re-pin itself out of:
:mod:`fluksio_nb.cpuset`), its memory is capped by a cgroup of its own, and
where the books could pin no cores, a CPU quota holds it to its cpus' worth
of time.
Each of those is made where the OS allows it; where it does not, the claim
says what holds it instead, and the sampler and the thread variables do what
they can (:mod:`fluksio_nb.enforcement`).

What this module decides:

- **Which holds are made, and what each claim is told.** Its cards, too, on a
  machine that has some: a devices cgroup opening only its own
  (:mod:`fluksio_nb.card_devices`). :meth:`Confinement.make`
  returns what holds the claim's memory, cores and cards, for its status.
- **A process enters before it runs a line** (:meth:`Confinement.into_the_share`,
  run in the child between fork and exec): moved after it started, what it
  allocated first would be charged outside the cap, and what it started first
  would run on any core. A warm worker that ran an earlier claim is moved,
  every thread of it (:meth:`Confinement.admit`).
- **A claim is not counted under its kernel's ``kernel_ram``**: a claim
  with no ``ram=`` gets a cgroup with no limit beside the kernel's
  (:meth:`Confinement._out_of_the_kernels_cap`), one with a ``ram=`` its own.
- **A worker the cap's out-of-memory killer ended was halted for its budget**
  (:meth:`Confinement.halt_by_the_cap`), not lost.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import replace

import psutil

from fluksio_nb.books import Allocation
from fluksio_nb.budget import (
    CGROUP_V2,
    Budget,
    HaltDecision,
    over_budget,
    over_budget_before_it_ran,
)
from fluksio_nb.card_devices import cards_held_here, devices_place, hold_cards
from fluksio_nb.cpuset import by_affinity, cores_held_here, cpuset_place, hold_cores
from fluksio_nb.enforcement import (
    THREAD_VARIABLES,
    Enforcement,
    cores_enforcement,
    quota_enforcement,
)
from fluksio_nb.inventory import Inventory, confine_tree
from fluksio_nb.memory_cap import (
    CapNotMade,
    ClaimCgroup,
    cap_place,
    in_a_kernel_cgroup,
    memory_enforcement,
    sampled,
)
from fluksio_nb.settings import Settings
from fluksio_nb.stop_button import stop_held_back


class Confinement:
    """One claim's cores, cpuset, memory cgroup and CPU quota, from its grant to its end."""

    def __init__(self, cores: frozenset[int]) -> None:
        #: The cores the claim's processes run on: its own, or every claimable one.
        self.cores = cores
        #: The claim's memory cgroup, while the kernel caps its memory.
        self.cap: ClaimCgroup | None = None
        #: Where the claim has no cores of its own: the cgroup that holds it to
        #: its cpus' worth of time (cgroup v1's cpu hierarchy; on v2 the quota
        #: goes in :attr:`cap` when there is one).
        self.quota: ClaimCgroup | None = None
        #: Where the claim has cores of its own: the cgroup that holds it to
        #: them (on v2 it may be :attr:`cap`, a process being in one v2 cgroup).
        self.cpuset: ClaimCgroup | None = None
        #: Where the machine has cards: the cgroup whose processes may open
        #: only the claim's own (:mod:`fluksio_nb.card_devices`).
        self.cards: ClaimCgroup | None = None
        #: What holds the claim's memory, its cores and its cards, as its status says.
        self.memory: Enforcement | None = None
        self.cpus: Enforcement | None = None
        self.gpus: Enforcement | None = None

    @classmethod
    def make(
        cls, allocation: Allocation, budget: Budget, settings: Settings, inventory: Inventory
    ) -> Confinement:
        """The holds the OS allows for this grant; :attr:`memory` and :attr:`cpus` say which."""
        if allocation.cores and settings.pin_cores:
            cores = frozenset(allocation.cores)
        else:
            cores = inventory.worker_cores or frozenset(os.sched_getaffinity(0))
        made = cls(cores)
        try:
            made.memory = made._make_cap(budget, settings)
            made.cpus = made._hold_to_cores(allocation, settings, inventory)
            if inventory.gpus or allocation.gpus:
                made.gpus = made._hold_to_cards(allocation)
        except BaseException:
            made.remove()
            raise
        return made

    def _make_cap(self, budget: Budget, settings: Settings) -> Enforcement:
        if budget.halt_bytes is None:
            self._out_of_the_kernels_cap(settings)
            return sampled("the claim named no ram=, so it has no budget of its own to cap")
        enforcement = memory_enforcement(settings)
        if not enforcement.capped:
            return enforcement
        try:
            # Made and known as one step: a stop landing as the cgroup was made
            # or limited would leave it there, and nothing to remove it.
            with stop_held_back():
                self.cap = ClaimCgroup.make(cap_place(), budget.halt_bytes)
        except CapNotMade as error:
            return sampled(str(error))
        return enforcement

    def _out_of_the_kernels_cap(self, settings: Settings) -> None:
        """A claim with no ``ram=`` in a kernel under ``kernel_ram`` runs beside it, uncapped.

        A claim's memory is the claim's, not the kernel's: left in the kernel's
        cgroup, its worker would be stopped at the kernel's cap, and take the
        kernel with it. Where no cgroup can be made, it stays there.
        """
        place = cap_place()
        if not settings.memory_cap or not place.available or not in_a_kernel_cgroup(place):
            return
        with contextlib.suppress(CapNotMade), stop_held_back():
            self.cap = ClaimCgroup.make_uncapped(place)

    def _hold_to_cores(
        self, allocation: Allocation, settings: Settings, inventory: Inventory
    ) -> Enforcement:
        """Own cores where the books pinned some; a CPU quota where they could not."""
        pinning = cores_enforcement(allocation.cores, settings.pin_cores, inventory.cpus)
        if pinning.capped:
            return self._hold_in_a_cpuset()
        if not settings.pin_cores:
            return pinning
        place = cap_place(controller="cpu")
        if not place.available:
            return replace(pinning, why=f"{pinning.why}; no CPU quota either: {place.why_not}")
        assert place.version is not None
        try:
            cap = self.cap
            if cap is not None and cap.version == place.version == CGROUP_V2:
                cap.limit_cpus(allocation.cpus)
            else:
                with stop_held_back():  # as the memory cgroup is
                    self.quota = ClaimCgroup.make_quota(place, allocation.cpus)
        except OSError as error:
            return replace(pinning, why=f"{pinning.why}; the CPU quota was not set: {error}")
        return quota_enforcement(allocation.cpus, place.version, pinning.why)

    def _hold_in_a_cpuset(self) -> Enforcement:
        """A cpuset of the claim's cores where one can be made; else affinity, and why."""
        place = cpuset_place()
        if not place.available:
            return by_affinity(place.why_not)
        try:
            with stop_held_back():  # as the memory cgroup is
                self.cpuset = hold_cores(place, self.cores, self.cap)
        except CapNotMade as error:
            return by_affinity(str(error))
        return cores_held_here(place)

    def _hold_to_cards(self, allocation: Allocation) -> Enforcement:
        """A devices cgroup opening only the claim's cards, where one can be made."""
        place = devices_place()
        if not place.available:
            return cards_held_here(place)
        try:
            # Made and known as one step, as the memory cgroup is: a stop held
            # back inside hold_cards lands as it returns, and the cgroup would
            # be left with nothing to remove it, one more a stop.
            with stop_held_back():
                self.cards = hold_cards(
                    place, [int(card) for card in allocation.gpus], self._v2_cgroup()
                )
        except CapNotMade as error:
            return cards_held_here(replace(place, version=None, why_not=str(error)))
        return cards_held_here(place)

    def _v2_cgroup(self) -> ClaimCgroup | None:
        """The claim's cgroup v2 cgroup, if it has one: a process is in one v2 cgroup only."""
        for cgroup in (self.cap, self.cpuset, self.quota):
            if cgroup is not None and cgroup.version == CGROUP_V2:
                return cgroup
        return None

    def cgroups(self) -> list[ClaimCgroup]:
        """Each cgroup the claim holds, once: on v2 its cpuset may be its memory cgroup."""
        found: list[ClaimCgroup] = []
        for cgroup in (self.cap, self.quota, self.cpuset, self.cards):
            if cgroup is not None and not any(cgroup is seen for seen in found):
                found.append(cgroup)
        return found

    def admit(self, pid: int) -> list[int]:
        """Move a running worker, every thread of it, onto the claim's cores and into its cgroups.

        A cgroup that cannot take it is let go, and :attr:`memory` or
        :attr:`cpus` says what holds the claim instead. Returns the worker's
        processes as they were found: it and what it had started.
        """
        family = confine_tree(pid, self.cores)
        cpuset = self.cpuset
        if cpuset is not None and cpuset is not self.cap:
            try:
                cpuset.admit(pid)
            except OSError as error:
                self.cpuset = None
                cpuset.remove()
                self._lost_cards_with(cpuset, error)
                self.cpus = by_affinity(
                    f"the worker could not be moved into {cpuset.path}: {error}"
                )
        quota = self.quota
        if quota is not None:
            try:
                quota.admit(pid)
            except OSError as error:
                self.quota = None
                quota.remove()
                self._lost_cards_with(quota, error)
                self.cpus = Enforcement(
                    THREAD_VARIABLES,
                    THREAD_VARIABLES,
                    f"the worker could not be moved into {quota.path}: {error}",
                )
        cards = self.cards
        # On v2 it may be the claim's memory, cpuset or quota cgroup: moved in with it.
        if cards is not None and not any(cards is other for other in (cpuset, quota, self.cap)):
            try:
                cards.admit(pid)
            except OSError as error:
                self.cards = None
                cards.remove()
                self.gpus = cards_held_here(
                    replace(
                        devices_place(),
                        version=None,
                        why_not=f"the worker could not be moved into {cards.path}: {error}",
                    )
                )
        cap = self.cap
        if cap is None:
            return family
        try:
            held = psutil.Process(pid).memory_info().rss
            cap.admit(pid, held)
        except (OSError, psutil.Error) as error:
            self.cap = None
            cap.remove()
            self._lost_cards_with(cap, error)
            self.memory = sampled(f"the worker could not be moved into {cap.path}: {error}")
            if self.cpuset is cap:
                self.cpuset = None
                self.cpus = by_affinity(f"the worker could not be moved into {cap.path}: {error}")
        return family

    def _lost_cards_with(self, cgroup: ClaimCgroup, error: object) -> None:
        """On v2 the cards' program is on the claim's one cgroup: removed, it is gone too."""
        if self.cards is cgroup:
            self.cards = None
            self.gpus = cards_held_here(
                replace(
                    devices_place(),
                    version=None,
                    why_not=f"the worker could not be moved into {cgroup.path}: {error}",
                )
            )

    def let_go(self, pid: int) -> None:
        """A warm worker goes back to the pool as it came: outside any claim.

        Out of a cpuset, the kernel widens its threads to every core of the
        kernel's own, the reserve included; they go back to the claim's,
        where an idle worker stayed before cpusets, until its next claim.
        """
        for cgroup in self.cgroups():
            cgroup.let_go(pid)
        if self.cpuset is not None:
            with contextlib.suppress(OSError):
                confine_tree(pid, self.cores)

    def into_the_share(self, then: Callable[[], None] | None = None) -> Callable[[], None]:
        """What a new process runs between fork and exec to start inside the share."""
        cgroups, cores = self.cgroups(), self.cores
        for cgroup in cgroups:
            cgroup.settle(0)

        def enter() -> None:
            os.sched_setaffinity(0, cores)
            for cgroup in cgroups:
                cgroup.enter_from_child()
            if then is not None:
                then()

        return enter

    def over_before_it_ran(self, budget: Budget | None) -> HaltDecision | None:
        """The halt of a claim whose worker came into the cap holding more than its budget.

        What a process holds as it comes in stays charged elsewhere, and the cap
        is set to the budget less that: one already over it cannot be held to it.
        """
        cap = self.cap
        if cap is None or budget is None or budget.halt_bytes is None:
            return None
        if cap.baseline_bytes <= budget.halt_bytes:
            return None
        return over_budget_before_it_ran(cap.baseline_bytes, budget, cap.version)

    def halt_by_the_cap(self, budget: Budget | None, peak_seen: int) -> HaltDecision | None:
        """The halt to report for a process that died, if the cap's OOM killer is what killed it."""
        cap = self.cap
        if cap is None or budget is None or budget.halt_bytes is None or not cap.oom_kills():
            return None
        peak = cap.peak_bytes()
        return over_budget(peak_seen if peak is None else peak, budget, cap.version)

    def peak_bytes(self) -> int | None:
        """What the kernel counted as the cap's peak: exact where a reading may have missed it."""
        return None if self.cap is None else self.cap.peak_bytes()

    def remove(self) -> None:
        for cgroup in self.cgroups():
            cgroup.remove()
        self.cap = self.quota = self.cpuset = self.cards = None
