"""Memory the kernel enforces: a claim's ``ram=`` as a cgroup limit, where one can be made.

The sampler reads a claim's memory every half second. ``numpy.ones`` of a few
gigabytes fills faster than that, and on a shared machine the allocation that
goes past a budget between two readings is the one that takes everybody's
kernels down. Only the kernel's own memory controller is as quick as an
allocation, so where this process may make a child cgroup with a memory
limit, every claim with a ``ram=`` gets one, and the sampler stays as the
second line (the host running short, and machines where no cgroup can be
made). This module finds out whether it can, makes, fills and removes those
cgroups, and says which of the two is in force (:func:`memory_enforcement`).

What it decides:

- **Where the claim cgroups go.** With cgroup v1's memory controller, under
  the process's own memory cgroup: ``<own>/fluksio_nb/<claim>``. v1 lets a
  cgroup with processes have children, and the kernel stays where it is.
  cgroup v2 does not: a cgroup whose ``cgroup.subtree_control`` enables a
  controller may hold no processes, so the kernel's own cgroup could only
  hold claims if the kernel moved out of it first. They go beside it instead,
  ``<parent>/fluksio_nb/<claim>``, where the parent already hands ``memory``
  down (it is in the parent's ``cgroup.subtree_control``) and this user may
  write: the layout systemd's ``Delegate=yes`` gives a user's own manager,
  ``user@UID.service/app.slice/<the kernel's scope>``. Moving a process
  between two siblings needs write access to their common ancestor's
  ``cgroup.procs``, which is that parent's. A controller is never enabled
  here on a cgroup this package did not make.
- **Only where no other user may change the way there.** A user who may
  write a directory on the way (a cgroup made group- or world-writable to
  hand it to several users) may remove a claim's cgroup before its worker
  comes in and make one of their own with that name, whose limit they set:
  the claim would run uncapped while it says it is capped. So every
  directory from the hierarchy's root down to where the claim cgroups go
  must be root's or this user's, writable by nobody else; otherwise the
  sampler holds claims, and says why.
- **The name says whose it is**: ``fluksio_nb-<kernel pid>-<start time>-<n>``.
  A kernel that was killed cannot remove its claims' cgroups; its workers do,
  as they leave, and any that remain are swept by the next claim made under
  the same parent (:func:`sweep_stale`). The owner is judged by its pid *and*
  its start time, so the sweep never takes the cgroup of a live kernel, even
  one of another user or another test run whose pid was reused.
- **The limit counts the worker's tree, as the sampler does.** Memory is
  charged to the cgroup a page was first touched in, and neither v2 nor
  current v1 kernels move charges with a process (``move_charge_at_immigrate``
  is gone). A warm worker moved into a claim's cgroup brings its imports'
  memory uncharged, so the limit is the budget less what the worker held as
  it came in: the most the claim's processes can hold together is the budget,
  and the peak reported is that baseline plus the cgroup's own peak counter.
- **No swap.** A capped claim swapping would be a claim running at disk
  speed past its budget; v1 gets ``memory.memsw.limit_in_bytes`` (where swap
  is accounted) and ``memory.swappiness`` 0, v2 ``memory.swap.max`` 0.
- **Removed on every ending.** Processes still in a claim's cgroup when it
  ends are the claim's, and a claim's processes end with it: they are killed,
  then the directory removed (``rmdir`` fails while any task is in it).

- **A CPU quota, only where a claim cannot have cores of its own.** Own
  cores (:mod:`fluksio_nb.books`) hold a claim exactly and cost nothing; a
  quota throttles a claim that bursts even when the machine is idle. So a
  quota (:meth:`ClaimCgroup.make_quota`, the same cgroups in the ``cpu``
  controller) is set only when the books could hand out no core ids: more
  cpus declared than there are cores. On v2 it goes in the claim's one
  cgroup beside its memory limit; on v1 in the cpu hierarchy.
- **The copy back is not the claim's.** The shared memory a worker writes
  its results into is charged to the cgroup it writes from, and is the
  kernel's from then on: the worker writes it from its kernel's
  (:func:`fluksio_nb.claim_cgroups.copy_back_outside_the_cap`).

Making, filling and removing one claim's cgroup costs about a millisecond
(measured on cgroup v1: mkdir, four writes, a move in and out, rmdir), paid
only by claims with a ``ram=``. Every path is a parameter, so the detection
can be tried on a tree of real files laid out as the kernel lays them out.

A worker's own steps out of its claim's cgroup, and the file operations
both sides share, are in :mod:`fluksio_nb.claim_cgroups`: a worker imports
them without the settings and the budget this module decides with.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from fluksio_nb.budget import CGROUP_V1, CGROUP_V2, SAMPLER
from fluksio_nb.claim_cgroups import (
    CLAIM_NAME,
    cgroup_pids,
    remove_cgroup,
    v2_mount,
    write_cgroup_file,
)
from fluksio_nb.enforcement import Enforcement
from fluksio_nb.inventory import CGROUP_ROOT, KERNEL_NAME, PROC_SELF_CGROUP, cgroup_paths
from fluksio_nb.sampler import SAMPLE_INTERVAL_S
from fluksio_nb.settings import Settings

#: The directory every claim cgroup of this package is made in.
PARENT_NAME = "fluksio_nb"

#: The smallest limit written: a budget the worker already spent before it
#: came in is a claim over its budget from the start, and is stopped at once.
_SMALLEST_LIMIT = 1 << 20

#: The same, for a dead kernel's leftovers swept as a new claim starts: that
#: claim's cell is waiting, and a cgroup not gone by then is tried again at
#: the next claim.
_SWEEP_GRACE_S = 0.5


@dataclass(frozen=True)
class CapPlace:
    """Where this process may make claim cgroups, or why it may not."""

    #: :data:`~fluksio_nb.budget.CGROUP_V1` or :data:`~fluksio_nb.budget.CGROUP_V2`;
    #: ``None`` when no cgroup can be made.
    version: str | None
    #: The ``fluksio_nb`` directory the claim cgroups go in.
    parent: Path | None = None
    #: This process's own memory cgroup, where processes go back to.
    home: Path | None = None
    #: Why no cgroup can be made, in words for a tooltip.
    why_not: str = ""

    @property
    def available(self) -> bool:
        return self.version is not None


#: The file a controller's cgroup v1 directory always has: how to know it is one.
_V1_MARK = {
    "memory": "memory.limit_in_bytes",
    "cpu": "cpu.cfs_quota_us",
    "cpuset": "cpuset.cpus",
}

#: The scheduler period a CPU quota is a share of, in microseconds: the default.
CPU_PERIOD_US = 100_000


def find_cap_place(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP, controller: str = "memory"
) -> CapPlace:
    """Whether this process may make a child cgroup with a ``controller`` limit, and where.

    cgroup v2 is tried first, as the hierarchy of every current distribution;
    a v1 memory controller next. The reasons either gave for refusing are kept
    for the tooltip: "no" is not worth showing without the why.
    """
    paths = cgroup_paths(proc_cgroup)
    if not paths:
        return CapPlace(None, why_not=f"{proc_cgroup} cannot be read, so no cgroup is known")
    reasons = []
    if "" in paths:
        place = _v2_place(root, paths[""], controller)
        if place.available:
            return place
        reasons.append(place.why_not)
    if controller in paths:
        place = _v1_place(root, paths[controller], controller)
        if place.available:
            return place
        reasons.append(place.why_not)
    if not reasons:
        reasons.append(f"this process is in no {controller} cgroup")
    return CapPlace(None, why_not="; ".join(reasons))


def _v2_place(root: Path, path: str, controller: str = "memory") -> CapPlace:
    mount = v2_mount(root)
    if mount is None:
        return CapPlace(None, why_not=f"no cgroup v2 hierarchy is mounted at {root}")
    own = mount / path.lstrip("/")
    if not own.is_dir():
        return CapPlace(None, why_not=f"this process's cgroup v2 {path} is not under {mount}")
    base = own if own == mount else own.parent
    handed_down = _words(base / "cgroup.subtree_control")
    if controller not in handed_down:
        return CapPlace(
            None,
            why_not=(
                f"cgroup v2 does not hand the {controller} controller down from {base} "
                "(not in its cgroup.subtree_control)"
            ),
        )
    if (refused := v2_not_ours(mount, base)) is not None:
        return CapPlace(None, why_not=refused)
    return CapPlace(CGROUP_V2, parent=base / PARENT_NAME, home=own)


def v2_not_ours(mount: Path, base: Path) -> str | None:
    """Why claims' cgroups may not be made under cgroup v2's ``base``; ``None`` if they may."""
    if not (_may_write(base) and _may_write(base / "cgroup.procs")):
        return (
            f"cgroup v2's {base} is not delegated to this user (it may not make "
            "cgroups there, or move processes between them)"
        )
    return _changed_by_others(mount, base)


def _v1_place(root: Path, path: str, controller: str = "memory") -> CapPlace:
    mount = root / controller
    own = mount / path.lstrip("/")
    if not (own / _V1_MARK[controller]).exists():
        return CapPlace(
            None,
            why_not=f"this process's cgroup v1 {controller} cgroup {path} is not under {mount}",
        )
    if not (_may_write(own) and _may_write(own / "cgroup.procs")):
        return CapPlace(
            None,
            why_not=(
                f"this user may not make cgroups under its cgroup v1 {controller} cgroup {own}"
            ),
        )
    if (shared := _changed_by_others(mount, own)) is not None:
        return CapPlace(None, why_not=shared)
    if KERNEL_NAME.match(own.name):
        # v1 counts a child's memory in its parent's: a claim under the
        # kernel's kernel_ram cgroup would be held to the kernel's cap. Beside
        # it, in the provisioner's directory, it is held to its own. (On v2
        # the claims already go beside the process's own cgroup.)
        return CapPlace(CGROUP_V1, parent=own.parent, home=own)
    return CapPlace(CGROUP_V1, parent=own / PARENT_NAME, home=own)


def in_a_kernel_cgroup(place: CapPlace) -> bool:
    """Whether this process is a kernel held by its ``kernel_ram`` cgroup."""
    return place.home is not None and KERNEL_NAME.match(place.home.name) is not None


def _may_write(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _changed_by_others(mount: Path, directory: Path) -> str | None:
    """Why another user could swap a claim cgroup made below ``directory``; None if nobody can."""
    me = os.geteuid()
    for each in [directory, *directory.parents]:
        try:
            found = os.stat(each)
        except OSError as error:
            return f"{each} cannot be checked: {error.strerror}"
        if found.st_uid not in (0, me) or found.st_mode & 0o022:
            return (
                f"{each} may be changed by other users (owner uid {found.st_uid}, mode "
                f"{stat.S_IMODE(found.st_mode):o}), who could put a cgroup of their own, "
                "with no limit, where a claim's would be"
            )
        if each == mount:
            return None
    return None


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


# -----------------------------------------------------------------------------
# Which one is in force
# -----------------------------------------------------------------------------


WATCHED = f"watched every {SAMPLE_INTERVAL_S:g} s"

_places: dict[tuple[Path, Path, str], CapPlace] = {}
_places_lock = threading.Lock()


def cap_place(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP, controller: str = "memory"
) -> CapPlace:
    """:func:`find_cap_place`, found once per process: the answer cannot change under it."""
    key = (root, proc_cgroup, controller)
    with _places_lock:
        if key not in _places:
            _places[key] = find_cap_place(root, proc_cgroup, controller)
        return _places[key]


def memory_enforcement(settings: Settings, place: CapPlace | None = None) -> Enforcement:
    """What would hold a claim's ``ram=`` here: the kernel's cap, or the sampler."""
    if not settings.memory_cap:
        return Enforcement(WATCHED, SAMPLER, "the memory cap is turned off (memory_cap in config)")
    place = cap_place() if place is None else place
    if not place.available:
        return Enforcement(WATCHED, SAMPLER, place.why_not)
    assert place.version is not None
    return Enforcement(f"enforced ({place.version})", place.version)


def sampled(why: str) -> Enforcement:
    """The sampler in force for one claim, and why no cap is."""
    return Enforcement(WATCHED, SAMPLER, why)


# -----------------------------------------------------------------------------
# One claim's cgroup
# -----------------------------------------------------------------------------


class CapNotMade(OSError):
    """A claim cgroup could not be made or limited; the sampler holds the claim instead."""


_claim_numbers = itertools.count(1)


class ClaimCgroup:
    """One claim's memory cgroup, from :meth:`make` to :meth:`remove`.

    Any thread may call any method; removal is idempotent.
    """

    def __init__(
        self, path: Path, version: str, home: Path, budget_bytes: int, controller: str = "memory"
    ) -> None:
        self.path = path
        self.version = version
        self.home = home
        self.budget_bytes = budget_bytes
        #: ``"memory"``, or ``"cpu"`` for a quota-only cgroup in v1's cpu hierarchy.
        self.controller = controller
        #: What the first process moved in held as it came, uncharged here.
        self.baseline_bytes = 0
        self._limited = False
        self._removed = False
        self._lock = threading.Lock()

    @classmethod
    def make(cls, place: CapPlace, budget_bytes: int, kernel: bool = False) -> ClaimCgroup:
        """A fresh cgroup limited to ``budget_bytes`` with swap off; raises :class:`CapNotMade`.

        ``kernel``: a kernel's ``kernel_ram`` cgroup (:data:`KERNEL_NAME`), not a claim's.
        """
        made = cls._new(place, budget_bytes, "memory", kernel)
        try:
            made._limit(budget_bytes)
            made._swap_off()
        except OSError as error:
            made.remove()
            raise CapNotMade(f"{made.path} could not be limited: {error.strerror}") from None
        return made

    @classmethod
    def make_uncapped(cls, place: CapPlace) -> ClaimCgroup:
        """A fresh memory cgroup with no limit: a claim with no ``ram=`` out of its kernel's cap."""
        made = cls._new(place, 0, "memory")
        made._limited = True
        return made

    @classmethod
    def make_quota(cls, place: CapPlace, cpus: int) -> ClaimCgroup:
        """A fresh cgroup whose processes get ``cpus`` cores' worth of time; :class:`CapNotMade`."""
        made = cls._new(place, 0, "cpu")
        try:
            made.limit_cpus(cpus)
        except OSError as error:
            made.remove()
            raise CapNotMade(f"{made.path} could not be limited: {error.strerror}") from None
        return made

    @classmethod
    def _new(
        cls, place: CapPlace, budget_bytes: int, controller: str, kernel: bool = False
    ) -> ClaimCgroup:
        assert place.parent is not None and place.home is not None and place.version is not None
        try:
            _make_parent(place, controller)
        except OSError as error:
            raise CapNotMade(f"{place.parent} could not be made: {error.strerror}") from None
        sweep_stale(place.parent)
        pid = os.getpid()
        kind = "kernel-" if kernel else ""
        name = f"fluksio_nb-{kind}{pid}-{process_start(pid)}-{next(_claim_numbers)}"
        made = cls(place.parent / name, place.version, place.home, budget_bytes, controller)
        try:
            made.path.mkdir()
        except OSError as error:
            raise CapNotMade(f"{made.path} could not be made: {error.strerror}") from None
        return made

    def limit_cpus(self, cpus: int) -> None:
        """At most ``cpus`` cores' worth of time per period, for all its processes together.

        On cgroup v2 a claim's one cgroup holds its memory limit and its quota
        both: a process is in one v2 cgroup only.
        """
        quota = max(1, cpus) * CPU_PERIOD_US
        if self.version == CGROUP_V1:
            write_cgroup_file(self.path / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            write_cgroup_file(self.path / "cpu.cfs_quota_us", str(quota))
        else:
            if "cpu" not in _words(self.path.parent / "cgroup.subtree_control"):
                write_cgroup_file(self.path.parent / "cgroup.subtree_control", "+cpu")
            write_cgroup_file(self.path / "cpu.max", f"{quota} {CPU_PERIOD_US}")

    def admit(self, pid: int, held_bytes: int = 0) -> None:
        """Move ``pid`` (all its threads) in; ``held_bytes`` is what it holds as it comes."""
        self.settle(held_bytes)
        write_cgroup_file(self.path / "cgroup.procs", str(pid))

    def settle(self, held_bytes: int) -> None:
        """Before the first process comes in: the limit, less what it holds uncharged.

        That memory stays charged where it was (see the module's docstring).
        Only the first counts: once processes are in, the cgroup's own
        charges say what the claim holds.
        """
        with self._lock:
            if self._limited or self.controller != "memory":
                return
            self._limited = True
            self.baseline_bytes = held_bytes
            if held_bytes:
                with contextlib.suppress(OSError):
                    self._limit(max(_SMALLEST_LIMIT, self.budget_bytes - held_bytes))

    def enter_from_child(self) -> None:
        """For ``preexec_fn``: move the calling process in, before it runs anything."""
        fd = os.open(self.path / "cgroup.procs", os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    def let_go(self, pid: int) -> None:
        """Move ``pid`` back to the kernel's own cgroup; a process already gone is let go."""
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            write_cgroup_file(self.home / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        """How many processes the kernel's out-of-memory killer ended in this cgroup."""
        name = "memory.oom_control" if self.version == CGROUP_V1 else "memory.events"
        return key_values(self.path / name).get("oom_kill", 0)

    def peak_bytes(self) -> int | None:
        """The most the claim's processes held: the cgroup's peak and what came in uncharged."""
        name = "memory.max_usage_in_bytes" if self.version == CGROUP_V1 else "memory.peak"
        peak = _number(self.path / name)
        return None if peak is None else peak + self.baseline_bytes

    def pids(self) -> list[int]:
        return cgroup_pids(self.path)

    def remove(self) -> None:
        """Kill whatever is still in it, and remove it. Safe to call twice."""
        with self._lock:
            if self._removed:
                return
            self._removed = True
        remove_cgroup(self.path)

    def _limit(self, limit: int) -> None:
        if self.version == CGROUP_V1:
            memsw = self.path / "memory.memsw.limit_in_bytes"
            # memsw may never be below the plain limit: lowered, the plain one
            # goes first; raised, memsw does.
            current = _number(self.path / "memory.limit_in_bytes")
            order = ["memory.limit_in_bytes", memsw.name]
            if current is not None and limit > current:
                order.reverse()
            for name in order:
                if name == memsw.name and not memsw.exists():
                    continue
                write_cgroup_file(self.path / name, str(limit))
        else:
            write_cgroup_file(self.path / "memory.max", str(limit))

    def _swap_off(self) -> None:
        if self.version == CGROUP_V1:
            # Refused on some kernels for a cgroup below one with use_hierarchy;
            # the memsw limit above holds swap off there.
            with contextlib.suppress(OSError):
                write_cgroup_file(self.path / "memory.swappiness", "0")
        else:
            with contextlib.suppress(FileNotFoundError):
                write_cgroup_file(self.path / "memory.swap.max", "0")


def _make_parent(place: CapPlace, controller: str = "memory") -> None:
    assert place.parent is not None
    with contextlib.suppress(FileExistsError):
        place.parent.mkdir()
    # Ours, and holding no process: under v2 it may hand the controller down to the claims.
    handed_down = _words(place.parent / "cgroup.subtree_control")
    # cgroup v2 holds devices by a program on the cgroup, no controller to hand down.
    if place.version == CGROUP_V2 and controller != "devices" and controller not in handed_down:
        write_cgroup_file(place.parent / "cgroup.subtree_control", f"+{controller}")


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the claim cgroups under ``parent`` whose kernel is gone; those removed.

    A kernel that is gone is one whose pid no longer names a process started
    when the name says: a pid can be given to somebody else's process since.
    Every claim sweeps, so it costs what is stale, not what is there: one
    listing, no look at this process's own (it lives, and removes each as its
    claim ends), and one read of ``/proc`` per other owner, however many
    cgroups it has there.
    """
    removed: list[Path] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    me = os.getpid()
    alive = {(me, _own_start(me)): True}
    for name in names:
        match = CLAIM_NAME.match(name) or KERNEL_NAME.match(name)
        if match is None:
            continue
        owner = int(match[1]), int(match[2])
        if owner not in alive:
            alive[owner] = process_start(owner[0]) == owner[1]
        if alive[owner]:
            continue
        if remove_cgroup(parent / name, _SWEEP_GRACE_S):
            removed.append(parent / name)
    return removed


@functools.cache
def _own_start(pid: int) -> int | None:
    """:func:`process_start` of this process, keyed by pid: a forked child reads its own."""
    return process_start(pid)


def process_start(pid: int, proc: Path = Path("/proc")) -> int | None:
    """When ``pid`` started, in clock ticks after boot; ``None`` if there is no such process."""
    try:
        data = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


# -----------------------------------------------------------------------------
# Files
# -----------------------------------------------------------------------------


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def key_values(path: Path) -> dict[str, int]:
    """A cgroup file of ``key value`` lines (``memory.stat``), as numbers; ``{}`` if unreadable."""
    found = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            found[key] = int(value)
    return found
