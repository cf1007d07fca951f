"""Readings of a claim's worker: its memory and CPU, and the host's memory.

The sampler is pointed at the worker's pid, never at the kernel: the kernel
holds the user's data, the widget and the sampler itself, and none of that is
the claim's. It reads the worker's whole process tree, because a cell that
runs ``!python train.py`` or starts a ``multiprocessing`` pool does its work
in children, and a reading of the worker alone would show an idle process
while the machine ran out of memory.

- Memory is the sum of the tree's resident sets. Pages shared between a
  parent and its forked children are counted once per process, so this can
  overstate; it never understates, which is the safe side for a budget.
- CPU is the tree's CPU seconds between two readings, divided by the wall
  time and by the machine's cores. 100 means every core this process may
  run on was busy. A child that came and went between two readings still
  counts, through its parent's ``children_*`` times; per-process
  ``cpu_percent`` would lose it.
- The host's memory is read in the same call, so a halt decision never
  compares a reading from now with a free-memory figure from seconds ago.

The cadence is half a second: quick enough that a runaway allocation is
caught within a second or two, slow enough that reading a few dozen
processes stays far below one percent of a core. The sampler owns no thread
and never sleeps; :meth:`Sampler.due` tells whoever drives it when to read.
A worker that has gone is a state (:attr:`Sampler.alive`), not an error,
because being killed is the normal end of a halted or interrupted cell.
"""

from __future__ import annotations

import functools
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from fluksio_nb.inventory import host_memory, usable_cpus

SAMPLE_INTERVAL_S = 0.5

#: Readings kept for the sparklines: a minute at the default cadence.
HISTORY = 120


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of a worker's process tree and of the host, taken together."""

    rss_bytes: int
    #: Share of the whole machine, 0 to 100.
    cpu_percent: float
    #: How many cores' worth of CPU the tree used: 1.9 is nearly two busy cores.
    cpu_cores: float
    processes: int
    host_total_bytes: int
    host_available_bytes: int
    at: float


class Sampler:
    """Reads one process tree at a steady cadence, on request."""

    def __init__(
        self,
        pid: int,
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
        machine_cpus: int | None = None,
        memory_probe: Callable[[], tuple[int, int]] = host_memory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self._machine_cpus = max(1, machine_cpus or _this_machines_cpus())
        self._memory_probe = memory_probe
        self._clock = clock
        self._last_at: float | None = None
        # CPU seconds seen per process, keyed with its start time so that a
        # recycled pid is a new process and not a clock that ran backwards.
        self._cpu_seen: dict[tuple[int, float], float] = {}
        self._alive = True
        try:
            self._root: psutil.Process | None = psutil.Process(pid)
        except psutil.Error:
            self._root, self._alive = None, False
        else:
            self._cpu_seen = self._cpu_seconds(self._tree() or [])
            self._cpu_at = self._clock()

    @property
    def alive(self) -> bool:
        """False once the worker has gone; nothing is left to measure then."""
        return self._alive

    def due(self, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        return self._last_at is None or now - self._last_at >= self.interval_s

    def sample(self) -> Sample | None:
        """Read now, due or not. ``None`` means the worker is gone."""
        tree = self._tree()
        if tree is None:
            self._alive = False
            return None
        rss = 0
        for process in tree:
            try:
                rss += process.memory_info().rss
            except psutil.Error:
                continue  # exited between listing and reading: it holds nothing now
        now = self._clock()
        seen = self._cpu_seconds(tree)
        used = sum(seconds - self._cpu_seen.get(key, 0.0) for key, seconds in seen.items())
        elapsed = max(now - self._cpu_at, 1e-6)
        self._cpu_seen, self._cpu_at = seen, now
        cores = max(0.0, used / elapsed)
        total, available = self._memory_probe()
        self._last_at = now
        return Sample(
            rss_bytes=rss,
            cpu_percent=round(min(100.0, 100.0 * cores / self._machine_cpus), 1),
            cpu_cores=round(cores, 2),
            processes=len(tree),
            host_total_bytes=total,
            host_available_bytes=available,
            at=now,
        )

    def poll(self) -> Sample | None:
        """Read only if the interval has passed. ``None`` also means "not yet"."""
        return self.sample() if self.due() else None

    def _tree(self) -> list[psutil.Process] | None:
        root = self._root
        if root is None:
            return None
        try:
            if not root.is_running() or root.status() == psutil.STATUS_ZOMBIE:
                return None
        except psutil.Error:
            return None
        family = [root]
        for pid in _descendants(root.pid):
            try:
                family.append(psutil.Process(pid))
            except psutil.Error:
                continue  # gone between listing and looking: it holds nothing now
        return family

    @staticmethod
    def _cpu_seconds(tree: list[psutil.Process]) -> dict[tuple[int, float], float]:
        seconds = {}
        for process in tree:
            try:
                times = process.cpu_times()
                # A child's time moves into its parent's children_* counters when
                # it is reaped, so the tree's total keeps it after the child is gone.
                seconds[(process.pid, process.create_time())] = (
                    times.user + times.system + times.children_user + times.children_system
                )
            except psutil.Error:
                continue
        return seconds


_this_machines_cpus = functools.cache(usable_cpus)


#: Whether this kernel lists a task's children in /proc (Linux 3.5 and later,
#: with CONFIG_PROC_CHILDREN, which every mainstream distribution sets).
_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, by asking the kernel for each one's children.

    psutil finds children by reading the parent of every process on the
    machine, a few milliseconds on a busy host, paid on every claimed cell;
    ``/proc/<pid>/task/<tid>/children`` names them directly.
    """
    if not _PROC_CHILDREN:
        try:
            return [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue  # gone since its parent listed it
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as listing:
                    children = [int(child) for child in listing.read().split()]
            except OSError:
                continue  # a thread that ended since the listing
            found += children
            pending += children
    return found


class Readings:
    """What a claim's samples add up to: the latest, the peak, the mean, a history."""

    def __init__(self) -> None:
        self.latest: Sample | None = None
        self.peak_rss_bytes = 0
        self._cpu_total = 0.0
        self.count = 0
        self.history: deque[Sample] = deque(maxlen=HISTORY)

    def add(self, sample: Sample) -> None:
        self.latest = sample
        self.peak_rss_bytes = max(self.peak_rss_bytes, sample.rss_bytes)
        self._cpu_total += sample.cpu_percent
        self.count += 1
        self.history.append(sample)

    @property
    def mean_cpu_percent(self) -> float:
        return round(self._cpu_total / self.count, 1) if self.count else 0.0
