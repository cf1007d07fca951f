"""The machine's last ten minutes: CPU, memory and cards, one point every few seconds.

A bar says how the machine is now; it cannot say whether the memory has
been climbing for five minutes, or whether someone outside every claim has
had both cores busy since lunch. The monitor and JupyterLab's panel plot
that from here.

What it decides:

- **One small ring per process, in memory.** Nothing here writes to disk:
  the Jupyter server keeps one (its
  extension feeds it on a timer), and a kernel keeps one while a ``%claims``
  monitor is watched (its ticker feeds it), and catches up on its server's
  when a view opens (:mod:`fluksio_nb.server_history`). Points older than
  :data:`SPAN_S` fall off the end.
- **At most one point every :data:`INTERVAL_S`**, however often it is fed:
  a ticker every second and a page polling the server must not crowd it.
- **The host's CPU is measured here, from ``/proc/stat``'s counters**
  (``psutil.cpu_times``), between two points of this ring. Nothing else's
  ``cpu_percent`` counter is disturbed, and the first point has none to
  compare with, so it waits for the second.
- **CPU outside claims is the host's less what the claims' process trees
  used**, as their readings say (:mod:`fluksio_nb.sampler` reads each claim's
  tree, and the books carry those readings). Where some claim's use cannot be
  known (books that show one kernel's claims, a claim with no reading yet)
  it is ``None``, never a guess.
- **A card is in a point only where it was read** (the process's one
  :class:`~fluksio_nb.gpu_usage.CardReader`); no card reading, no cards.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import psutil

#: How far back the history reaches, in seconds.
SPAN_S = 600.0

#: The least time between two points: 300 points in ten minutes.
INTERVAL_S = 2.0


class HostCpu:
    """The whole host's CPU use, as a percent of every core, between two calls."""

    def __init__(self) -> None:
        self._last: Any = None

    def percent(self) -> float | None:
        """Busy share since the last call, 0 to 100; ``None`` on the first call."""
        now = psutil.cpu_times()
        last = self._last
        if last is None:
            self._last = now
            return None
        total = sum(now) - sum(last)
        if total <= 0:
            return None  # no tick counted yet: measure from the same start next time
        self._last = now
        idle = _idle(now) - _idle(last)
        return round(min(100.0, max(0.0, 100.0 * (total - idle) / total)), 1)


def _idle(times: Any) -> float:
    # iowait is a core waiting with nothing to run: not busy.
    return times.idle + getattr(times, "iowait", 0.0)


def claims_cpu_percent(running: Iterable[Mapping[str, Any]]) -> float | None:
    """What the running claims' trees used, as a percent of the machine; ``None`` if unknown.

    Each claim's ``cpu_percent`` is from its latest reading. A claim with no
    reading yet makes the whole sum unknown rather than low.
    """
    used = 0.0
    for claim in running:
        readings = claim.get("readings") or {}
        cpu = readings.get("cpu_percent")
        if cpu is None:
            return None
        used += float(cpu)
    return used


class MachineHistory:
    """A ring of the machine's points over the last :data:`SPAN_S` seconds, oldest first."""

    def __init__(self, span_s: float = SPAN_S, interval_s: float = INTERVAL_S) -> None:
        self.span_s = span_s
        self.interval_s = interval_s
        self._points: deque[dict[str, Any]] = deque()
        self._cpu = HostCpu()
        self._lock = threading.Lock()
        self._last_at = -float("inf")

    def due(self, now: float | None = None) -> bool:
        """Whether a point taken now would be kept."""
        now = time.time() if now is None else now
        return now - self._last_at >= self.interval_s

    def add(
        self,
        *,
        claims_cpu: float | None,
        memory: tuple[int, int],
        cards: list[dict[str, Any]],
        now: float | None = None,
    ) -> dict[str, Any] | None:
        """Take a point of the host's CPU with these figures; the point, or ``None`` if not due.

        ``claims_cpu`` is :func:`claims_cpu_percent` of the running claims;
        ``memory`` the host's (total, available) bytes.
        """
        now = time.time() if now is None else now
        with self._lock:
            if not self.due(now):
                return None
            cpu = self._cpu.percent()
            self._last_at = now
            if cpu is None:
                return None  # the first call only starts the counters
            total, available = memory
            point = {
                "at": round(now, 3),
                "cpu_percent": cpu,
                "cpu_outside_claims_percent": (
                    None if claims_cpu is None else round(max(0.0, cpu - claims_cpu), 1)
                ),
                "memory_used_bytes": int(max(0, total - available)),
                "memory_total_bytes": int(total),
                "cards": cards,
            }
            self._points.append(point)
            while self._points and self._points[0]["at"] < now - self.span_s:
                self._points.popleft()
            return point

    def merge(self, points: Iterable[dict[str, Any]]) -> int:
        """Take another process's points, oldest first, around this ring's own; how many were taken.

        Those before this ring's oldest point go before it, those after its
        newest after it: this ring's own points stay as they are. A point
        taken here after them is due an interval after the newest of them.
        """
        with self._lock:
            first = self._points[0]["at"] if self._points else float("inf")
            last = self._points[-1]["at"] if self._points else -float("inf")
            before = [p for p in points if p["at"] < first - self.interval_s / 2]
            after = [p for p in points if p["at"] > last + self.interval_s / 2]
            if not self._points:
                after = []
            self._points.extendleft(reversed(before))
            self._points.extend(after)
            if self._points:
                self._last_at = max(self._last_at, self._points[-1]["at"])
            return len(before) + len(after)

    def points(self, now: float | None = None) -> list[dict[str, Any]]:
        """The points of the last :attr:`span_s` seconds, oldest first."""
        now = time.time() if now is None else now
        with self._lock:
            return [point for point in self._points if point["at"] >= now - self.span_s]

    def as_json(self) -> dict[str, Any]:
        """What ``GET fluksio/api/history`` answers."""
        return {"span_s": self.span_s, "interval_s": self.interval_s, "points": self.points()}


def take_point(
    history: MachineHistory,
    snapshot: Mapping[str, Any],
    memory: tuple[int, int] | None = None,
) -> dict[str, Any] | None:
    """Feed ``history`` from a snapshot of the books (with its cards, as ``overview`` reads it).

    ``memory`` is the host's (total, available) where the caller has just
    read it. Blocking (it reads the host's memory otherwise): the server
    calls it off its event loop.
    """
    if not history.due():
        return None
    if memory is None:
        from fluksio_nb.inventory import host_memory

        memory = host_memory()

    claims = claims_cpu_percent(snapshot.get("running", ()))
    if not snapshot.get("sees_every_claim", False):
        claims = None
    return history.add(
        claims_cpu=claims,
        memory=memory,
        cards=[
            {
                key: card[key]
                for key in ("index", "used_bytes", "total_bytes", "utilisation_percent")
            }
            for card in snapshot.get("cards") or ()
        ],
    )


_history = MachineHistory()


def process_history() -> MachineHistory:
    """This process's one ring: the server's, or a kernel's."""
    return _history
