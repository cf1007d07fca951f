"""Cores the kernel holds: a claim's processes in a cpuset of its cores, where one can be made.

A claim's own cores are first given by affinity (:func:`fluksio_nb.inventory.confine_tree`).
Affinity is the process's own to change: a claimed cell that calls
``os.sched_setaffinity(0, range(os.cpu_count()))``, itself or in a library,
runs on every core, another user's claim's included. A cpuset is the
kernel's: inside one, ``sched_setaffinity`` only ever gets the cpuset's
cores, whatever it asks for. So where this process may make a cpuset
cgroup, every claim with cores of its own runs in one holding just those
cores, and its status says "cpuset"; elsewhere it says affinity, and why.

What it decides:

- **Where, and only where nobody else can change it**: as the memory caps
  are (:func:`fluksio_nb.memory_cap.find_cap_place` with the ``cpuset``
  controller): cgroup v1's cpuset hierarchy under the process's own cpuset
  cgroup (root, on most machines), or beside the kernel in a delegated v2
  subtree that hands ``cpuset`` down. The same names, sweep of a dead
  kernel's leftovers, and removal (its processes killed, then ``rmdir``) as
  :class:`~fluksio_nb.memory_cap.ClaimCgroup`, which the cpuset is one of.
- **One v2 cgroup per claim.** A process is in one v2 cgroup only, so on v2
  the cores go in the claim's memory cgroup when it has one, as a CPU quota
  does; v1's hierarchies are separate, and the cpuset is a cgroup of its own.
- **A v1 cpuset is born empty**, and one without cores or memory nodes takes
  no process. The ``fluksio_nb`` directory is given its parent's cores and
  nodes; each claim its cores and the nodes of the directory above it. The
  books hand out cores, not memory nodes: a claim's pages may be on any node
  its kernel's may, as before.
- **Entering sets every thread's affinity**: the kernel moves all of a
  process's threads with it and narrows each to the cpuset's cores. Leaving
  for the kernel's own cpuset widens them back to every core, the reserve
  included, so a warm worker going back to the pool is put back on the cores
  it had (:meth:`fluksio_nb.confinement.Confinement.let_go`).

Making, filling and removing one costs 0.3 ms, and moving a warm worker in,
out and back onto its cores 0.1 ms (measured on cgroup v1, two cores), paid
only by claims with cores of their own.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from fluksio_nb.budget import CGROUP_V1, CGROUP_V2
from fluksio_nb.claim_cgroups import write_cgroup_file
from fluksio_nb.enforcement import CPUSET, Enforcement, own_cores
from fluksio_nb.inventory import CGROUP_ROOT, PROC_SELF_CGROUP, format_cpu_list
from fluksio_nb.memory_cap import (
    CapNotMade,
    CapPlace,
    ClaimCgroup,
    _words,
    cap_place,
)

#: Where a cpuset's memory nodes, and its cores, are read, in order: what it
#: was given, then what it has (v1's name, v2's), since a v2 cgroup given
#: nothing says nothing.
_MEMS = ("cpuset.mems", "cpuset.effective_mems", "cpuset.mems.effective")
_CPUS = ("cpuset.cpus", "cpuset.effective_cpus", "cpuset.cpus.effective")


def cpuset_place(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> CapPlace:
    """Where this process may make claim cpusets, or why it may not; found once."""
    return cap_place(root, proc_cgroup, controller="cpuset")


def cores_held_here(place: CapPlace | None = None) -> Enforcement:
    """What would hold a claim with cores of its own here: a cpuset, or affinity and why."""
    place = cpuset_place() if place is None else place
    if place.available:
        return own_cores(CPUSET)
    return by_affinity(place.why_not)


def by_affinity(why_no_cpuset: str) -> Enforcement:
    """Own cores held by affinity alone, saying why no cpuset holds them."""
    return own_cores(
        why=f"no cpuset holds them, so a cell may move itself onto other cores: {why_no_cpuset}"
    )


def hold_cores(place: CapPlace, cores: frozenset[int], cap: ClaimCgroup | None) -> ClaimCgroup:
    """The claim's cgroup holding it to ``cores``: its v2 memory cgroup, or one of its own.

    Raises :class:`~fluksio_nb.memory_cap.CapNotMade`, having left nothing behind.
    """
    if cap is not None and cap.version == place.version == CGROUP_V2:
        try:
            if "cpuset" not in _words(cap.path.parent / "cgroup.subtree_control"):
                write_cgroup_file(cap.path.parent / "cgroup.subtree_control", "+cpuset")
            _give_cores(cap.path, cores)
        except OSError as error:
            # The memory cap stands; only the cores go back to affinity, and
            # v2's empty list is the parent's cores, as the status will say.
            with contextlib.suppress(OSError):
                write_cgroup_file(cap.path / "cpuset.cpus", "\n")
            raise CapNotMade(
                f"{cap.path} could not be held to its cores: {error.strerror or error}"
            ) from None
        return cap
    # Made as a memory cgroup is, swept and named the same, with no budget.
    made = ClaimCgroup._new(place, 0, "cpuset")
    try:
        if place.version == CGROUP_V1:
            assert place.parent is not None
            _fill_if_empty(place.parent)
        _give_cores(made.path, cores)
    except OSError as error:
        made.remove()
        raise CapNotMade(
            f"{made.path} could not be held to its cores: {error.strerror or error}"
        ) from None
    return made


def _fill_if_empty(parent: Path) -> None:
    """Give v1's ``fluksio_nb`` directory its own parent's cores and nodes, once."""
    for names in (_CPUS, _MEMS):
        if not _first_of(parent, names[:1]):
            write_cgroup_file(parent / names[0], _first_of(parent.parent, names))


def _give_cores(path: Path, cores: frozenset[int]) -> None:
    write_cgroup_file(path / "cpuset.cpus", format_cpu_list(cores))
    mems = _first_of(path.parent, _MEMS)
    if not mems:
        raise CapNotMade(f"{path.parent} says of no memory node its processes may use")
    write_cgroup_file(path / "cpuset.mems", mems)


def _first_of(directory: Path, names: tuple[str, ...]) -> str:
    for name in names:
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return ""
