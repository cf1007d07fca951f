"""Warm workers, so that a claimed cell does not pay for a Python to start.

A worker's environment is fixed when it starts: that is the whole point, since
the thread variables are read once, at import. The pool is keyed by the share's
derived environment, and a claim is handed, in this order:

1. an idle worker started with (or reshaped to) exactly its environment: two
   cells that each claim ``cpus=2`` share one warm worker and its imported numpy;
2. an idle worker whose environment differs from it in the thread variables
   only, told the new ones (:meth:`~fluksio_nb.worker.client.Worker.reshape`)
   if every thread pool loaded in it will hold them. What holds and what does
   not was measured, and is written down in :mod:`fluksio_nb.worker.threads`:
   a worker that has loaded no pool, or only OpenBLAS, MKL or BLIS, takes a
   new count; one with an OpenMP runtime, numexpr, numba, torch or TensorFlow
   loaded refuses, keeps its shape, and is not asked again. A reshape is a
   round trip to an idle worker, a few milliseconds against the quarter of a
   second a fresh one takes;
3. a fresh worker.

One worker may be started before any claim (:meth:`WorkerPool.prestart`), for
the shape a notebook's first claim is likeliest to have, so that not even the
first claimed cell waits for a Python to start.

Rules bound what is kept:

- A worker whose environment names GPUs is ended when its claim gives the
  share back. A CUDA context stays on the card for as long as the process
  lives, and the card may be granted to somebody else next.
- Idle workers are few (:data:`MAX_IDLE`) and age out (:data:`IDLE_TTL_S`):
  each one holds a Python interpreter and whatever it imported. The worker
  started ahead of any claim does not age out until it has run one: it holds
  an interpreter with IPython and nothing else (about 40 MB), sleeps without
  a timeout, and no claim is in the books for it.
- All of them end when the kernel does. The workers also watch for their
  parent's death themselves, for a kernel that is killed and cannot say so.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fluksio_nb.env import differs_only_in_threads
from fluksio_nb.worker.client import Worker

#: Idle workers kept at once. Each is an interpreter with its imports, about
#: 60-200 MB, and a notebook rarely alternates between more than a few shapes.
MAX_IDLE = 4

#: How long an idle worker is kept. Long enough to span the think time between
#: two runs of a cell; short enough that a notebook left open overnight gives
#: its memory back.
IDLE_TTL_S = 600.0

EnvKey = tuple[tuple[str, str], ...]


def env_key(derived: Mapping[str, str]) -> EnvKey:
    return tuple(sorted(derived.items()))


def names_gpus(derived: Mapping[str, str]) -> bool:
    return bool(derived.get("CUDA_VISIBLE_DEVICES", "").strip())


# Told apart by identity: a checkout takes the very entries it found.
@dataclass(eq=False)
class _Idle:
    key: EnvKey
    since: float
    worker: Worker
    #: Started ahead of any claim and not used yet: kept until it is.
    kept: bool = False


class WorkerPool:
    """Hands out a worker holding a given environment, warm when it can."""

    def __init__(
        self,
        start: Callable[[dict[str, str]], Worker] | None = None,
        *,
        max_idle: int = MAX_IDLE,
        idle_ttl_s: float = IDLE_TTL_S,
    ) -> None:
        self._start = start or (lambda env: Worker(env))
        self.max_idle = max_idle
        self.idle_ttl_s = idle_ttl_s
        self._idle: list[_Idle] = []
        self._lock = threading.Lock()
        self._reaper: threading.Timer | None = None
        self._closed = False
        #: Workers that refused another thread count: they refuse for good,
        #: since what made them refuse stays loaded.
        self._fixed: weakref.WeakSet[Worker] = weakref.WeakSet()
        #: Workers started for a checkout that found none to reuse.
        self.started = 0
        #: Checkouts served by a worker told another thread count.
        self.reshaped = 0
        #: Why the last worker asked to take another thread count refused.
        self.last_refusal: str | None = None

    def prestart(self, derived: Mapping[str, str]) -> Worker | None:
        """Start a worker ahead of any claim, kept idle until one comes.

        None, and nothing started, if a worker is idle already or the pool is
        closed: one warm worker can serve the first claim of any thread count.
        """
        with self._lock:
            if self._idle or self._closed:
                return None
        worker = self._start(dict(derived))
        with self._lock:
            if not self._closed:
                self._idle.append(_Idle(env_key(derived), time.monotonic(), worker, kept=True))
                return worker
        worker.close()
        return None

    def checkout(self, derived: Mapping[str, str], timeout: float = 30.0) -> Worker:
        """A live worker holding exactly this derived environment, warm if one can be.

        ``timeout`` bounds the wait for an idle worker that is still starting
        to answer whether it takes this environment's thread count.
        """
        key = env_key(derived)
        # Out of the pool and not yet the caller's: put back if stopped meanwhile.
        taken: list[_Idle] = []
        try:
            with self._lock:
                # Drops the dead too: each is asked once, a system call each.
                self._age_out(time.monotonic())
                same = [entry for entry in self._idle if entry.key == key]
                # Else the most recently used first: the likeliest to be in the cache.
                taken = same[:1] or [
                    entry
                    for entry in reversed(self._idle)
                    if entry.worker not in self._fixed
                    and differs_only_in_threads(dict(entry.key), derived)
                ]
                self._idle = [entry for entry in self._idle if entry not in taken]
        except BaseException:
            for entry in taken:
                if entry not in self._idle:
                    self._put_back(entry)
            raise
        if same:
            return taken[0].worker
        deadline = time.monotonic() + timeout
        asked: _Idle | None = None
        chosen: Worker | None = None
        try:
            for asked in taken:
                refused = asked.worker.reshape(derived, max(0.0, deadline - time.monotonic()))
                if refused is None:
                    chosen = asked.worker
                    self.reshaped += 1
                    break
                self.last_refusal = refused
                self._fixed.add(asked.worker)
            else:
                asked = None
        except BaseException:
            # Stopped while a worker was asked: that one was ended by it.
            if asked is not None:
                asked.worker.close()
            raise
        finally:
            for entry in taken:
                if entry is not asked:
                    self._put_back(entry)
        if chosen is not None:
            return chosen
        return self.fresh(derived)

    def fresh(self, derived: Mapping[str, str]) -> Worker:
        """A worker started now for this environment, passing over any idle one."""
        self.started += 1
        return self._start(dict(derived))

    def checkin(self, worker: Worker, derived: Mapping[str, str]) -> None:
        """Take a worker back after its claim: keep it warm, or end it."""
        if names_gpus(derived) or self.max_idle == 0:
            worker.close()
            return
        # A worker that died is closed there.
        self._put_back(_Idle(env_key(derived), time.monotonic(), worker))

    def _put_back(self, entry: _Idle) -> None:
        if not entry.worker.alive:
            entry.worker.close()
            return
        evicted: list[Worker] = []
        with self._lock:
            if self._closed:
                evicted.append(entry.worker)
            else:
                self._idle.append(entry)
                while len(self._idle) > self.max_idle:
                    evicted.append(self._idle.pop(0).worker)
                self._schedule_reaper()
        for old in evicted:
            # A GPU worker, above, is waited for: its card is given back next.
            _close_later(old)

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def close(self) -> None:
        """End every idle worker. Called when the kernel shuts down."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            if self._reaper is not None:
                self._reaper.cancel()
                self._reaper = None
        for entry in idle:
            entry.worker.close()

    def _age_out(self, now: float) -> None:
        """Drop idle workers past their age. Called with the lock held."""
        keep, old = [], []
        for entry in self._idle:
            aged = not entry.kept and now - entry.since >= self.idle_ttl_s
            (old if aged or not entry.worker.alive else keep).append(entry)
        self._idle = keep
        for entry in old:
            _close_later(entry.worker)

    def _schedule_reaper(self) -> None:
        ageing = [entry.since for entry in self._idle if not entry.kept]
        if self._reaper is not None or not ageing:
            return

        def reap() -> None:
            with self._lock:
                self._reaper = None
                self._age_out(time.monotonic())
                self._schedule_reaper()

        delay = max(0.05, min(ageing) + self.idle_ttl_s - time.monotonic())
        self._reaper = threading.Timer(delay, reap)
        self._reaper.daemon = True
        self._reaper.start()


def _close_later(worker: Worker) -> None:
    """End an idle worker off the cell's path: waiting for it to exit cost a cell about 60 ms."""
    threading.Thread(target=worker.close, daemon=True).start()


_pool: WorkerPool | None = None
_pool_lock = threading.Lock()


def kernel_pool() -> WorkerPool:
    """The kernel's one pool, closed when the kernel exits."""
    global _pool
    with _pool_lock:
        if _pool is None:
            from fluksio_nb.kernel import inventory

            _pool = WorkerPool(lambda env: Worker(env, cores=inventory().worker_cores))
            atexit.register(_pool.close)
        return _pool
