"""How the slices of a card share its compute, and the words every view says it in.

A slice's memory is its budget, held as any budget is; its compute is not
held the same way. Where an MPS control daemon runs, CUDA gives each client
the share of the card's cores its ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` says,
so a slice gets its share of them (:func:`fluksio_nb.env.derive_env` tells its
worker). Everywhere else the card's time is shared: each slice's kernels take
turns on all its cores, and a busy neighbour slows it down. The two are not
the same promise, so no view shows a slice without saying which holds
(the cell's status line, ``%claims``, ``fluksio-nb``, the panel).

What this module decides:

- **An MPS control daemon is found by its process**, as an admin starts it
  (``nvidia-cuda-mps-control -d``): its name in ``/proc``, which the kernel
  cuts to 15 characters. Whoever runs it, root or a user, any process sees it.
  Looked for at most every :data:`LOOKED_FOR_EVERY_S` in a process: a monitor
  draws every second, and a walk of ``/proc`` reads a file per process.
- **A claim's own words come from what its worker was told**: its
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, set by the books' share or by the
  claim's own ``env``, and nothing else.
- **The machine's words go in every snapshot**, as one more entry of what
  holds a share (``enforcement``, named :data:`NAME`) where the machine has
  cards: each view already shows those entries on its "held by" line, the
  panel included, and beside each card shared by slices.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

#: What an MPS control daemon's process is called in ``/proc/PID/comm``:
#: ``nvidia-cuda-mps-control``, cut to the kernel's 15 characters.
MPS_DAEMON_COMM = "nvidia-cuda-mps"

#: The share of the card's cores MPS gives a client, in percent.
MPS_SHARE_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"

#: The name of the "held by" entry that says how slices share a card's compute.
NAME = "card slices"

#: What acts, as the entry's ``by`` says it.
BY_TIME, BY_MPS = "time", "MPS"

BY_TIME_WORDS = "compute shared by time"

#: How long an answer of :func:`mps_daemon_runs_now` is kept, as the cards' readings are.
LOOKED_FOR_EVERY_S = 2.0

_last: tuple[float, bool] | None = None
_lock = threading.Lock()


def by_mps_words(percent: str | None = None) -> str:
    """A slice's compute under MPS: its share of the cores, where known."""
    if percent:
        return f"compute: {percent}% of the card's cores (MPS)"
    return "compute: each its share of the card's cores (MPS)"


def mps_daemon_runs(proc: str = "/proc") -> bool:
    """Whether an MPS control daemon runs here: a slice's compute is then its share of the
    card's cores (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``), else the card's time is shared."""
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return False
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/comm") as comm:
                if comm.read().strip() == MPS_DAEMON_COMM:
                    return True
        except OSError:
            # Gone between the listing and the read, or not ours to read.
            continue
    return False


def mps_daemon_runs_now() -> bool:
    """:func:`mps_daemon_runs`, looked for at most every :data:`LOOKED_FOR_EVERY_S`."""
    global _last
    with _lock:
        now = time.monotonic()
        if _last is None or now - _last[0] >= LOOKED_FOR_EVERY_S:
            _last = (now, mps_daemon_runs())
        return _last[1]


def claim_compute_words(env: Mapping[str, str]) -> str:
    """How one slice's compute is shared, from the environment its worker was started with."""
    percent = env.get(MPS_SHARE_VAR)
    return by_mps_words(percent) if percent else BY_TIME_WORDS


def compute_sharing(mps: bool | None = None) -> dict[str, str]:
    """How the slices of this machine's cards share their compute now, for a snapshot: an
    entry of what holds a share (:meth:`fluksio_nb.enforcement.Enforcement.as_dict`)."""
    if mps_daemon_runs_now() if mps is None else mps:
        why = (
            f"an MPS control daemon runs: each slice's worker is told {MPS_SHARE_VAR}, "
            "its share of the card's cores"
        )
        return {"label": by_mps_words(), "by": BY_MPS, "why": why}
    why = (
        "no MPS control daemon (nvidia-cuda-mps-control) runs here: the slices of a card "
        "take turns on all its cores"
    )
    return {"label": BY_TIME_WORDS, "by": BY_TIME, "why": why}


def with_card_compute(snapshot: dict[str, Any]) -> dict[str, Any]:
    """``snapshot`` with how slices share a card's compute among what holds a share.

    Only where the books have cards: a machine without them shares no card.
    """
    if (snapshot.get("gpus") or {}).get("total"):
        # A copy: a queue hands out its own dict of what holds a share.
        held = dict(snapshot.get("enforcement") or {})
        held[NAME] = compute_sharing()
        snapshot["enforcement"] = held
    return snapshot


def sliced_card_words(row: Mapping[str, object], snapshot: Mapping[str, Any]) -> str:
    """A card shared by slices as every view says it: ``card 0: 3 claims, 60/80 GB, compute
    shared by time``; without the last part from a snapshot that does not say it."""
    from fluksio_nb.card_slices import card_words

    sharing = (snapshot.get("enforcement") or {}).get(NAME) or {}
    label = sharing.get("label") if isinstance(sharing, Mapping) else None
    return f"{card_words(row)}, {label}" if label else card_words(row)
