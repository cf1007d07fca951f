"""Waiting, in a test, for what happens in another thread or process.

Polled with a deadline, never slept for a fixed time: the test goes on as
soon as the thing has happened, and a slow machine only makes it wait longer.
A process counts as ended once it is a zombie: what it ran has stopped, and
only its parent's reaping is left, which is not what any test is about.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil


def has_ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``condition()`` came true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether ``pid`` ended within ``within`` seconds."""
    return wait_until(lambda: has_ended(pid), within)


def processes_using(directory: str) -> list[psutil.Process]:
    """Every process whose command line names ``directory``: what a Ray cluster left there."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(directory in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found


def living_in_group(pgid: int) -> list[int]:
    """The processes still in process group ``pgid``: zombies have ended, and reaping
    orphans is init's job. A process listed may be gone by the look at its group."""
    living = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != "zombie":
                living.append(process.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return living
