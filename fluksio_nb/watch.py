"""The kernel's one sampling thread: readings for every running claim, and halts.

Each running claim's worker is read every half second, its readings handed
to whoever shows them, and the halt decision taken on each reading. A claim
also ends here when it outlives its deadline. Stopping is the job of
whoever runs the claim (only it knows the worker's process group), so the
watch calls back and never kills anything itself.

One thread for all claims, not one per claim: eight claims running should
cost the kernel what one does. It reads the host's memory once a pass for
all of them, not once per claim, and the cards once a pass too, only when
a claim due for a reading holds one. The thread starts when the first claim is
watched and ends a couple of seconds after the last one is let go, so an
idle kernel runs no thread at all. A worker found gone is let go here: a
claim's subprocesses are not handed back by anyone when they end, and kept
they would keep the thread (and a read of each) going for the kernel's life.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fluksio_nb.budget import Budget, HaltDecision, halt_decision
from fluksio_nb.gpu_usage import CardReader, CardsReading, kernel_cards
from fluksio_nb.inventory import host_memory
from fluksio_nb.sampler import SAMPLE_INTERVAL_S, Sample, Sampler

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Watched:
    """One claim under watch."""

    sampler: Sampler
    budget: Budget
    on_sample: Callable[[Sample], None]
    #: Called once, with the reason, when the claim must stop.
    on_halt: Callable[[HaltDecision | None], None]
    #: ``time.monotonic()`` after which the claim is out of time, if any.
    deadline: float | None = None
    #: Whether the kernel's memory cap holds the claim to its budget: the
    #: halt decision then watches the host only.
    capped: bool = False
    #: No reading before this (``time.monotonic()``): a cell that is over
    #: within one interval is read once at its end instead, by its runner, and
    #: the thread stays off the GIL while the cell runs.
    first_at: float = field(default_factory=lambda: time.monotonic() + SAMPLE_INTERVAL_S)
    halted: bool = field(default=False, init=False)


def ensure_running(thread: threading.Thread | None, loop: Callable[[], None], name: str):
    """``thread`` if it is still alive, else a new daemon thread running ``loop``, started.

    For the kernel's threads that exist only while they have something to
    do (this one, the monitor's, a Ray worker's output sender): call it with
    the lock the loop takes when it decides to end.
    """
    if thread is not None and thread.is_alive():
        return thread
    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


class Watch:
    """Samples what it is given, from one thread that exists only while needed."""

    def __init__(
        self,
        interval_s: float = SAMPLE_INTERVAL_S,
        linger_s: float = 2.0,
        cards: CardReader | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.cards = kernel_cards() if cards is None else cards
        #: How long the thread outlives the last claim. Cells run one after
        #: another; starting a thread for each cost a measurable share of a
        #: short claimed cell, and a sleeping thread costs nothing.
        self.linger_s = linger_s
        self._lock = threading.Lock()
        self._watched: set[Watched] = set()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def add(self, watched: Watched) -> Watched:
        # A running thread is not woken: it looks again within an interval,
        # which is when the first reading is due anyway, and a deadline is
        # looked at once an interval whether it was woken or not. Waking it
        # twice per claim put it on the GIL in the middle of every short
        # claimed cell.
        with self._lock:
            self._watched.add(watched)
            self._thread = ensure_running(self._thread, self._loop, "fluksio-watch")
        return watched

    def discard(self, watched: Watched) -> None:
        # Not woken either: the thread finds the claim gone at its next look,
        # and only lingers from then on.
        with self._lock:
            self._watched.discard(watched)

    def _loop(self) -> None:
        idle_since: float | None = None
        while True:
            with self._lock:
                if self._watched:
                    idle_since = None
                elif idle_since is None:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since >= self.linger_s:
                    # Decided under the lock, so an add() racing with this exit
                    # either lands before it (and is seen) or starts a new thread.
                    self._thread = None
                    return
                watched = list(self._watched)
            self._tick(watched)
            time.sleep(self.interval_s)

    def _tick(self, watched: list[Watched]) -> None:
        host = _HostOnce()
        cards = _CardsOnce(self.cards)
        for item in watched:
            try:
                self._look_at(item, host, cards)
            except Exception:
                # One claim's broken view must not stop the readings, or
                # the halts, of every other claim in the kernel.
                log.exception("fluksio_nb: sampling %s failed", item.sampler.pid)

    def _look_at(self, item: Watched, host: _HostOnce, cards: _CardsOnce) -> None:
        if item.halted:
            return
        if item.deadline is not None and time.monotonic() >= item.deadline:
            item.halted = True
            item.on_halt(None)
            return
        if time.monotonic() < item.first_at or not item.sampler.due():
            return
        sample = item.sampler.sample(host(), cards() if item.sampler.gpus else None)
        if sample is None:
            # Gone: nothing left to read or to halt. Kept, a claim's ended
            # subprocesses would keep this thread running for good.
            self.discard(item)
            return
        item.on_sample(sample)
        decision = halt_decision(sample, item.budget, capped=item.capped)
        if decision.should_halt:
            item.halted = True
            item.on_halt(decision)


class _HostOnce:
    """The host's memory, read at most once per tick, and only if some claim is due.

    Every reading carries it, and it is the same machine for every claim:
    read per claim it was two thirds of a tick's cost (eight claims).
    """

    __slots__ = ("_memory",)

    def __init__(self) -> None:
        self._memory: tuple[int, int] | None = None

    def __call__(self) -> tuple[int, int]:
        if self._memory is None:
            self._memory = host_memory()
        return self._memory


class _CardsOnce:
    """The cards, asked for at most once per tick; the reader itself reads them less often."""

    __slots__ = ("_read", "_reader", "_reading")

    def __init__(self, reader: CardReader) -> None:
        self._reader = reader
        self._reading: CardsReading | None = None
        self._read = False

    def __call__(self) -> CardsReading | None:
        if not self._read:
            self._read = True
            self._reading = self._reader.latest(wait_for_first=False)
        return self._reading


_watch = Watch()


def kernel_watch() -> Watch:
    """The kernel's one watch."""
    return _watch
