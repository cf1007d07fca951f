"""What this machine has to hand out, as this process is allowed to see it.

``os.cpu_count()`` and the host's RAM are the wrong answers on most shared
machines. A JupyterHub pod with a two-core quota on a 64-core node reports 64,
and a batch job pinned to four cores by ``taskset`` or Slurm reports every
core of the box. Handing out shares of cores the process cannot run on is the
oversubscription this project exists to stop, so each number here is the
smallest of every limit that applies:

- cores: the CPU count, the process's affinity mask, and the cgroup quota
  (v2 ``cpu.max``, or v1 ``cfs_quota_us / cfs_period_us``), rounded up,
  because a 1.5-core quota can still run two threads;
- memory: the host's total and the cgroup limit (v2 ``memory.max``, v1
  ``memory.limit_in_bytes``);
- GPUs: as :mod:`fluksio_nb.gpus` finds them.

A declared inventory (``FLUKSIO_CPUS``/``GPUS``/``RAM`` or the config file)
replaces detection outright. Tests and demos use it to declare cards on a
machine that has none.

"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from fluksio_nb.gpus import Gpu, GpuId, detect_gpus

if TYPE_CHECKING:
    from fluksio_nb.settings import Settings

#: Where the cgroup filesystems are mounted. A parameter everywhere below, so
#: that tests can point at a tree of real files they wrote.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
#: Where Linux lists the NUMA nodes and each one's cores.
NODE_ROOT = Path("/sys/devices/system/node")

#: What cgroup v1 writes for "no limit": the largest page-aligned signed 64-bit
#: value. Anything this large is not a limit anybody set.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Inventory:
    """The machine, as far as claims are concerned.

    ``cpus`` and ``ram_bytes`` are what claims may take: the detected (or
    declared) amount less the reserve for the kernel and the server, and less
    the host headroom that the halt rule keeps free. ``machine_cpus`` is
    everything this process may run on, and is what CPU readings are a share of.
    """

    cpus: int
    machine_cpus: int
    ram_bytes: int
    machine_ram_bytes: int
    gpus: tuple[Gpu, ...] = ()
    #: Where each number came from, for ``%claims`` and bug reports.
    sources: dict[str, str] = field(default_factory=dict)
    #: The cores claimed work runs on: this process's, less the reserved ones.
    #: ``None`` when nothing is left over to keep back.
    worker_cores: frozenset[int] | None = None
    #: The core ids the books hand out, one per claimable cpu, so that each
    #: claim runs on cores of its own. Empty when there are more claimable
    #: cpus than cores to pin them to (a declared inventory larger than the
    #: machine): claims then share :attr:`worker_cores`.
    core_ids: tuple[int, ...] = ()
    #: Which NUMA node each of :attr:`core_ids` is on; empty on one node.
    core_nodes: dict[int, int] = field(default_factory=dict)

    @property
    def gpu_ids(self) -> tuple[GpuId, ...]:
        return tuple(gpu.index for gpu in self.gpus)

    def for_books(self) -> dict[str, Any]:
        """What the books are kept over, as a books service and a snapshot carry it."""
        return {
            "cpus": self.cpus,
            "gpu_ids": list(self.gpu_ids),
            "ram_bytes": self.ram_bytes,
            "core_ids": list(self.core_ids),
            "core_nodes": {str(core): node for core, node in self.core_nodes.items()},
        }


# -----------------------------------------------------------------------------
# Cores
# -----------------------------------------------------------------------------


def cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """Each controller's cgroup path for this process; ``""`` is the v2 one."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


#: ``fluksio_nb-kernel-<server pid>-<its start time>-<n>``: an unclaimed kernel's
#: ``kernel_ram`` cgroup, made by the provisioner (:mod:`fluksio_nb.kernel_ram`).
KERNEL_NAME = re.compile(r"^fluksio_nb-kernel-(\d+)-(\d+)-(\d+)$")


def _memory_paths(proc_cgroup: Path) -> dict[str, str]:
    """:func:`cgroup_paths`, as the machine's memory is seen for claims.

    A kernel held to the admin's ``kernel_ram`` sees the machine as the
    server it was started by does: its claims run beside its cap, not under
    it, and an inventory of a machine with 8G would otherwise be one of the
    kernel's 8G.
    """
    paths = cgroup_paths(proc_cgroup)
    for controller in ("", "memory"):
        path = paths.get(controller)
        if path is not None and KERNEL_NAME.match(path.rsplit("/", 1)[-1]):
            paths[controller] = path.rsplit("/", 1)[0] or "/"
    return paths


