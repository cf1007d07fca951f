"""Keeping open monitors up to date: one thread, alive only while someone is watching.

A monitor left open in a notebook nobody is looking at must cost the kernel
next to nothing, and a closed one nothing at all. So:

- **One thread for every monitor**, reading the machine once per tick for
  all of them: every second while claims wait or run, every two seconds
  when none do. It starts when a monitor is shown and ends
  when no monitor is watched, so a kernel with no monitor open runs no
  thread for it. (Running claims are sampled by :mod:`fluksio_nb.watch`;
  this thread only reads what is already known, plus the host, the cards,
  and the Ray cluster while this kernel is connected to one.)
- **Watched means shown, not closed, and not abandoned.** Each view in a
  front end says hello when drawn, pings every 30 s and says goodbye when
  removed. A monitor whose views all said goodbye, or that no view has
  pinged for its lease (:attr:`~fluksio_nb.widget.MonitorWidget.LEASE_S`), is
  dropped until a view speaks again. Closed browser tabs say no goodbye; the
  lease is what notices them.
- **A busy kernel hears nothing.** Front-end messages are handled between
  cells, so while a cell runs (a foreground ``%%claim`` cell for minutes,
  say) silence proves nothing and the lease does not run down.
  :class:`KernelActivity` knows when the kernel was last free to listen.
- **Each tick also feeds the kernel's history of the machine**
  (:mod:`fluksio_nb.machine_history`), so the monitor's plot has the
  minutes it has been watched; the new point travels beside the facts
  (``history_point``), never inside them, so a plot that moves does not make
  the rest news.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from fluksio_nb.watch import ensure_running
from fluksio_nb.widget.facts import HOST_MEMORY_STEP, machine_facts

log = logging.getLogger(__name__)

#: How often open monitors are refreshed while claims wait or run, and so the
#: most often they are pushed: once a second, as a claim's own status is.
TICK_S = 1.0

#: How often when nothing waits or runs: only the host's memory and claims
#: appearing can change then, and a monitor left open on an idle machine
#: should cost next to nothing.
IDLE_TICK_S = 2.0

#: How old a claim's reading of the host's memory may be and still be shown.
FRESH_S = 1.0


class Watched(Protocol):
    """A monitor, as the ticker sees it."""

    def watched(self, now: float, quiet_since: float) -> bool: ...

    def show_facts(self, facts: dict[str, Any]) -> None: ...


class Reader(Protocol):
    """Where the facts come from: called once per tick, closed when the thread ends."""

    def __call__(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class KernelActivity:
    """Whether a cell is running, and since when the kernel has been free to listen."""

    def __init__(self) -> None:
        self.busy = False
        self.idle_since = 0.0
        self._attached_to: Any = None

    def cell_started(self, *_: Any) -> None:
        self.busy = True

    def cell_finished(self, *_: Any) -> None:
        self.busy = False
        self.idle_since = time.monotonic()

    def quiet_since(self, now: float) -> float:
        """From when a silent front end counts as silent: now, while a cell runs."""
        return now if self.busy else self.idle_since

    def attach(self, shell: Any) -> None:
        """Follow the shell's cells. Called from inside a cell, which is running now."""
        if shell is None or shell is self._attached_to:
            return
        shell.events.register("pre_run_cell", self.cell_started)
        shell.events.register("post_run_cell", self.cell_finished)
        self._attached_to = shell
        # We are attached from inside a cell whose pre_run_cell has already fired.
        if threading.current_thread() is threading.main_thread():
            self.busy = True


#: How far the kernel's own RSS must move to be news: a megabyte, or half a
#: percent of it, whichever is more.
KERNEL_RSS_STEP = 0.005


class MachineReader:
    """Reads what the monitor shows: the kernel's books, its running claims, the host, the cards.

    Also the kernel's own memory (held steady like the host's, below), the
    claims that ended lately (:mod:`fluksio_nb.usage.recent`), and a point
    of the machine's history when one is due.

    The host's available memory moves a little all the time. It is reported
    again only once it has moved by :data:`~fluksio_nb.widget.facts.HOST_MEMORY_STEP`
    of the host since it was last reported (rounding alone would flip back
    and forth whenever the figure sits on a boundary), so an idle machine's
    facts stay the same and nothing is pushed.
    """

    def __init__(self) -> None:
        self._available: int | None = None
        self._kernel_rss: int | None = None

    def __call__(self) -> dict[str, Any]:
        from fluksio_nb.machine_history import process_history, take_point
        from fluksio_nb.overview import kernel_snapshot, ray_now
        from fluksio_nb.status import running_statuses

        # The cards come with it, read by the kernel's one reader of the cards.
        snapshot = kernel_snapshot()
        statuses = running_statuses()
        total, available = _host_memory(statuses)
        last = self._available
        if last is None or abs(available - last) >= total * HOST_MEMORY_STEP:
            self._available = last = available
        facts = machine_facts(snapshot, statuses, (total, last), ray=ray_now())
        facts["kernel"] = {"rss_bytes": self._steady_kernel_rss()}
        facts["finished"] = finished_claims()
        facts["history_point"] = take_point(process_history(), snapshot, (total, available))
        return facts

    def _steady_kernel_rss(self) -> int:
        """This kernel's RSS, reported again only once it moved by more than drift."""
        rss = kernel_rss_bytes()
        last = self._kernel_rss
        if last is None or abs(rss - last) >= max(1_000_000, last * KERNEL_RSS_STEP):
            self._kernel_rss = last = rss
        return last

    def close(self) -> None:
        """Nothing is held between reads: the kernel's reader of the cards is shared."""


