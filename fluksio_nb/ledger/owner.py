"""Who a claim belongs to: the kernel that made it, and whether it still lives.

Every entry in the ledger names the kernel that made it, and two things hang
on that name: who may cancel the claim, and whether anybody still holds its
share. A kernel that dies cannot give its share back itself, so every
transaction tells the living from the dead on its own.

What it decides:

- **Who a kernel is comes from the OS.** An entry records the process's
  effective uid and that uid's name (:func:`identity`), not ``$USER``, which
  anyone can set.
- **The dead give their share back.** Every entry records its kernel's pid and
  that process's start time; a transaction that finds the pid gone, or
  reused by a younger process (:func:`owner_alive`), drops the entry. A
  kernel killed with SIGKILL, by the OOM killer or by a reboot cannot say
  goodbye, and need not.
- **When a dead kernel ended is what was seen, never guessed.** The process
  that drops a dead kernel's entry records its claim for it, and says it
  ended when this process saw the kernel end (a waiter watches its holders
  end), else when it last found it alive (:func:`last_seen`): a claim is
  never counted past the last moment anyone knew it held its share.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import psutil

from fluksio_nb.identity import user_name


def process_started(pid: int) -> float | None:
    """When a process started, or ``None`` if there is no such process.

    A zombie is no such process: it holds nothing and runs nothing, and a
    kernel killed under a server that has not reaped it yet is one.
    """
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.Error:
        return None


#: How long a holder found alive is taken to still be alive without looking
#: again. Every transaction checks every entry's owner, and reading /proc for
#: each of them was most of a transaction's time under contention; a dead
#: holder is still noticed within the half second the issue allows it.
_ALIVE_FOR_S = 0.25
_seen_alive: dict[tuple[int, float], float] = {}

#: By the wall clock, when this process last found each kernel alive, and
#: when it saw one end; the oldest forgotten past :data:`_SIGHTINGS_KEPT`.
_alive_at: dict[tuple[int, float], float] = {}
_ended_at: dict[tuple[int, float], float] = {}
_SIGHTINGS_KEPT = 1024


def owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the kernel an entry names is still running: same pid, same start time."""
    key = (owner["pid"], owner["started"])
    if key == _this_process():
        # Asked by the holder itself, which every claim's own transactions are.
        return True
    now = time.monotonic()
    if now - _seen_alive.get(key, -_ALIVE_FOR_S) < _ALIVE_FOR_S:
        return True
    started = process_started(owner["pid"])
    # A pid reused by a younger process is not the holder come back to life.
    alive = started is not None and abs(started - owner["started"]) < 1.0
    if alive:
        _seen_alive[key] = now
        _sighted(_alive_at, key)
    else:
        _seen_alive.pop(key, None)
    return alive


def seen_to_end(owner: dict[str, Any]) -> None:
    """Forget that the kernel an entry names was alive: it has just been seen to end."""
    key = (owner["pid"], owner["started"])
    _seen_alive.pop(key, None)
    if key not in _ended_at:
        _sighted(_ended_at, key)


def last_seen(owner: dict[str, Any]) -> float | None:
    """When this process saw the kernel an entry names end, else last found it alive.

    ``time.time()``, or ``None`` if it never looked. Asked once, as its entry
    is dropped: forgotten after.
    """
    key = (owner["pid"], owner["started"])
    ended, alive = _ended_at.pop(key, None), _alive_at.pop(key, None)
    return ended if ended is not None else alive


def _sighted(sightings: dict[tuple[int, float], float], key: tuple[int, float]) -> None:
    # Kernels that ended where another process dropped their entries are never
    # asked about here: the oldest sightings go, so a long-lived server keeps few.
    sightings.pop(key, None)
    sightings[key] = time.time()
    if len(sightings) > _SIGHTINGS_KEPT:
        sightings.pop(next(iter(sightings)), None)


def _this_process() -> tuple[int, float]:
    """This process's pid and start time, as its entries record them; read once per pid."""
    global _this
    pid = os.getpid()
    if _this is None or _this[0] != pid:
        _this = (pid, process_started(pid) or 0.0)
    return _this


_this: tuple[int, float] | None = None


def identity() -> dict[str, Any]:
    """Who this kernel is, as the ledger records it."""
    pid = os.getpid()
    kernel_id = None
    with contextlib.suppress(Exception):
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).stem
        kernel_id = name.removeprefix("kernel-")
    return {
        "pid": pid,
        "started": _this_process()[1],
        "kernel_id": kernel_id,
        # jupyter_server tells the kernels it starts which notebook they serve.
        "notebook": os.environ.get("JPY_SESSION_NAME"),
        # From the OS, not $USER or $LOGNAME, which say whatever they are set to.
        "uid": os.geteuid(),
        "user": user_name(os.geteuid()),
    }
