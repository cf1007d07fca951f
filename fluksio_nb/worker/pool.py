"""Warm workers, one set per environment, so a second claim does not pay for imports.

A worker's environment is fixed when it starts: that is the whole point, since
the thread variables are read once, at import. So a worker can only be reused
by a claim whose derived environment is exactly the one it was started with,
and the pool is keyed by that environment. Two cells that each claim
``cpus=2`` share one warm worker and its imported numpy; a ``cpus=1`` cell
gets another.

Three rules bound what is kept:

- A worker whose environment names GPUs is ended when its claim gives the
  share back. A CUDA context stays on the card for as long as the process
  lives, and the card may be granted to somebody else next.
- Idle workers are few (:data:`MAX_IDLE`) and age out (:data:`IDLE_TTL_S`):
  each one holds a Python interpreter and whatever it imported.
- All of them end when the kernel does. The workers also watch for their
  parent's death themselves, for a kernel that is killed and cannot say so.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable, Mapping

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


class WorkerPool:
    """Hands out a worker started with a given environment, warm when it can."""

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
        self._idle: list[tuple[EnvKey, float, Worker]] = []
        self._lock = threading.Lock()
        self._reaper: threading.Timer | None = None
        self.started = 0

    def checkout(self, derived: Mapping[str, str]) -> Worker:
        """A live worker with exactly this derived environment, warm if one is idle."""
        key = env_key(derived)
        with self._lock:
            self._age_out(time.monotonic())
            for index, (idle_key, _, worker) in enumerate(self._idle):
                if idle_key == key and worker.alive:
                    del self._idle[index]
                    return worker
        self.started += 1
        return self._start(derived)

    def checkin(self, worker: Worker, derived: Mapping[str, str]) -> None:
        """Take a worker back after its claim: keep it warm, or end it."""
        if not worker.alive or names_gpus(derived) or self.max_idle == 0:
            worker.close()
            return
        evicted: list[Worker] = []
        with self._lock:
            self._idle.append((env_key(derived), time.monotonic(), worker))
            while len(self._idle) > self.max_idle:
                evicted.append(self._idle.pop(0)[2])
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
            idle, self._idle = self._idle, []
            if self._reaper is not None:
                self._reaper.cancel()
                self._reaper = None
        for _, _, worker in idle:
            worker.close()

    def _age_out(self, now: float) -> None:
        """Drop idle workers past their age. Called with the lock held."""
        keep, old = [], []
        for entry in self._idle:
            (old if now - entry[1] >= self.idle_ttl_s or not entry[2].alive else keep).append(entry)
        self._idle = keep
        for _, _, worker in old:
            _close_later(worker)

    def _schedule_reaper(self) -> None:
        if self._reaper is not None or not self._idle:
            return

        def reap() -> None:
            with self._lock:
                self._reaper = None
                self._age_out(time.monotonic())
                self._schedule_reaper()

        oldest = min(entry[1] for entry in self._idle)
        delay = max(0.05, oldest + self.idle_ttl_s - time.monotonic())
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