def kernel_rss_bytes() -> int:
    """This kernel's own resident memory: what the notebook itself holds."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def finished_claims() -> list[dict[str, Any]]:
    """The claims that ended lately, as the server's ``finished`` says them; none if unreadable."""
    from fluksio_nb.usage.recent import process_recent_usage

    try:
        return process_recent_usage().finished()["claims"]
    except Exception:
        log.exception("fluksio_nb: the usage records could not be read for the monitor")
        return []


def _host_memory(statuses: dict[int, Any]) -> tuple[int, int]:
    """The host's memory, from a running claim's latest reading when there is a fresh one.

    Every reading of a claim already holds the host's memory, read with it;
    reading it again (a third of a millisecond, cgroup files and all) twice a
    second would be the monitor's largest cost while claims run.
    """
    from fluksio_nb.inventory import host_memory

    now = time.monotonic()
    latest = [s.readings.latest for s in statuses.values() if s.readings.latest is not None]
    fresh = [sample for sample in latest if now - sample.at < FRESH_S]
    if fresh:
        newest = max(fresh, key=lambda sample: sample.at)
        return newest.host_total_bytes, newest.host_available_bytes
    return host_memory()


class MonitorWatch:
    """Refreshes what it is given, from one thread that exists only while needed."""

    def __init__(
        self,
        interval_s: float = TICK_S,
        reader: Reader | None = None,
        activity: KernelActivity | None = None,
        idle_interval_s: float = IDLE_TICK_S,
    ) -> None:
        self.interval_s = interval_s
        self.idle_interval_s = idle_interval_s
        self.activity = activity or KernelActivity()
        self._reader = reader or MachineReader()
        self._lock = threading.Lock()
        self._monitors: set[Watched] = set()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def __contains__(self, monitor: Watched) -> bool:
        with self._lock:
            return monitor in self._monitors

    def read(self) -> dict[str, Any]:
        return self._reader()

    def watch(self, monitor: Watched) -> None:
        """Keep ``monitor`` refreshed, starting the thread if it is not running."""
        with self._lock:
            self._monitors.add(monitor)
            self._thread = ensure_running(self._thread, self._loop, "fluksio-monitor")
        self._wake.set()

    def unwatch(self, monitor: Watched) -> None:
        with self._lock:
            self._monitors.discard(monitor)
        self._wake.set()

    def _loop(self) -> None:
        try:
            while True:
                now = time.monotonic()
                quiet_since = self.activity.quiet_since(now)
                with self._lock:
                    for monitor in [m for m in self._monitors if not m.watched(now, quiet_since)]:
                        self._monitors.discard(monitor)
                    if not self._monitors:
                        # Decided under the lock, so a watch() racing with this exit
                        # either lands before it (and is seen) or starts a new thread.
                        self._thread = None
                        return
                    monitors = list(self._monitors)
                busy = self._tick(monitors)
                self._wake.wait(self.interval_s if busy else self.idle_interval_s)
                self._wake.clear()
        finally:
            self._reader.close()

    def _tick(self, monitors: list[Watched]) -> bool:
        """Refresh every monitor once; whether any claim waits or runs."""
        try:
            facts = self.read()
        except Exception:
            # A broken read (a books service restarting, say) skips one tick; the next
            # may well work, and the monitors keep showing the last good one.
            log.exception("fluksio_nb: reading the machine for the monitor failed")
            return True
        for monitor in monitors:
            try:
                monitor.show_facts(facts)
            except Exception:
                log.exception("fluksio_nb: updating a monitor failed")
        ray = facts.get("ray") or {}
        return bool(facts.get("running") or facts.get("waiting") or ray.get("claims"))


_watch: MonitorWatch | None = None
_watch_lock = threading.Lock()


def kernel_monitor_watch() -> MonitorWatch:
    """The kernel's one monitor thread's keeper, following the kernel's cells."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = MonitorWatch()
            try:
                from IPython import get_ipython
            except ImportError:
                pass
            else:
                _watch.activity.attach(get_ipython())
        return _watch