def _walk_up(base: Path, path: str) -> list[Path]:
    """The cgroup's directory and every ancestor's, nearest first.

    A limit set on a parent applies to the children too, and the tightest one
    anywhere on the way up is the one in force.
    """
    here = base / path.lstrip("/")
    dirs = []
    while True:
        dirs.append(here)
        if here == base or base not in here.parents:
            break
        here = here.parent
    return dirs


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cgroup_cpu_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> float | None:
    """The cgroup CPU quota in cores, or ``None`` when there is none."""
    paths = cgroup_paths(proc_cgroup)
    limits: list[float] = []
    if "" in paths:
        for directory in _walk_up(root, paths[""]):
            text = _read(directory / "cpu.max")
            if text:
                quota, _, period = text.partition(" ")
                if quota != "max" and period:
                    limits.append(int(quota) / int(period))
    for controller in ("cpu", "cpu,cpuacct"):
        if controller not in paths:
            continue
        for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
            for directory in _walk_up(mount, paths[controller]):
                quota = _read(directory / "cpu.cfs_quota_us")
                period = _read(directory / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0:
                    limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def usable_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> int:
    """Cores this process may actually run on: the tightest of every limit."""
    candidates = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):
        candidates.append(len(os.sched_getaffinity(0)))
    quota = cgroup_cpu_limit(root, proc_cgroup)
    if quota is not None:
        candidates.append(max(1, math.ceil(quota)))
    return max(1, min(candidates))


def cores_past_reserve(reserve: int) -> frozenset[int] | None:
    """This process's cores less the ``reserve`` lowest-numbered; ``None`` if none remain.

    Claimed work is confined to these, so that the reserve is a real core the
    kernel, the server and the browser can always run on. A thread count in
    the environment only keeps well-behaved libraries in their share; the
    kernel stayed slow to answer while four one-core claims ran beside it,
    because every worker was still free to run on the kernel's core. The
    lowest numbers are kept back because core 0 is where Linux tends to steer
    interrupts, which the claimed work is better off without.
    """
    if reserve <= 0 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= reserve:
        return None
    return frozenset(cores[reserve:])


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"``, as the kernel writes core lists, as core ids."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def format_cpu_list(cores: Iterable[int]) -> str:
    """Core ids as the kernel writes them: ``"0-3,8"``."""
    runs: list[list[int]] = []
    for core in sorted(set(cores)):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def numa_nodes(root: Path = NODE_ROOT) -> dict[int, int]:
    """Which NUMA node each core is on; empty where the kernel shows one node or none.

    A claim's threads that share a node share its memory controller and its
    last-level cache; spread over two, every other access crosses the
    interconnect. The books use this to keep a claim's cores on one node.
    """
    node_of: dict[int, int] = {}
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return node_of
    for entry in entries:
        number = entry.name.removeprefix("node")
        if not entry.name.startswith("node") or not number.isdigit():
            continue
        listed = _read(entry / "cpulist")
        if listed is None:
            continue
        try:
            cores = parse_cpu_list(listed)
        except ValueError:
            continue
        for core in cores:
            node_of[core] = int(number)
    return node_of if len(set(node_of.values())) > 1 else {}


def claimable_core_ids(affinity: Iterable[int], reserve: int, cpus: int) -> tuple[int, ...]:
    """The ``cpus`` cores the books hand out: the process's, past the reserve.

    The reserve is the lowest-numbered, as for :func:`cores_past_reserve`. A
    quota smaller than the affinity hands out the first ``cpus`` of the rest.
    With fewer cores than claimable cpus there is nothing to pin to, and
    the answer is empty.
    """
    cores = sorted(affinity)
    past = cores[reserve:] if len(cores) > reserve else cores
    return tuple(past[:cpus]) if len(past) >= cpus else ()


