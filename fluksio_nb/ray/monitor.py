"""The Ray cluster and this kernel's claims on it, as the monitor shows them.

``%claims`` and the status bar read the cluster beside the machine's books.
They ask every second, so asking must cost nothing where Ray is not in use:
:func:`ray_snapshot` never imports Ray nor connects, and says ``None`` until
the kernel is connected.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fluksio_nb.budget import human
from fluksio_nb.ray.connection import _alive_nodes, _gcs_address, ray_connection
from fluksio_nb.status import claim_gpu_text

if TYPE_CHECKING:
    from fluksio_nb.ray.claim import RayClaim


def ray_snapshot() -> dict[str, Any] | None:
    """The Ray cluster this kernel is connected to, and this kernel's claims on it.

    ``None`` when Ray is not imported or not connected: asking never imports
    Ray nor connects, so a monitor can call this every second for free.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        total = ray.cluster_resources()
        available = ray.available_resources()
        nodes = len(_alive_nodes(ray.nodes()))
    except Exception:
        return None
    live = ray_connection.claims()
    return {
        "address": ray_connection.connected_to or _gcs_address(ray),
        "nodes": nodes,
        "total": _resources(total),
        "available": _resources(available),
        "claims": [_claim_facts(claimed) for claimed in live],
    }


def _resources(resources: Mapping[str, float]) -> dict[str, float | int]:
    return {
        "cpus": resources.get("CPU", 0.0),
        "gpus": resources.get("GPU", 0.0),
        "memory_bytes": int(resources.get("memory", 0)),
        "object_store_bytes": int(resources.get("object_store_memory", 0)),
    }


def _claim_facts(claimed: RayClaim) -> dict[str, Any]:
    status = claimed.status
    latest = status.readings.latest
    # Start times as the wall clock has them, for a monitor that counts the
    # seconds itself: an age would change on every read.
    now_wall, now_mono = time.time(), time.monotonic()
    started = status.started_at
    return {
        "label": status.label,
        "phase": status.phase,
        "asked": {
            "cpus": status.asked.cpus,
            "gpus": status.asked.gpus,
            "ram_bytes": status.asked.ram_bytes or None,
        },
        "node": claimed.node,
        "gpus": list(claimed.allocation.gpus) if claimed.allocation else [],
        "waited_s": round(status.waited_s, 1),
        "elapsed_s": round(status.elapsed_s, 1),
        "rss_bytes": latest.rss_bytes if latest else None,
        "peak_rss_bytes": status.readings.peak_rss_bytes,
        "cpu_percent": latest.cpu_percent if latest else None,
        "budget_bytes": status.budget.applied_bytes if status.budget else None,
        # The node's own reading of its cards, where it reads them: unread is not zero.
        "gpu": claim_gpu_text(status),
        "peak_gpu_bytes": status.readings.peak_gpu_bytes,
        "since": round(now_wall - (now_mono - status.asked_at), 1),
        "started": None if started is None else round(now_wall - (now_mono - started), 1),
    }


def describe_ray(snapshot: Mapping[str, Any]) -> str:
    """:func:`ray_snapshot` as a few lines of text, the monitor's fallback beside the machine's."""
    total, free = snapshot["total"], snapshot["available"]
    memory = total["memory_bytes"]
    nodes = snapshot["nodes"]
    lines = [
        f"ray   {snapshot['address'] or 'a cluster'}, {nodes} node{'s' if nodes != 1 else ''}",
        f"ray cpus    {total['cpus'] - free['cpus']:g}/{total['cpus']:g} used",
        f"ray gpus    {total['gpus'] - free['gpus']:g}/{total['gpus']:g} used",
        f"ray memory  {human(memory - free['memory_bytes'])}/{human(memory)} used",
    ]
    for claim in snapshot["claims"]:
        asked = claim["asked"]
        words = [f"cpus={asked['cpus']}", f"gpus={asked['gpus']}"]
        if asked["ram_bytes"]:
            words.append(f"ram={human(asked['ram_bytes'])}")
        line = f"ray {claim['phase']:<8} {claim['label']!s}: {' '.join(words)}"
        if claim["gpus"]:
            line += f", cards {','.join(map(str, claim['gpus']))}"
        if claim["rss_bytes"] is not None:
            budget = claim["budget_bytes"]
            line += f", RSS {human(claim['rss_bytes'])}"
            line += f" of {human(budget)}" if budget else ""
            line += f", CPU {claim['cpu_percent']:.0f}%"
        if claim.get("gpu"):
            line += f", {claim['gpu']}"
        lines.append(line)
    return "\n".join(lines)
