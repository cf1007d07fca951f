"""What the status bar adds to the shares: the host now, each kernel's memory, the reserve.

Users of jupyter-resource-usage look at the status bar for the notebook's
memory and the machine's CPU and memory in use. The shares say what is
claimed, not what is used, and a 2-core machine whose books hand out one
core says "1" without saying where the other went. This module adds those
facts to the server's snapshot.

What it decides:

- **Cheap on every poll.** The host's CPU and memory are the latest point
  of the server's history (:mod:`fluksio_nb.machine_history`), taken on its
  own timer: a poll reads nothing of the host itself. Each kernel's memory
  is one ``psutil`` read per kernel this server started, in the worker
  thread that reads the books.
- **A kernel's memory is its own resident memory**, as ``%claims`` says it
  (``RSS``): a claim's worker is counted in its claim, not twice.
- **The cores kept back** are the machine's cores the books do not hand
  out (``reserve_cpus``, for kernels and the server), as this server's
  settings count the machine: every view can say "2 cores, 1 kept back for
  kernels" rather than a bare 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psutil


def kernel_memory(pids: Mapping[str, int]) -> dict[str, int]:
    """Each kernel's resident bytes, by kernel id; a kernel whose process is gone is left out."""
    found = {}
    for kernel_id, pid in pids.items():
        try:
            found[kernel_id] = int(psutil.Process(pid).memory_info().rss)
        except (psutil.Error, OSError):
            continue
    return found


def cores_kept_back(claimable: int) -> int:
    """The machine's cores past the ``claimable`` ones the books hand out."""
    from fluksio_nb.inventory import usable_cpus
    from fluksio_nb.settings import load_settings

    settings = load_settings()
    machine = settings.cpus if settings.cpus is not None else usable_cpus()
    return max(0, machine - claimable)


def host_now(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The host's CPU and memory at the latest point of its history; ``None`` before one."""
    if not points:
        return None
    latest = points[-1]
    return {
        key: latest[key] for key in ("at", "cpu_percent", "memory_used_bytes", "memory_total_bytes")
    }


def with_glance(snapshot: dict[str, Any], kernel_pids: Mapping[str, int]) -> dict[str, Any]:
    """``snapshot`` with ``host``, ``kernel_memory`` and ``cpus.kept_back``. Blocking."""
    from fluksio_nb.machine_history import process_history

    snapshot["host"] = host_now(process_history().points())
    snapshot["kernel_memory"] = kernel_memory(kernel_pids)
    snapshot["cpus"]["kept_back"] = cores_kept_back(int(snapshot["cpus"]["total"]))
    return snapshot
