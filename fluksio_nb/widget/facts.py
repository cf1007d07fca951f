"""What the widgets show, worked out as plain JSON: one claim, or the whole machine.

The front end draws and decides nothing. Every number and word it shows is
computed here, in Python, so that it can be tested without a browser and so
that the text fallback says the same thing the widget does.

Decisions made here:

- **Only a change is news.** The monitor is read every second or two but pushed
  only when what it would draw differs, so readings that drift without
  meaning anything are held steady first: the host's available memory until
  it moves by half a percent of the host (a pixel or two of the bar; see
  :class:`~fluksio_nb.widget.ticker.MachineReader`), a card's memory to the
  megabyte. An idle machine then sends nothing at all.
- **Clocks travel as start times, not ages.** A waiting claim's entry holds
  when it joined the queue (seconds since the epoch), and the front end counts
  the seconds itself from the ``clock`` sent with each push. Sending "waited
  12 s" would change the facts every second and defeat the rule above.
- **A running claim's readings come from the claim itself when it is this
  kernel's** (:func:`fluksio_nb.status.running_statuses`: the latest reading,
  the peak and the budget), and otherwise from whatever the machine-wide
  ledger recorded for it.
- **Text is text.** Labels and messages come from users; the HTML fallbacks
  escape every one of them, and the front end sets them with ``textContent``.
"""

from __future__ import annotations

import contextlib
import html
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from fluksio_nb.budget import human
from fluksio_nb.inventory import system_headroom_bytes
from fluksio_nb.sampler import Sample
from fluksio_nb.status import ClaimStatus

#: Points in a claim's sparklines: a minute at one push a second. The monitor
#: has none: it carries every running claim in each push, and each claim's
#: own status has them.
SPARK_POINTS = 60

#: How far, as a share of the host, its available memory must move to be news.
HOST_MEMORY_STEP = 0.005

_COLOURS = {"waiting": "#b26b00", "running": "#1565c0", "ok": "#2e7d32", "failed": "#c62828"}


# -----------------------------------------------------------------------------
# One claim
# -----------------------------------------------------------------------------


def claim_facts(status: ClaimStatus) -> dict[str, Any]:
    """Everything the claim widget shows, by trait name, but the sparklines' points."""
    readings = status.readings
    latest = readings.latest
    allocation, budget = status.allocation, status.budget
    share = None
    if allocation is not None:
        share = {
            "cpus": allocation.cpus,
            "cores": list(allocation.cores),
            "gpus": list(allocation.gpus),
            "ram_bytes": allocation.ram_bytes,
            "budget_bytes": None if budget is None else budget.applied_bytes,
            "granted_bytes": None if budget is None else budget.granted_bytes,
            "warn_at": None if budget is None else budget.warn_at,
        }
    return {
        "label": status.label,
        "phase": status.phase,
        "asked": status.asked.describe(),
        "position": status.position or 0,
        "holders": list(status.holders),
        "waited_s": round(status.waited_s, 1),
        "share": share,
        "reading": None if latest is None else {**_reading(latest), "n": readings.count},
        "elapsed_s": round(status.elapsed_s, 1),
        "peak_rss_bytes": readings.peak_rss_bytes,
        "mean_cpu_percent": readings.mean_cpu_percent,
        "ending": status.ending or "",
        "message": status.message,
        "enforcement": enforcement_facts(status),
        "memory_warning": status.memory_warning,
    }


def enforcement_facts(status: ClaimStatus) -> dict[str, dict[str, str]]:
    """What holds the claim to each resource; empty until it runs."""
    held = {"cores": status.cores_enforcement, "memory": status.memory_enforcement}
    return {name: how.as_dict() for name, how in held.items() if how is not None}


def _reading(sample: Sample) -> dict[str, Any]:
    return {
        "rss_bytes": sample.rss_bytes,
        "cpu_percent": sample.cpu_percent,
        "cpu_cores": sample.cpu_cores,
        "processes": sample.processes,
        "host_total_bytes": sample.host_total_bytes,
    }


