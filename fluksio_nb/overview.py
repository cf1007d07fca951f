"""The machine at a glance: read without claiming, and said in words.

Four places show the machine: ``fluksio-nb`` in a terminal, the server's API
that JupyterLab's status bar and panel poll, the ``%claims`` monitor, and its
text fallback where no widget can be drawn. They should never disagree, so
they read the machine here (:func:`read_books`) and say it here
(:func:`describe_snapshot`, :func:`describe_monitor`).

A reader makes no claims: it reads whichever books are in force as they are,
marks the reader's own claims, and says what holds claims to their share.
Ray is looked at only where this kernel has already imported it.

The cards are read here too (:func:`with_cards`), for every view at once:
each card's utilisation and memory, what each running claim holds of its
cards, and the **squatters**, card memory held by a process no claim on that
card sits above. What nobody could read is left out, never shown as zero:
a snapshot without a card reading has no ``cards`` and no ``gpu`` figures,
and squatters are named only where the books see every claim (not where
each kernel keeps its own).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from fluksio_nb.budget import human
from fluksio_nb.card_compute import sliced_card_words, with_card_compute
from fluksio_nb.expected_wait import describe_wait
from fluksio_nb.gpu_usage import CardsReading, held_below, kernel_cards, squatters
from fluksio_nb.inventory import format_cpu_list
from fluksio_nb.kernel import Books, books_in_force, enforcement_in_force
from fluksio_nb.queue import asked_words, share_words
from fluksio_nb.settings import Settings, load_settings
from fluksio_nb.shown import shown
from fluksio_nb.status import describe_gpu, ordinal, stopped_text
from fluksio_nb.vocabulary import clock, times_words


def read_books(books: Books | None = None) -> dict[str, Any]:
    """The machine as a reader that makes no claims sees it: the server, the terminal.

    Every claim in it says whose it is (``user``) and whether it is the
    reader's (``mine``); ``books`` says which books these are, and ``ledger``
    where. Blocking: the server calls it from a worker thread.
    """
    # Read once: the server asks for this every second or so.
    settings = load_settings()
    books = books or books_in_force(settings=settings)
    snapshot = None
    if books.socket is not None:
        from fluksio_nb.errors import ServiceUnavailable
        from fluksio_nb.machine.connection import REACH_WITHIN_S, read_snapshot

        try:
            snapshot = read_snapshot(
                books.socket, books.owner, within=REACH_WITHIN_S if books.mode == "machine" else 0
            )
        except ServiceUnavailable:
            if books.mode == "machine":
                raise
            # No service of the user's runs: none of their kernels holds a
            # claim. A view never starts one, or the server would keep it alive.
    if snapshot is None:
        snapshot = machine_as_found(settings)
    for claim in snapshot["running"] + snapshot["waiting"]:
        claim.setdefault("mine", claim.get("user") == snapshot["user"])
    snapshot["books"] = books.mode
    snapshot["ledger"] = None if books.where is None else str(books.where)
    # The books' own core ids: free or held, they are every one they hand out.
    held = {c for claim in snapshot["running"] for c in claim["allocation"].get("cores") or ()}
    core_ids = set(snapshot["cpus"].get("free_ids") or ()) | held
    snapshot["enforcement"] = enforcement_in_force(
        settings, sorted(core_ids), snapshot["cpus"]["total"], snapshot["gpus"]["total"]
    )
    # Kernel-only books show no claims: nobody here can say whose memory is whose.
    snapshot["sees_every_claim"] = books.mode != "kernel"
    with_trusted_readings(snapshot)
    with_card_compute(snapshot)
    return with_history_facts(with_cards(snapshot, every_claim_known=books.mode != "kernel"))


def machine_as_found(settings: Settings) -> dict[str, Any]:
    """Books nobody has claimed from: the machine as this process finds it."""
    from fluksio_nb.books import ResourceAccountant
    from fluksio_nb.identity import my_user
    from fluksio_nb.inventory import take_inventory
    from fluksio_nb.queue import ClaimQueue

    queue = ClaimQueue(ResourceAccountant.from_inventory(take_inventory(settings)))
    return {**queue.snapshot(), "user": my_user()}


def with_trusted_readings(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Each running claim's readings as every view may show them, whoever reported them.

    The service refuses figures out of range, but services of earlier
    versions pass them on as
    their kernels said them: a figure no view could show is dropped here,
    with the readings it came in, rather than fail every view that reads it.
    """
    from fluksio_nb.machine.protocol import trusted_readings

    for claim in snapshot.get("running", []):
        if claim.get("readings") is not None:
            claim["readings"] = trusted_readings(claim["readings"])
    return snapshot