#: Whether this kernel lists a task's children in /proc (Linux 3.5 and later,
#: with CONFIG_PROC_CHILDREN, which every mainstream distribution sets).
_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, by asking the kernel for each one's children.

    psutil finds children by reading the parent of every process on the
    machine, a few milliseconds on a busy host, paid on every claimed cell
    (3.7 ms of a warm trivial one's 12, measured on a quiet two-core machine)
    and on every reading of a running claim;
    ``/proc/<pid>/task/<tid>/children`` names them directly.
    """
    return [each for each in _family_threads(pid) if each != pid]


def _family_threads(pid: int) -> dict[int, list[int]]:
    """``pid`` and every live process below it, each with its threads' ids.

    Each process's threads are listed once, for finding its children and for
    whoever needs the threads themselves: listing a process's tasks in /proc
    is the slowest part of the walk.
    """
    if not _PROC_CHILDREN:
        try:
            below = [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            below = []
        return {each: threads for each in [pid, *below] if (threads := _threads(each))}
    family: dict[int, list[int]] = {}
    pending = [pid]
    while pending:
        parent = pending.pop()
        threads = _threads(parent)
        if not threads:
            continue  # gone since its parent listed it
        family[parent] = threads
        for task in threads:
            # A file object, not a bare descriptor: one the stop button lands on
            # as it is opened is closed as it is dropped.
            try:
                with open(f"/proc/{parent}/task/{task}/children", "rb", buffering=0) as file:
                    listing = file.read()
            except OSError:
                continue  # a thread that ended since the listing
            if listing:
                pending += [int(child) for child in listing.split()]
    return family


def _threads(pid: int) -> list[int]:
    """The ids of ``pid``'s threads; none once it has gone."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def confine_tree(pid: int, cores: Iterable[int]) -> list[int]:
    """Run process ``pid``, everything it started and every thread of each, on ``cores``.

    What they start from now on inherits it. A process that has gone needs
    no confining. Returns the processes found: ``pid`` and its descendants.
    """
    wanted = frozenset(cores)
    family = _family_threads(pid)
    for threads in family.values():
        _confine_each(threads, wanted)
    return [pid, *(each for each in family if each != pid)]


def confine(pid: int, cores: frozenset[int] | None) -> None:
    """Run ``pid`` (and what it starts from now on) only on ``cores``.

    A process that has already gone needs no confining.
    """
    if cores is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.sched_setaffinity(pid, cores)


def confine_threads(pid: int, cores: frozenset[int]) -> int:
    """Run every thread ``pid`` has now only on ``cores``; how many were confined.

    ``sched_setaffinity`` on a pid moves one thread, the main one; a process
    that has already started its BLAS pool or its ZMQ threads keeps them
    where they were. Each thread in ``/proc/<pid>/task`` is moved instead,
    and threads it starts later inherit the mask of the thread starting them.
    Its child processes are left alone: they may hold cores of their own.
    A thread or process that has ended meanwhile needs no confining.
    """
    return _confine_each(_threads(pid), cores)


def _confine_each(threads: list[int], cores: frozenset[int]) -> int:
    confined = 0
    for tid in threads:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(tid, cores)
            confined += 1
    return confined


# -----------------------------------------------------------------------------
# Memory
# -----------------------------------------------------------------------------


def cgroup_memory_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> int | None:
    """The cgroup memory limit in bytes, or ``None`` when there is none."""
    paths = _memory_paths(proc_cgroup)
    limits: list[int] = []
    if "" in paths:
        for directory in _walk_up(root, paths[""]):
            text = _read(directory / "memory.max")
            if text and text != "max":
                limits.append(int(text))
    if "memory" in paths:
        for directory in _walk_up(root / "memory", paths["memory"]):
            text = _read(directory / "memory.limit_in_bytes")
            if text and int(text) < _V1_UNLIMITED:
                limits.append(int(text))
    return min(limits) if limits else None


def host_memory(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> tuple[int, int]:
    """Total and available memory, as this process's cgroup sees them.

    Inside a container the host may have 200 GB free while the cgroup has
    200 MB left; the cgroup is what the OOM killer acts on, so it wins.
    """
    if root == CGROUP_ROOT and proc_cgroup == PROC_SELF_CGROUP:
        return _own_memory().read()
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    limit = cgroup_memory_limit(root, proc_cgroup)
    if limit is not None and limit < total:
        used = _cgroup_memory_used(root, proc_cgroup)
        total = limit
        if used is not None:
            available = min(available, max(0, limit - used))
    return total, min(available, total)


class _OwnMemory:
    """:func:`host_memory` for this process, from files opened once and reread in place.

    The sampling thread asks twice a second. Asked by path, each time, it was
    130 µs: ``/proc/self/cgroup`` read twice, every ancestor's limit file
    looked up and opened, all of ``/proc/meminfo`` parsed by psutil. Which
    files apply cannot change while the process stays in its cgroup, so they
    are found once; what they say is read again on every call, one ``pread``
    each (a limit can be changed at any time), about 15 µs in all.
    """

    def __init__(self, root: Path, proc_cgroup: Path) -> None:
        paths = _memory_paths(proc_cgroup)
        limits, used = [], []
        if "" in paths:
            limits += [directory / "memory.max" for directory in _walk_up(root, paths[""])]
            used.append(root / paths[""].lstrip("/") / "memory.current")
        if "memory" in paths:
            v1 = root / "memory"
            limits += [d / "memory.limit_in_bytes" for d in _walk_up(v1, paths["memory"])]
            used.append(v1 / paths["memory"].lstrip("/") / "memory.usage_in_bytes")
        # File objects, not bare descriptors: one the stop button lands on as
        # it is opened is closed as it is dropped.
        self._meminfo = open("/proc/meminfo", "rb", buffering=0)  # noqa: SIM115
        self._limits = [file for file in map(_open_or_none, limits) if file is not None]
        self._used = [file for file in map(_open_or_none, used) if file is not None]

    def read(self) -> tuple[int, int]:
        info = os.pread(self._meminfo.fileno(), 16384, 0)
        total, available = _meminfo(info, b"MemTotal:"), _meminfo(info, b"MemAvailable:")
        if total is None or available is None:  # a kernel older than 3.14
            vm = psutil.virtual_memory()
            total, available = int(vm.total), int(vm.available)
        limit = None
        for file in self._limits:
            text = _pread(file)
            if text and text != b"max" and int(text) < _V1_UNLIMITED:
                limit = int(text) if limit is None else min(limit, int(text))
        if limit is not None and limit < total:
            total = limit
            for file in self._used:
                text = _pread(file)
                if text:
                    available = min(available, max(0, limit - int(text)))
                    break
        return total, min(available, total)


_own: _OwnMemory | None = None


def _own_memory() -> _OwnMemory:
    global _own
    if _own is None:
        # Two threads making one each at once leave a few descriptors open; harmless.
        _own = _OwnMemory(CGROUP_ROOT, PROC_SELF_CGROUP)
    return _own


def _open_or_none(path: Path) -> io.FileIO | None:
    try:
        return open(path, "rb", buffering=0)
    except OSError:
        return None


def _pread(file: io.FileIO) -> bytes:
    try:
        return os.pread(file.fileno(), 64, 0).strip()
    except OSError:
        return b""


def _meminfo(info: bytes, name: bytes) -> int | None:
    start = info.find(name)
    if start < 0:
        return None
    return int(info[start + len(name) : info.index(b"\n", start)].split()[0]) * 1024


def _cgroup_memory_used(root: Path, proc_cgroup: Path) -> int | None:
    paths = _memory_paths(proc_cgroup)
    if "" in paths:
        text = _read(root / paths[""].lstrip("/") / "memory.current")
        if text:
            return int(text)
    if "memory" in paths:
        text = _read(root / "memory" / paths["memory"].lstrip("/") / "memory.usage_in_bytes")
        if text:
            return int(text)
    return None


def system_headroom_bytes(total_bytes: int) -> int:
    """Memory kept free for the host: a tenth of it, or 1 GiB, whichever is more.

    The same rule decides when a claim is halted because the host ran short,
    so it is also taken off what the books hand out: a claim granted the last
    byte of RAM would be halted for using it.
    """
    return int(max(total_bytes * 0.10, 1 << 30))


# -----------------------------------------------------------------------------
# All of it
# -----------------------------------------------------------------------------


def take_inventory(settings: Settings) -> Inventory:
    """What claims may take here: declared where declared, detected elsewhere."""
    sources: dict[str, str] = {}

    if settings.cpus is not None:
        machine_cpus, sources["cpus"] = settings.cpus, "declared"
    else:
        machine_cpus, sources["cpus"] = usable_cpus(), "detected"
    # At least one core is always claimable: a reserve larger than the machine
    # would otherwise make every claim wait forever.
    cpus = max(1, machine_cpus - settings.reserve_cpus)

    if settings.ram is not None:
        machine_ram, sources["ram"] = int(settings.ram), "declared"
        ram = machine_ram
    else:
        machine_ram, _ = host_memory()
        sources["ram"] = "detected"
        ram = max(0, machine_ram - system_headroom_bytes(machine_ram))

    if settings.gpus is not None:
        gpus = [Gpu(index=index, name="declared") for index in range(settings.gpus)]
        sources["gpus"] = "declared"
    else:
        found, sources["gpus"] = detect_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
        gpus = found

    return Inventory(
        cpus=cpus,
        machine_cpus=machine_cpus,
        ram_bytes=ram,
        machine_ram_bytes=machine_ram,
        gpus=tuple(gpus),
        sources=sources,
        # Without pinning, claims are held by their thread variables alone,
        # the reserve included.
        worker_cores=cores_past_reserve(settings.reserve_cpus) if settings.pin_cores else None,
        core_ids=(
            claimable_core_ids(_affinity(), settings.reserve_cpus, cpus)
            if settings.pin_cores
            else ()
        ),
        core_nodes=numa_nodes(),
    )


def _affinity() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))