def claim_html(summary: str, phase: str, ending: str) -> str:
    """The claim's status as HTML for a page with no live widget: escaped, inline-styled."""
    if phase == "done":
        colour = _COLOURS["ok" if ending == "ok" else "failed"]
    else:
        colour = _COLOURS.get(phase, _COLOURS["running"])
    body = html.escape(summary).replace("\n", "<br>")
    return (
        f'<div class="fluksio-status" data-phase="{html.escape(phase)}" '
        f'style="border-left:3px solid {colour};padding:2px 8px;color:{colour};'
        f'font-family:var(--jp-ui-font-family,sans-serif);font-size:13px">{body}</div>'
    )


# -----------------------------------------------------------------------------
# The machine
# -----------------------------------------------------------------------------


def card_ids(snapshot: Mapping[str, Any]) -> list[int]:
    """Every card the snapshot knows of, free or held."""
    held = {g for claim in snapshot.get("running", []) for g in claim["allocation"]["gpus"]}
    return sorted(set(snapshot["gpus"].get("free_ids", [])) | held)


def machine_facts(
    snapshot: Mapping[str, Any],
    statuses: Mapping[int, ClaimStatus],
    host: tuple[int, int],
    cards: Mapping[int, Mapping[str, int]] | None = None,
    *,
    pid: int | None = None,
    ray: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the monitor shows, from one reading of the books, the host and the cards.

    ``cards`` is what NVML says of each card by index, or ``None`` without NVML.
    ``ray`` is :func:`fluksio_nb.ray.monitor.ray_snapshot`, or ``None`` when this
    kernel is not connected to Ray, which leaves ``"ray"`` out of the facts.
    """
    pid = os.getpid() if pid is None else pid
    now_wall, now_mono = time.time(), time.monotonic()
    holder_of: dict[int, dict[str, Any]] = {}
    running = []
    for claim in snapshot.get("running", []):
        allocation = claim["allocation"]
        entry: dict[str, Any] = {
            "ticket": claim["ticket"],
            "label": _label(claim),
            "pid": claim.get("pid"),
            "mine": claim.get("pid") == pid,
            "user": claim.get("user"),
            "allocation": {
                "cpus": allocation["cpus"],
                "cores": list(allocation.get("cores") or []),
                "gpus": list(allocation["gpus"]),
                "ram_bytes": allocation["ram_bytes"],
            },
            "budget_bytes": None,
            "started": None,
            "reading": None,
            "peak_rss_bytes": None,
        }
        status = statuses.get(claim["ticket"]) if entry["mine"] else None
        if status is not None:
            _add_own_readings(entry, status, now_wall, now_mono)
        elif claim.get("readings"):
            reading = claim["readings"]
            entry["reading"] = {
                "rss_bytes": reading.get("rss_bytes", 0),
                "cpu_percent": reading.get("cpu_percent", 0.0),
            }
            entry["peak_rss_bytes"] = reading.get("peak_rss_bytes")
        for card in allocation["gpus"]:
            holder_of[card] = {"ticket": claim["ticket"], "label": _label(claim)}
        running.append(entry)

    waiting = [
        {
            "ticket": claim["ticket"],
            "label": _label(claim),
            "position": claim["position"],
            "asked": _asked(claim["asked"]),
            "since": round(claim["since"], 1),
            "mine": claim.get("pid") == pid,
            "user": claim.get("user"),
        }
        for claim in snapshot.get("waiting", [])
    ]

    gpus = [
        {
            "id": card,
            "holder": holder_of.get(card),
            "nvml": None if cards is None else cards.get(card),
        }
        for card in card_ids(snapshot)
    ]
    total, available = host
    facts = {
        "cpus": {"total": snapshot["cpus"]["total"], "free": snapshot["cpus"]["free"]},
        "ram": {"total": snapshot["ram_bytes"]["total"], "free": snapshot["ram_bytes"]["free"]},
        "gpus": gpus,
        "nvml": cards is not None,
        "host": {
            "total": total,
            "available": available,
            "headroom": system_headroom_bytes(total),
        },
        "running": running,
        "waiting": waiting,
        "enforcement": dict(snapshot.get("enforcement") or {}),
    }
    if ray is not None:
        facts["ray"] = ray_facts(ray)
    return facts


def ray_facts(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """The Ray cluster as the monitor draws it: the snapshot without its ages.

    Waiting and running times go as start times (``since``, ``started``), which
    the front end counts from, so a claim's entry changes only with its readings.
    """
    claims = [
        {key: value for key, value in claim.items() if key not in ("waited_s", "elapsed_s")}
        for claim in snapshot["claims"]
    ]
    for claim in claims:
        asked = claim["asked"]
        claim["asked"] = _asked(asked)
    return {
        "address": snapshot["address"],
        "nodes": snapshot["nodes"],
        "total": dict(snapshot["total"]),
        "available": dict(snapshot["available"]),
        "claims": claims,
    }


def _add_own_readings(
    entry: dict[str, Any], status: ClaimStatus, now_wall: float, now_mono: float
) -> None:
    readings = status.readings
    if status.budget is not None:
        entry["budget_bytes"] = status.budget.applied_bytes
    if status.started_at is not None:
        entry["started"] = round(now_wall - (now_mono - status.started_at), 1)
    if readings.latest is not None:
        entry["reading"] = _reading(readings.latest)
    entry["peak_rss_bytes"] = readings.peak_rss_bytes


def _asked(asked: Mapping[str, int]) -> str:
    words = [f"cpus={asked.get('cpus', 1)}"]
    if asked.get("gpus"):
        words.append(f"gpus={asked['gpus']}")
    if asked.get("ram_bytes"):
        words.append(f"ram={human(asked['ram_bytes'])}")
    return " ".join(words)


def monitor_html(text: str) -> str:
    """The machine as HTML for a page with no live widget: the text, escaped."""
    return (
        '<pre class="fluksio-monitor-text" style="font-size:12px;line-height:1.4">'
        f"{html.escape(text)}</pre>"
    )


# -----------------------------------------------------------------------------
# The cards, when NVML is there to ask
# -----------------------------------------------------------------------------


class Nvml:
    """Each card's memory and utilisation, or nothing when NVML cannot be used.

    NVML is initialised on the first read and shut down by :meth:`close`, so
    it is held only while a monitor is being refreshed. A failed start is
    remembered until :meth:`close`, so a machine without a driver pays for
    the attempt once, not on every read.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lib: Any = None
        self._tried = False

    def read(self, ids: Iterable[int]) -> dict[int, dict[str, int]] | None:
        """Memory used and total (bytes, to the megabyte) and utilisation (%) per card."""
        with self._lock:
            lib = self._open()
            if lib is None:
                return None
            cards = {}
            for index in ids:
                try:
                    handle = lib.nvmlDeviceGetHandleByIndex(index)
                    memory = lib.nvmlDeviceGetMemoryInfo(handle)
                    busy = lib.nvmlDeviceGetUtilizationRates(handle)
                except lib.NVMLError:
                    # A card NVML will not describe (lost, or not numbered as the
                    # books number it) is shown as held or free, without figures.
                    continue
                cards[index] = {
                    "memory_used": round(int(memory.used), -6),
                    "memory_total": int(memory.total),
                    "utilisation": int(busy.gpu),
                }
            return cards

    def _open(self) -> Any:
        if self._lib is not None or self._tried:
            return self._lib
        self._tried = True
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
        except (pynvml.NVMLError, OSError):
            # No driver, or a library that does not match it: no figures, no error.
            return None
        self._lib = pynvml
        return pynvml

    def close(self) -> None:
        with self._lock:
            lib, self._lib, self._tried = self._lib, None, False
            if lib is not None:
                with contextlib.suppress(lib.NVMLError):
                    lib.nvmlShutdown()


def _label(claim: Mapping[str, Any]) -> str:
    """A claim's label, or whose it is where its owner keeps labels private."""
    return claim["label"] or f"a claim of {claim.get('user') or 'another user'}"
