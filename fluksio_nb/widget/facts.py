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
  the peak and the budget), and otherwise from whatever the books service
  recorded for it.
- **The cards come with the snapshot** (:func:`fluksio_nb.overview.with_cards`),
  read as every other view reads them: NVML or ``nvidia-smi``. A card nobody
  could read is shown held or free, without figures; a claim's card memory
  is shown only where it was read, never as zero for unknown.
- **Expected waits travel as start times too** (``expected``: ``at``, rounded
  to :data:`EXPECTED_STEP_S`), for the same reason; ``at`` is ``None`` where
  nobody can tell, and ``why`` always says what the guess is from, or why not.
- **The queue's length is the whole queue's.** On books every user shares, a
  snapshot lists only the first of other users' waiting claims
  (:data:`~fluksio_nb.machine.books.OTHERS_WAITING_LISTED`) and counts the
  rest; ``waiting_unlisted`` carries that count, so the monitor does not
  show a queue of 5,000 as one of 100.
- **Text is text.** Labels and messages come from users; the HTML fallbacks
  escape every one of them, and the front end sets them with ``textContent``.
"""

from __future__ import annotations

import html
import os
import time
from collections.abc import Mapping
from typing import Any

from fluksio_nb import card_compute
from fluksio_nb.card_compute import sliced_card_words
from fluksio_nb.inventory import system_headroom_bytes
from fluksio_nb.queue import asked_words
from fluksio_nb.sampler import Sample
from fluksio_nb.status import ClaimStatus, claim_gpu_text, doing
from fluksio_nb.vocabulary import mark_of

#: Points in a claim's sparklines: a minute at one push a second. The monitor
#: has none: it carries every running claim in each push, and each claim's
#: own status has them.
SPARK_POINTS = 60

#: How far, as a share of the host, its available memory must move to be news.
HOST_MEMORY_STEP = 0.005

#: The left border's colour by phase and ending, as :func:`~fluksio_nb.status.status_bundle`
#: marks it: JupyterLab's theme colour where there is one. Only the border: the
#: text keeps the theme's own colour (4.5:1 in light and dark), a bar needs 3:1.


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
        "gpu": claim_gpu_text(status),
        "peak_gpu_bytes": readings.peak_gpu_bytes,
        "ending": status.ending or "",
        # Its colour, as every view marks this ending (vocabulary.MARKS).
        "mark": mark_of(status.ending) if status.phase == "done" else "",
        "message": status.message,
        "enforcement": enforcement_facts(status),
        "memory_warning": status.memory_warning,
        "warning": status.warning,
        "doing": doing_fact(status),
    }


def doing_fact(status: ClaimStatus) -> str:
    """What the claim does beyond its phase, in words: when a waiting one may start,
    a running one stopped by a signal or sending its results back; else ``""``."""
    if status.phase == "waiting":
        return status.expected_wait
    if status.phase == "running" and (status.sending_since or status.stopped_since):
        # Plain running is what the widget shows of itself.
        return doing(status)
    return ""


def enforcement_facts(status: ClaimStatus) -> dict[str, dict[str, str]]:
    """What holds the claim to each resource; empty until it runs."""
    held = {
        "cores": status.cores_enforcement,
        "memory": status.memory_enforcement,
        "cards": status.cards_enforcement,
    }
    facts = {name: how.as_dict() for name, how in held.items() if how is not None}
    if status.card_compute:
        # A slice's compute, as its worker was told: shown beside what holds the rest.
        facts[card_compute.NAME] = {"label": status.card_compute, "by": "", "why": ""}
    return facts


def _reading(sample: Sample) -> dict[str, Any]:
    return {
        "rss_bytes": sample.rss_bytes,
        "cpu_percent": sample.cpu_percent,
        "cpu_cores": sample.cpu_cores,
        "processes": sample.processes,
        "host_total_bytes": sample.host_total_bytes,
    }


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
    *,
    pid: int | None = None,
    ray: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the monitor shows, from one reading of the books, the host and the cards.

    The cards are the snapshot's (:func:`fluksio_nb.overview.with_cards`);
    a snapshot without them shows each card held or free, with no figures.
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
            # As the snapshot says it (overview.with_cards), or "" where unread.
            "gpu": (claim.get("gpu") or {}).get("text", ""),
            "notebook": claim.get("notebook"),
            #: When its worker was stopped by a signal (SIGSTOP), if it is.
            "stopped_since": (claim.get("readings") or {}).get("stopped_since"),
            #: What the books warn of (its time limit near), or ``""``.
            "warning": claim.get("warning") or "",
        }
        status = statuses.get(claim["ticket"]) if entry["mine"] else None
        if status is not None:
            _add_own_readings(entry, status, now_wall, now_mono)
            # As its own cell knows it, without waiting for the books to hear.
            entry["stopped_since"] = status.stopped_since
            # Its own reading of its own tree, with its card budget: as its cell says.
            entry["gpu"] = claim_gpu_text(status) or entry["gpu"]
        elif claim.get("readings"):
            reading = claim["readings"]
            entry["reading"] = {
                "rss_bytes": reading.get("rss_bytes", 0),
                "cpu_percent": reading.get("cpu_percent", 0.0),
            }
            entry["peak_rss_bytes"] = reading.get("peak_rss_bytes")
        for card in allocation["gpus"] if not allocation.get("gpu_bytes") else ():
            # A card shared by slices has no one holder: its row counts them.
            holder_of[card] = {"ticket": claim["ticket"], "label": _label(claim)}
        running.append(entry)

    waiting = [
        {
            "ticket": claim["ticket"],
            "label": _label(claim),
            "position": claim["position"],
            "asked": asked_words(claim["asked"]),
            "since": round(claim["since"], 1),
            "mine": claim.get("pid") == pid,
            "user": claim.get("user"),
            "notebook": claim.get("notebook"),
            "expected": _expected(claim.get("expected_wait"), now_wall),
        }
        for claim in snapshot.get("waiting", [])
    ]

    read = {card["index"]: card for card in snapshot.get("cards") or ()}
    shared = {row["index"]: sliced_card_words(row, snapshot) for row in _sliced(snapshot)}
    gpus = [
        {
            "id": card,
            "holder": holder_of.get(card),
            "card": _card_figures(read.get(card)),
            # "card 0: 3 claims, 60/80 GB, compute shared by time", for a card shared by slices.
            "slices": shared.get(card),
        }
        for card in card_ids(snapshot)
    ]
    squatting = snapshot.get("squatters")
    total, available = host
    facts = {
        "cpus": {"total": snapshot["cpus"]["total"], "free": snapshot["cpus"]["free"]},
        "ram": {"total": snapshot["ram_bytes"]["total"], "free": snapshot["ram_bytes"]["free"]},
        "gpus": gpus,
        "cards_source": snapshot.get("cards_source"),
        #: Card memory no claim on that card sits above, one line each; ``None``
        #: where nobody can tell (no reading, or books that see one kernel only).
        "squatters": None if squatting is None else [found["text"] for found in squatting],
        "host": {
            "total": total,
            "available": available,
            "headroom": system_headroom_bytes(total),
        },
        "running": running,
        "waiting": waiting,
        #: Other users' waiting claims the books counted but did not list.
        "waiting_unlisted": snapshot.get("waiting_unlisted", 0),
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
        claim["asked"] = asked_words(asked)
    return {
        "address": snapshot["address"],
        "nodes": snapshot["nodes"],
        "total": dict(snapshot["total"]),
        "available": dict(snapshot["available"]),
        "claims": claims,
    }


#: Expected starts are rounded to this many seconds: the guess is rough, and
#: a start time that moved by a second every tick would be news every tick.
EXPECTED_STEP_S = 10.0


def _expected(guess: Mapping[str, Any] | None, now: float) -> dict[str, Any] | None:
    """A waiting claim's expected wait as a start time (``at``, epoch s), and what it is from.

    ``at`` is ``0`` for "any moment now" and ``None`` where nobody can tell;
    ``why`` says what the guess is from, or why there is none.
    """
    if guess is None:
        return None
    seconds = guess.get("seconds")
    if seconds is None:
        at = None
    elif seconds < 1:
        at = 0
    else:
        at = round((now + seconds) / EXPECTED_STEP_S) * EXPECTED_STEP_S
    return {"at": at, "why": guess["why"]}


def _card_figures(card: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A card's memory (to the megabyte, so that drift is no news) and utilisation."""
    if card is None:
        return None
    used = card["used_bytes"]
    return {
        "used_bytes": None if used is None else round(used, -6),
        "total_bytes": card["total_bytes"],
        "utilisation_percent": card["utilisation_percent"],
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


def monitor_html(text: str) -> str:
    """The machine as HTML for a page with no live widget: the text, escaped."""
    return (
        '<pre class="fluksio-monitor-text" style="font-size:12px;line-height:1.4">'
        f"{html.escape(text)}</pre>"
    )


def _label(claim: Mapping[str, Any]) -> str:
    """A claim's label, or whose it is where its owner keeps labels private."""
    return claim["label"] or f"a claim of {claim.get('user') or 'another user'}"


def _sliced(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    rows = (snapshot.get("gpus") or {}).get("cards") or ()
    return [r for r in rows if isinstance(r, dict) and r.get("claims") and not r.get("whole")]
