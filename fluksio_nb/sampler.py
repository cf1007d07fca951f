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
- The host's memory is read in the same pass (by the watch, once for every
  claim it samples then), so a halt decision never compares a reading from
  now with a free-memory figure from seconds ago.
- A claim's cards: the card memory its tree holds on each of them, and how
  busy they are, from the pass over the cards the watch hands in
  (:mod:`fluksio_nb.gpu_usage`, at most every two seconds, so the same
  figures may stand in several readings).

Each process costs one ``pread`` of its ``/proc/<pid>/stat``, kept open
(:class:`_ProcessFiles`), and the children are listed from
``/proc/<pid>/task/*/children`` on every reading, so a child that starts
allocating is counted at the next one. Measured: a pass over eight claims
of one process each takes 20 µs a claim (it was 210 µs through psutil and
path-by-path reads of the cgroup files, two thirds of which was the host's
memory read once per claim).

A stop's grace is counted on the same reading (:class:`Chances`): a worker
waiting for a core on a crowded machine is slow, not deaf.

The cadence is half a second: quick enough that a runaway allocation is
caught within a second or two, slow enough that reading a few dozen
processes stays far below one percent of a core. The sampler owns no thread
and never sleeps; :meth:`Sampler.due` tells whoever drives it when to read.
A worker that has gone is a state (:attr:`Sampler.alive`), not an error,
because being killed is the normal end of a halted or interrupted cell.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

from fluksio_nb.gpu_usage import CardsReading, held_by
from fluksio_nb.inventory import descendants, host_memory, usable_cpus

SAMPLE_INTERVAL_S = 0.5

#: Readings kept for the sparklines: a minute at the default cadence.
HISTORY = 120


@dataclass(frozen=True, slots=True)
class CardShare:
    """One of a claim's cards in one reading: what the claim holds of it, and the card."""

    index: int
    #: Card memory held by the claim's processes.
    held_bytes: int
    #: The whole card's memory in use, by anyone, and its size.
    used_bytes: int | None
    total_bytes: int | None
    utilisation_percent: float | None


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
    #: The claim's cards, as last read; empty when it has none, or nothing reads them.
    cards: tuple[CardShare, ...] = ()
    #: The tree's first process is stopped by a signal (SIGSTOP, a debugger):
    #: it runs nothing until it is continued, and its cell says so.
    stopped: bool = False

    @property
    def gpu_bytes(self) -> int | None:
        """Card memory the tree holds on all its cards; ``None`` without a card reading."""
        return sum(card.held_bytes for card in self.cards) if self.cards else None

    @property
    def gpu_percent(self) -> float | None:
        """Mean utilisation of the claim's cards; ``None`` where no card says."""
        busy = [c.utilisation_percent for c in self.cards if c.utilisation_percent is not None]
        return round(sum(busy) / len(busy), 1) if busy else None


class Sampler:
    """Reads one process tree at a steady cadence, on request."""

    def __init__(
        self,
        pid: int,
        *,
        interval_s: float = SAMPLE_INTERVAL_S,
        machine_cpus: int | None = None,
        gpus: tuple[int, ...] = (),
        memory_probe: Callable[[], tuple[int, int]] = host_memory,
        clock: Callable[[], float] = time.monotonic,
        family: Iterable[int] | None = None,
    ) -> None:
        self.pid = pid
        self.interval_s = interval_s
        #: The cards the claim holds, whose memory its readings carry.
        self.gpus = tuple(gpus)
        self._machine_cpus = max(1, machine_cpus or _this_machines_cpus())
        self._memory_probe = memory_probe
        self._clock = clock
        self._last_at: float | None = None
        self._files = _ProcessFiles()
        # CPU seconds seen per process, keyed with its start time so that a
        # recycled pid is a new process and not a clock that ran backwards.
        self._cpu_seen: dict[tuple[int, int], float] = {}
        self._cpu_at = self._clock()
        self._alive = True
        # A caller that listed the tree just now (to confine it) passes it as
        # ``family``: listing processes is the slowest part of a reading.
        found = self._tree(family)
        if found is None:
            self._alive = False
        else:
            self._cpu_seen = {key: seconds for key, seconds, _ in found[0]}

    @property
    def alive(self) -> bool:
        """False once the worker has gone; nothing is left to measure then."""
        return self._alive

    def due(self, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        return self._last_at is None or now - self._last_at >= self.interval_s

    def sample(
        self, host: tuple[int, int] | None = None, cards: CardsReading | None = None
    ) -> Sample | None:
        """Read now, due or not. ``None`` means the worker is gone.

        ``host`` is the host's (total, available) memory when the caller has
        just read it for several samplers at once; otherwise it is read here.
        ``cards`` is the latest pass over the cards, for a claim that holds some.
        """
        found = self._tree() if self._alive else None
        if found is None:
            self._alive = False
            self._files.close()
            return None
        tree, stopped = found
        now = self._clock()
        rss, used, seen = 0, 0.0, {}
        for key, seconds, resident in tree:
            rss += resident
            seen[key] = seconds
            used += seconds - self._cpu_seen.get(key, 0.0)
        elapsed = max(now - self._cpu_at, 1e-6)
        self._cpu_seen, self._cpu_at = seen, now
        cores = max(0.0, used / elapsed)
        total, available = self._memory_probe() if host is None else host
        self._last_at = now
        return Sample(
            rss_bytes=rss,
            cpu_percent=round(min(100.0, 100.0 * cores / self._machine_cpus), 1),
            cpu_cores=round(cores, 2),
            processes=len(tree),
            host_total_bytes=total,
            host_available_bytes=available,
            at=now,
            cards=self._cards(cards, [pid for (pid, _), _, _ in tree]),
            stopped=stopped,
        )

    def _cards(self, reading: CardsReading | None, pids: list[int]) -> tuple[CardShare, ...]:
        if reading is None or not self.gpus:
            return ()
        shares = []
        for index in self.gpus:
            card = reading.card(index)
            if card is not None:
                shares.append(
                    CardShare(
                        index=index,
                        held_bytes=held_by(card, pids),
                        used_bytes=card.used_bytes,
                        total_bytes=card.total_bytes,
                        utilisation_percent=card.utilisation_percent,
                    )
                )
        return tuple(shares)

    def poll(self) -> Sample | None:
        """Read only if the interval has passed. ``None`` also means "not yet"."""
        return self.sample() if self.due() else None

    def close(self) -> None:
        """Let go of the files kept open for reading; a later sample opens them again."""
        self._files.close()

    def _tree(
        self, known: Iterable[int] | None = None
    ) -> tuple[list[tuple[tuple[int, int], float, int]], bool] | None:
        """(pid, start) key, CPU seconds and resident bytes of every live process in the
        tree, and whether its first process is stopped. ``known``: the tree's
        processes as just listed, instead of listing them here."""
        files = self._files
        root = files.read(self.pid)
        if root is None or root[0] == "Z":
            return None  # gone, or a zombie: it runs nothing and holds nothing
        family = [(self.pid, root)]
        below = descendants(self.pid) if known is None else [p for p in known if p != self.pid]
        for pid in below:
            found = files.read(pid)
            if found is not None:  # gone between listing and looking: it holds nothing now
                family.append((pid, found))
        files.keep_only({pid for pid, _ in family})
        tree = [((pid, start), seconds, rss) for pid, (_, seconds, start, rss) in family]
        # "T" stopped by a signal, "t" by a tracer at a breakpoint.
        return tree, root[0] in ("T", "t")


_this_machines_cpus = functools.cache(usable_cpus)

#: /proc/<pid>/stat counts CPU time in clock ticks and memory in pages.
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

#: Whether processes can be read from /proc (Linux); elsewhere, through psutil.
_PROC_STAT = os.path.exists("/proc/self/stat")

#: A process's state letter as ``ps`` shows it (``R``, ``S``, ``T``, ``Z``...),
#: CPU seconds, start time in ticks and resident bytes.
Reading = tuple[str, float, int, int]


class _ProcessFiles:
    """Each process's ``/proc/<pid>/stat``, opened once and read with one ``pread`` a tick.

    One read of that file has everything a sample needs of a process: its
    state, its own and its reaped children's CPU time, its start time and its
    resident set (the figure ``statm`` and psutil's ``rss`` give). psutil
    opened and parsed three files per process for the same (``stat``,
    ``statm`` and ``stat`` again for the status): 60 µs a process, against a
    few here. A descriptor kept open also stays with the process it was
    opened for: once that process is reaped, reading it fails, even if its
    pid has been given to another.
    """

    def __init__(self) -> None:
        # File objects, not bare descriptors: one the stop button lands on as
        # it is opened is closed as it is dropped, where a number would stay
        # open with nothing holding it.
        self._files: dict[int, io.FileIO] = {}
        # Held while a file is used or closed: a claim that ends closes its
        # sampler from its own thread.
        self._lock = threading.Lock()

    def read(self, pid: int) -> Reading | None:
        """(state, CPU seconds, start time in ticks, resident bytes), or ``None`` if gone."""
        if not _PROC_STAT:
            return _read_with_psutil(pid)
        with self._lock:
            return self._read(pid)

    def _read(self, pid: int) -> Reading | None:
        file = self._files.get(pid)
        try:
            if file is None:
                file = self._files[pid] = open(f"/proc/{pid}/stat", "rb", buffering=0)  # noqa: SIM115
            data = os.pread(file.fileno(), 1024, 0)
        except OSError:
            self._drop(pid)
            return None
        # The command name is in parentheses and may itself hold spaces and
        # parentheses: the fields start after the last ")".
        fields = data[data.rfind(b")") + 2 :].split()
        try:
            # proc(5)'s fields from the third, the state: utime, stime, cutime
            # and cstime are its 14th to 17th, starttime the 22nd, rss the 24th.
            seconds = (
                int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
            ) / _TICKS_PER_S
            state = fields[0].decode("ascii", "replace")
            return state, seconds, int(fields[19]), int(fields[21]) * _PAGE_BYTES
        except (IndexError, ValueError):
            self._drop(pid)
            return None  # an empty read: the process went as it was read

    def keep_only(self, pids: set[int]) -> None:
        with self._lock:
            for pid in [pid for pid in self._files if pid not in pids]:
                self._drop(pid)

    def close(self) -> None:
        with self._lock:
            for pid in list(self._files):
                self._drop(pid)

    def _drop(self, pid: int) -> None:
        file = self._files.pop(pid, None)
        if file is not None:
            file.close()

    def __del__(self) -> None:
        # At interpreter exit the modules this needs may be gone already.
        with contextlib.suppress(Exception):
            self.close()


#: psutil's words for the states a reading tells apart, as /proc/<pid>/stat spells them.
_STATE_LETTERS = {
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_IDLE: "I",
}


def _read_with_psutil(pid: int) -> Reading | None:
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            times = process.cpu_times()
            # A child's time moves into its parent's children_* counters when
            # it is reaped, so the tree's total keeps it after the child is gone.
            seconds = times.user + times.system + times.children_user + times.children_system
            return (
                _STATE_LETTERS.get(process.status(), "R"),
                seconds,
                int(process.create_time() * 1000),
                process.memory_info().rss,
            )
    except psutil.Error:
        return None


class Chances:
    """How long a process has had to act: its CPU time while it could run, the clock while asleep.

    Counted from when this is made. A grace measured by the clock alone runs
    out for a process that is only waiting for a core. A worker that answers a
    stop in 0.2 s on an idle machine took over 1.5 s on one running two test
    suites at once, and was killed as deaf, with everything its cell had
    bound. So time spent runnable but off the CPU does not count; time asleep
    does, since a process asleep past a signal it should have acted on is not
    acting on it.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._files = _ProcessFiles()
        self._taken, self._cpu, self._at = 0.0, 0.0, time.monotonic()
        self._cpu, _ = self._look()

    def taken(self) -> float:
        """The seconds of chances the process has had so far; read again on each call."""
        now = time.monotonic()
        cpu, runnable = self._look()
        # Looked at only between reads: a process that ran and then slept is
        # counted by the clock, which is never less than the CPU it used.
        self._taken += cpu - self._cpu if runnable else now - self._at
        self._at, self._cpu = now, cpu
        return self._taken

    def close(self) -> None:
        self._files.close()

    def _look(self) -> tuple[float, bool]:
        """Its CPU time so far, and whether it is running or waiting for a core."""
        found = self._files.read(self.pid)
        if found is None:
            # Gone: it acts no more, and the clock is all there is.
            return self._cpu, False
        state, seconds, _, _ = found
        return seconds, state == "R"


#: How far a reading must move from the one last told to be news to anyone
#: who shows it: half a percent of the RSS (the figure is shown to two or
#: three digits), one point of the machine's CPU (shown as a whole percent),
#: or a process more or less. The halt decision sees every reading; only the
#: telling is spared: an unchanged reading pushed to a widget cost the kernel
#: 150 µs, and one sent to a books service a line every view re-reads.
RSS_STEP = 0.005
CPU_STEP = 1.0


def is_news(told: Sample | None, now: Sample) -> bool:
    """Whether ``now`` differs from the reading last told by more than drift."""
    if told is None:
        return True
    return (
        now.processes != told.processes
        or abs(now.rss_bytes - told.rss_bytes) >= RSS_STEP * max(told.rss_bytes, 1)
        or abs(now.cpu_percent - told.cpu_percent) >= CPU_STEP
        or now.cards != told.cards
        or now.stopped != told.stopped
    )


class Readings:
    """What a claim's samples add up to: the latest, the peak, the mean, a history."""

    def __init__(self) -> None:
        self.latest: Sample | None = None
        self.peak_rss_bytes = 0
        #: The most card memory the claim held, on all its cards; ``None`` until a card is read.
        self.peak_gpu_bytes: int | None = None
        self._cpu_total = 0.0
        self.count = 0
        self.history: deque[Sample] = deque(maxlen=HISTORY)

    def add(self, sample: Sample) -> None:
        self.latest = sample
        self.peak_rss_bytes = max(self.peak_rss_bytes, sample.rss_bytes)
        if sample.gpu_bytes is not None:
            self.peak_gpu_bytes = max(self.peak_gpu_bytes or 0, sample.gpu_bytes)
        self._cpu_total += sample.cpu_percent
        self.count += 1
        self.history.append(sample)

    @property
    def mean_cpu_percent(self) -> float:
        return round(self._cpu_total / self.count, 1) if self.count else 0.0

    def __repr__(self) -> str:
        # What `print(c.readings)` is asked for: the figures, as bytes and percent.
        latest = self.latest
        now = (
            "no reading yet"
            if latest is None
            else f"now {latest.rss_bytes} bytes, {latest.cpu_percent:g}% CPU, "
            f"{latest.processes} processes"
        )
        gpu = (
            "" if self.peak_gpu_bytes is None else f", peak card memory {self.peak_gpu_bytes} bytes"
        )
        return (
            f"<Readings: {now}; peak {self.peak_rss_bytes} bytes{gpu}, "
            f"mean {self.mean_cpu_percent:g}% CPU over {self.count} readings>"
        )
