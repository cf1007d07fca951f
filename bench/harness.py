"""Timing helpers shared by the benchmark sections.

Numbers from a shared, noisy two-core machine only mean something next to a
baseline taken in the same run, so every section measures its baseline and
its subject alternately, in rounds, and reports medians and the 90th
percentile rather than means, which one descheduled run can double.
"""

from __future__ import annotations

import fcntl
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil


@contextmanager
def scratch(within: float = 120.0) -> Iterator[str]:
    """A directory for one section's books and files, removed once nothing writes there.

    A user's books service started in it by the section's kernels outlives
    them by ``FLUKSIO_BOOKS_LINGER`` seconds (a second under ``bench``) and
    writes its state as they leave: removing the directory under it fails, or
    leaves it writing into a directory that is gone. The service holds
    ``service.lock`` for its whole life, so the lock coming free says it ended.
    """
    directory = tempfile.mkdtemp(prefix="fluksio-bench-")
    try:
        yield directory
    finally:
        deadline = time.monotonic() + within
        for lock in Path(directory).rglob("service.lock"):
            _wait_for_unlocked(lock, deadline)
        shutil.rmtree(directory)


def _wait_for_unlocked(lock: Path, deadline: float) -> None:
    fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the books service holding {lock} did not end") from None
                time.sleep(0.05)
    finally:
        os.close(fd)


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def timed(action: Callable[[], object], repeat: int, idle_s: float = 0.0) -> list[float]:
    samples = []
    for _ in range(repeat):
        if idle_s:
            time.sleep(idle_s)
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples


def interleaved(
    actions: dict[str, Callable[[], object]], rounds: int, idle_s: float = 0.0
) -> dict[str, list[float]]:
    """Each action once per round, so drift in the machine hits them all alike.

    The order is shuffled every round (the same shuffles every run): in a
    fixed order each action always follows the same one, and what ran just
    before matters here. A cell timed right after ``%%script python3`` took
    2-3 ms longer than one timed after a plain cell, whichever cell it was,
    because the subprocess had just emptied the caches and the other core
    had just gone idle.

    ``idle_s`` sleeps before each action, outside its time: what an action
    costs after the machine sat idle is not what it costs back to back.
    """
    samples: dict[str, list[float]] = {name: [] for name in actions}
    order = list(actions)
    shuffles = random.Random(rounds)
    for _ in range(rounds):
        shuffles.shuffle(order)
        for name in order:
            samples[name] += timed(actions[name], 1, idle_s)
    return samples


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def machine() -> str:
    memory = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} cores ({len(os.sched_getaffinity(0))} usable), "
        f"{memory:.0f} GiB, Python {platform.python_version()}, {platform.machine()}"
    )


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