def kernel_snapshot() -> dict[str, Any]:
    """The kernel's own books as ``%claims`` shows them, with the cards.

    This kernel's running claims carry their own readings where the books
    keep none (kernel-only books): their peak card memory is known here.
    """
    from fluksio_nb.kernel import accountant
    from fluksio_nb.queue import ClaimQueue
    from fluksio_nb.status import running_statuses

    queue = accountant()
    snapshot = queue.snapshot()
    statuses = running_statuses()
    for claim in snapshot["running"]:
        status = statuses.get(claim["ticket"])
        if claim.get("readings") or status is None or claim.get("pid") != os.getpid():
            continue
        readings = status.readings
        latest = readings.latest
        claim["readings"] = {
            "gpu_bytes": None if latest is None else latest.gpu_bytes,
            "peak_gpu_bytes": readings.peak_gpu_bytes,
            "gpu_percent": None if latest is None else latest.gpu_percent,
        }
    # A kernel's own queue sees no other kernel's claims: it names no squatters.
    snapshot["sees_every_claim"] = not isinstance(queue, ClaimQueue)
    with_trusted_readings(snapshot)
    with_card_compute(snapshot)
    return with_history_facts(with_cards(snapshot, every_claim_known=snapshot["sees_every_claim"]))


def with_history_facts(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Each claim's notebook (``None`` where unknown), and each waiting claim's expected wait.

    The wait is guessed from the usage records (:mod:`fluksio_nb.expected_wait`);
    records that cannot be read make it "cannot tell", and never fail the view.
    """
    from fluksio_nb.expected_wait import CANNOT_TELL, with_expected_waits
    from fluksio_nb.usage.recent import process_recent_usage

    for claim in snapshot.get("running", []) + snapshot.get("waiting", []):
        claim.setdefault("notebook", None)
    try:
        durations, shapes = process_recent_usage().past_runs()
    except Exception as error:
        why = f"{CANNOT_TELL}the usage records could not be read ({error})"
        for claim in snapshot.get("waiting", []):
            claim["expected_wait"] = {"seconds": None, "why": why}
        return snapshot
    return with_expected_waits(snapshot, durations, shapes)


_UNREAD = object()


def with_cards(
    snapshot: dict[str, Any],
    reading: CardsReading | object | None = _UNREAD,
    *,
    every_claim_known: bool = True,
) -> dict[str, Any]:
    """The snapshot with what the cards are doing, for every view: the one place it is worked out.

    Adds ``cards_source`` (``"nvml"``, ``"nvidia-smi"``, or ``None`` when
    nothing read the cards), ``cards`` (each card's utilisation and memory,
    and which claims hold it), ``squatters`` (one entry per process holding
    card memory with no claim on that card above it; ``None`` where that
    cannot be known: no reading, or books that do not see every claim), and
    to each running claim ``gpu``: what it holds on each of its cards, and
    its peak, or ``None`` for a claim without cards or where nothing says.
    Each card and each claim's ``gpu`` has its ``text``, as every view says it.

    A claim's processes are found below its owner's pid: its workers are
    the kernel's children. ``reading`` is the cards as read; by default this
    process's reader's (:func:`~fluksio_nb.gpu_usage.kernel_cards`), at most
    every two seconds whoever asks.
    """
    if reading is _UNREAD:
        reading = kernel_cards().latest()
    assert reading is None or isinstance(reading, CardsReading)
    running = snapshot.get("running", [])
    holders: dict[int, list[int]] = {}
    #: Per card, the users of its claims whose kernel's pid is not shown (another
    #: user's): their processes there are theirs to have, not squatters.
    users_holding: dict[int, set[str]] = {}
    tickets: dict[int, list[int]] = {}
    for claim in running:
        for card in claim["allocation"]["gpus"]:
            if claim.get("pid") is not None:
                holders.setdefault(card, []).append(claim["pid"])
            elif claim.get("user"):
                users_holding.setdefault(card, set()).add(claim["user"])
            tickets.setdefault(card, []).append(claim["ticket"])
        gpu = claim["gpu"] = _claim_gpu(claim, reading)
        if gpu is not None:
            gpu["text"] = describe_claim_gpu(gpu, claim["allocation"]["gpus"])
    snapshot["cards_source"] = None if reading is None else reading.source
    snapshot["cards"] = (
        []
        if reading is None
        else [
            {
                "index": card.index,
                "uuid": card.uuid,
                "utilisation_percent": card.utilisation_percent,
                "used_bytes": card.used_bytes,
                "total_bytes": card.total_bytes,
                "tickets": tickets.get(card.index, []),
            }
            for card in reading.cards
        ]
    )
    for card in snapshot["cards"]:
        card["text"] = f"card {card['index']}: {_card_use(card)}"
    snapshot["squatters"] = (
        None
        if reading is None or not every_claim_known
        else [
            {
                "card": found.card,
                "pid": found.process.pid,
                "driver_pid": found.process.driver_pid,
                "user": found.process.user,
                "used_bytes": found.process.used_bytes,
                "text": found.describe(),
            }
            for found in squatters(reading, holders)
            if found.process.user not in users_holding.get(found.card, ())
        ]
    )
    return snapshot


def _claim_gpu(claim: Mapping[str, Any], reading: CardsReading | None) -> dict[str, Any] | None:
    """What a running claim holds of its cards, as read here, or as its kernel last said."""
    gpus = claim["allocation"]["gpus"]
    if not gpus:
        return None
    said = claim.get("readings") or {}
    peak = said.get("peak_gpu_bytes")
    cards = []
    if reading is not None and claim.get("pid") is not None:
        owner = {claim["pid"]}
        for index in gpus:
            card = reading.card(index)
            if card is None:
                continue
            held = held_below(card, owner)
            cards.append(
                {
                    "index": index,
                    "held_bytes": held,
                    "utilisation_percent": card.utilisation_percent,
                    "used_bytes": card.used_bytes,
                    "total_bytes": card.total_bytes,
                }
            )
    if cards:
        held_bytes: int | None = sum(card["held_bytes"] for card in cards)
        percent = _mean([card["utilisation_percent"] for card in cards])
    else:
        # Nothing here reads the cards; the claim's own kernel may have.
        held_bytes, percent = said.get("gpu_bytes"), said.get("gpu_percent")
    if held_bytes is None and peak is None:
        return None
    if held_bytes is not None and peak is not None:
        peak = max(peak, held_bytes)
    return {"cards": cards, "held_bytes": held_bytes, "peak_bytes": peak, "percent": percent}


def _mean(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return round(sum(known) / len(known), 1) if known else None


def sliced_cards(snapshot: Mapping[str, Any]) -> list[str]:
    """Each card shared by slices: ``card 0: 3 claims, 60/80 GB, compute shared by time``;
    none from older books."""
    rows = (snapshot.get("gpus") or {}).get("cards") or ()
    return [
        sliced_card_words(row, snapshot)
        for row in rows
        if isinstance(row, Mapping) and row.get("claims") and not row.get("whole")
    ]


def describe_snapshot(snapshot: dict, finished: list[dict] | None = None) -> str:
    """The snapshot as a few lines of text: every user's claims, the reader's marked.

    Used over total, as the status bar and the panel count. Places in the
    queue, not ticket numbers. ``finished`` is the claims that ended lately
    (:meth:`~fluksio_nb.usage.recent.RecentUsage.finished`), newest first.
    """
    cpus, gpus, ram = snapshot["cpus"], snapshot["gpus"], snapshot["ram_bytes"]
    lines = [
        f"cpus  {cpus['total'] - cpus['free']}/{cpus['total']} used",
    ]
    if gpus["total"]:
        # A machine without cards says nothing of them, in every view.
        lines.append(f"gpus  {gpus['total'] - gpus['free']}/{gpus['total']} used")
    lines += [f"  {card['text']}" for card in snapshot.get("cards") or ()]
    lines += [f"  {words}" for words in sliced_cards(snapshot)]
    lines.append(f"ram   {human(ram['total'] - ram['free'])}/{human(ram['total'])} used")
    held = snapshot.get("enforcement") or {}
    if held:
        said = " · ".join(f"{name}: {how['label']}" for name, how in held.items())
        lines.append(f"held by  {said}")
    for claim in snapshot.get("running", []):
        held = claim["allocation"]
        cores = format_cpu_list(held["cores"]) if held.get("cores") else ""
        stopped = stopped_text((claim.get("readings") or {}).get("stopped_since"))
        share = share_words(
            held["cpus"], held["gpus"], held["ram_bytes"], cores, held.get("gpu_bytes") or 0
        )
        lines.append(
            f"running  {_whose(claim)}{_in_notebook(claim)}: {share} ({_where(claim)})"
            + (f"; {claim['gpu']['text']}" if claim.get("gpu") else "")
            + (f"; {stopped}" if stopped else "")
            # The books' own words (its time limit near): every reader sees it coming.
            + (f"; {claim['warning']}" if claim.get("warning") else "")
        )
    for claim in snapshot.get("waiting", []):
        wait = claim.get("expected_wait")
        lines.append(
            f"waiting  {ordinal(claim['position'])} in the queue: {_whose(claim)}"
            f"{_in_notebook(claim)}: asks {asked_words(claim['asked'])}"
            + (f"; {describe_wait(wait)}" if wait else "")
        )
    if unlisted := snapshot.get("waiting_unlisted"):
        lines.append(f"waiting  and {unlisted} more of other users' claims, not listed")
    for squatter in snapshot.get("squatters") or ():
        # A process's name is its owner's to choose.
        lines.append(f"squatter {shown(squatter['text'])}")
    if finished:
        lines.append(f"finished (last {len(finished)}, newest first)")
        lines += [f"  {describe_finished(claim)}" for claim in finished]
    return "\n".join(lines)


def describe_finished(claim: Mapping[str, Any]) -> str:
    """One finished claim (``GET fluksio/api/finished``'s entry) in a line.

    ``15:19:17 error: fit (ana) in a.ipynb, waited 0.1 s, ran 8.7 s, cpus=1 ram=1.0GB,
    peak RSS 1.2GB: ValueError: the model diverged``, in :mod:`fluksio_nb.vocabulary`'s words.
    """
    ended = clock(claim["ended_at"])
    whose = f"{shown(claim['label'])} ({shown(claim['user'])})"
    where = f" in {shown(claim['notebook'])}" if claim.get("notebook") else ""
    words = times_words(claim["waited_s"], claim.get("ran_s"))
    if claim.get("ran_s") is not None and claim.get("cpus"):
        words.append(finished_share(claim))
    if claim.get("peak_rss_bytes") is not None:
        words.append(f"peak RSS {human(claim['peak_rss_bytes'])}")
    if claim.get("peak_gpu_bytes") is not None:
        words.append(f"peak GPU {human(claim['peak_gpu_bytes'])}")
    # The user's own error line only ever reaches here (usage.recent reads no one else's).
    error = f": {shown(claim['error'])}" if claim.get("error") else ""
    return f"{ended} {shown(claim['ending'])}: {whose}{where}, " + ", ".join(words) + error


def finished_share(claim: Mapping[str, Any]) -> str:
    """A finished claim's share as the record spells it: ``cpus=1 gpus=1 (card 0) ram=4.0GB``.

    Which cores held it, and how, is said while it runs: once it has ended, what it held.
    """
    return share_words(claim["cpus"], claim.get("gpus") or [], claim.get("ram_bytes") or 0)


def _in_notebook(claim: Mapping[str, Any]) -> str:
    return f" in {shown(claim['notebook'])}" if claim.get("notebook") else ""


def _card_use(card: Mapping[str, Any]) -> str:
    """A card's utilisation and memory, as far as the driver said."""
    words = []
    if card["utilisation_percent"] is not None:
        words.append(f"{card['utilisation_percent']:.0f}% busy")
    if card["used_bytes"] is not None:
        words.append(f"{human(card['used_bytes'])}/{human(card['total_bytes'])} used")
    return ", ".join(words) or "no figures from the driver"


def describe_claim_gpu(gpu: Mapping[str, Any] | None, gpus: list[int]) -> str:
    """A running claim's ``gpu`` (from :func:`with_cards`) in words, or ``""`` where unread.

    ``GPU 1.2GB on card 0 (38% busy), peak 2.0GB``.
    """
    if gpu is None:
        return ""
    if gpu["cards"]:
        cards = [(c["index"], c["held_bytes"], c["utilisation_percent"]) for c in gpu["cards"]]
        said = describe_gpu(cards)
    elif gpu["held_bytes"] is not None:
        busy = "" if gpu["percent"] is None else f" ({gpu['percent']:.0f}% busy)"
        on = ",".join(map(str, gpus))
        said = f"GPU {human(gpu['held_bytes'])} on card{'s' if len(gpus) > 1 else ''} {on}{busy}"
    else:
        said = ""
    if gpu["peak_bytes"] is not None:
        said += f"{', ' if said else 'GPU '}peak {human(gpu['peak_bytes'])}"
    return said


def _whose(claim: dict) -> str:
    """The label, marked as the reader's; another user's name where it is theirs."""
    # Escaped: another user's label with a newline could print a line of its own.
    label = shown(claim.get("label"))
    user = shown(claim.get("user"))
    if claim.get("mine", True):
        return f"{label} (yours)" if "mine" in claim else label
    return f"{label} ({user})" if claim.get("label") else f"a claim of {user}"


def _where(claim: dict) -> str:
    # Another user's kernel's pid is shown to admins only (machine.books).
    return "another user's kernel" if claim.get("pid") is None else f"pid {claim['pid']}"


def ray_now() -> dict | None:
    """This kernel's Ray cluster and its claims on it; ``None`` while Ray is not connected.

    Ray is looked for in ``sys.modules`` first, and never imported just to
    look: a kernel that has not imported Ray pays one dictionary lookup.
    """
    if sys.modules.get("ray") is None:
        return None
    from fluksio_nb.ray.monitor import ray_snapshot

    return ray_snapshot()


def describe_monitor(
    snapshot: dict,
    ray: dict | None = None,
    *,
    history: list[dict] | None = None,
    kernel_rss_bytes: int | None = None,
    finished: list[dict] | None = None,
) -> str:
    """What ``%claims`` says as text: the machine's books, then the Ray cluster if connected.

    With ``history`` (the points of :mod:`fluksio_nb.machine_history`), the
    last ten minutes as a line of blocks each for CPU and memory, with their
    scales; with ``kernel_rss_bytes``, this kernel's own memory.
    """
    lines = [describe_snapshot(snapshot, finished)]
    if kernel_rss_bytes is not None:
        lines.append(f"this kernel  RSS {human(kernel_rss_bytes)}")
    if history:
        lines += describe_history(history)
    text = "\n".join(lines)
    if ray is None:
        return text
    from fluksio_nb.ray.monitor import describe_ray

    return f"{text}\n{describe_ray(ray)}"


_BLOCKS = " ▁▂▃▄▅▆▇█"


def _blocks(values: list[float], top: float, width: int = 40) -> str:
    if not values or top <= 0:
        return ""
    step = max(1, -(-len(values) // width))
    buckets = [max(values[i : i + step]) for i in range(0, len(values), step)]
    return "".join(
        _BLOCKS[min(len(_BLOCKS) - 1, round(v / top * (len(_BLOCKS) - 1)))] for v in buckets
    )


def describe_history(points: list[dict]) -> list[str]:
    """The last ten minutes in a few lines: CPU and memory as blocks, their scales, the latest."""
    if not points:
        return []
    last = points[-1]
    minutes = max(1, round((last["at"] - points[0]["at"]) / 60))
    cpu = _blocks([p["cpu_percent"] for p in points], 100.0)
    outside = last.get("cpu_outside_claims_percent")
    outside_text = "" if outside is None else f", {outside:.0f}% outside claims"
    total = last["memory_total_bytes"]
    memory = _blocks([p["memory_used_bytes"] for p in points], float(total))
    lines = [
        f"history  the last {minutes} min, oldest left",
        f"  cpu  |{cpu}| 0-100% · now {last['cpu_percent']:.0f}% used{outside_text}",
        f"  ram  |{memory}| 0-{human(total)} · now "
        f"{human(last['memory_used_bytes'])}/{human(total)} used",
    ]
    for card in last.get("cards") or ():
        if card.get("total_bytes") and card.get("used_bytes") is not None:
            used = [
                next((c["used_bytes"] or 0 for c in p["cards"] if c["index"] == card["index"]), 0)
                for p in points
            ]
            lines.append(
                f"  card {card['index']} |{_blocks(used, float(card['total_bytes']))}| "
                f"0-{human(card['total_bytes'])} · now {human(card['used_bytes'])}/"
                f"{human(card['total_bytes'])} used"
            )
    return lines
