"""The machine's claims as Prometheus metrics: one set of families, for both places that serve them.

An admin watching a shared box wants what a cluster's exporters give:
who holds how many cores and cards now, who waits, how long claims waited,
how often claims are halted, cancelled, timed out or lost with their
kernel, and how many core- and card-seconds each person used. Two places
serve them: the machine's books service, which sees every claim as it
happens (``machine init --metrics HOST:PORT``, :mod:`.machine.metrics_http`),
and the Jupyter server, at ``/fluksio/metrics``, which sees what its user
may see. Both build the families here, from the same two things:

- **a snapshot of the books**, in the shape
  :meth:`~fluksio_nb.machine.books.MachineBooks.snapshot` returns (and
  ``/fluksio/api/snapshot`` serves): the gauges, per user, and the cards;
- **a tally of the claims that ended** (:class:`Tally`): counters by user
  and ending, the wait histogram, core- and card-seconds. The service keeps
  its tally as claims are granted and end; the Jupyter server adds its
  user's own usage records up (:mod:`fluksio_nb.usage.recent`).

What it decides:

- **Labels are user names, endings and card indices, nothing else.** A
  claim's label, its notebook and its kernel id are its owner's to share
  and never reach a metric: a scrape is read by whoever reads the
  Prometheus server, not by a user the books ask about.
- **Every label value comes from a bounded set**: endings are mapped onto
  :data:`ENDINGS` (anything else is ``other``), users are the machine's own,
  cards the machine's own. No user can grow the series another person's
  Prometheus stores.
- **Counters count claims that ended.** A claim's core-seconds are counted
  when it ends, from its grant to its end; a running claim's share is the
  gauges' (``fluksio_user_cores``). So a counter only ever grows, whichever
  place serves it. A wait is counted when the claim is granted (the
  service) or once its record is written (the Jupyter server); a claim that
  never got its share waited in vain, and is counted by its ending only.
- **Units are in the names**, as Prometheus's conventions ask: ``_bytes``,
  ``_seconds``, ``_ratio``, ``_total``.
- **Nothing here waits or reads a file.** It turns figures already at hand
  into text, so the service can run it on the loop that answers claims.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from fluksio_nb.gpu_usage import CardsReading, squatters

#: What Prometheus's text format says it is: version 0.0.4, which every
#: Prometheus server since 2.0 reads (``generate_latest`` writes it).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: The endings a counter is labelled with: how a kernel says its claims end
#: (:data:`fluksio_nb.status.Ending`), and how the books service saw one
#: end (a cancel while it waited; its kernel killed; given back by a kernel
#: too old to say how). Spaces become underscores, for PromQL's sake.
ENDINGS = (
    "ok",
    "error",
    "interrupted",
    "halted",
    "timed_out",
    "died",
    "cancelled",
    "time_limit",
    "idle_cards",
    "kernel_died",
    "released",
)
OTHER_ENDING = "other"

#: The wait histogram's buckets, in seconds: from a claim granted on the spot
#: to one that waited out a long training run.
WAIT_BUCKETS_S = (0.01, 0.1, 1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


def ending_label(ending: str) -> str:
    """The label value for how a claim ended: one of :data:`ENDINGS`, or ``other``."""
    said = ending.replace(" ", "_")
    return said if said in ENDINGS else OTHER_ENDING


@dataclass
class _UserTally:
    ended: dict[str, int] = field(default_factory=dict)
    core_seconds: float = 0.0
    card_seconds: float = 0.0
    #: How many waits fell at or below each of :data:`WAIT_BUCKETS_S` (not cumulative).
    waits: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS_S) + 1))
    waited_s: float = 0.0


class Tally:
    """The claims that ended, added up per user: what the counters and the histogram say."""

    def __init__(self) -> None:
        self._users: dict[str, _UserTally] = {}
        #: Counts every change, for whoever keeps the text made from it.
        self.version = 0

    def _of(self, user: str) -> _UserTally:
        found = self._users.get(user)
        if found is None:
            found = self._users[user] = _UserTally()
        return found

    def ended(self, user: str, ending: str, cpus: int, cards: int, ran_s: float) -> None:
        """A claim of ``user``'s ended ``ending``, having held ``cpus`` and ``cards`` ``ran_s``."""
        mine = self._of(user)
        label = ending_label(ending)
        mine.ended[label] = mine.ended.get(label, 0) + 1
        ran_s = max(0.0, ran_s)
        mine.core_seconds += cpus * ran_s
        mine.card_seconds += cards * ran_s
        self.version += 1

    def waited(self, user: str, waited_s: float) -> None:
        """A claim of ``user``'s was granted after waiting ``waited_s``."""
        mine = self._of(user)
        waited_s = max(0.0, waited_s)
        bucket = next(
            (n for n, bound in enumerate(WAIT_BUCKETS_S) if waited_s <= bound),
            len(WAIT_BUCKETS_S),
        )
        mine.waits[bucket] += 1
        mine.waited_s += waited_s
        self.version += 1

    def add_record(self, user: str, record: Any) -> None:
        """A usage record (:class:`~fluksio_nb.records.UsageRecord`) of ``user``'s, counted."""
        self.ended(user, record.ending, record.cpus, len(record.gpus), record.ran_s)
        if record.granted_at is not None:
            self.waited(user, record.waited_s)

    def merge(self, other: Tally) -> None:
        """Add ``other``'s claims to these."""
        for user, theirs in other._users.items():
            mine = self._of(user)
            for ending, count in theirs.ended.items():
                mine.ended[ending] = mine.ended.get(ending, 0) + count
            mine.core_seconds += theirs.core_seconds
            mine.card_seconds += theirs.card_seconds
            mine.waits = [a + b for a, b in zip(mine.waits, theirs.waits, strict=True)]
            mine.waited_s += theirs.waited_s
        self.version += 1

    def families(self) -> Iterator[Metric]:
        ended = CounterMetricFamily(
            "fluksio_claims_ended",
            "Claims that ended, by user and by how they ended (halted, cancelled, timed_out, "
            "kernel_died, ...).",
            labels=["user", "ending"],
        )
        cores = CounterMetricFamily(
            "fluksio_core_seconds",
            "Core-seconds the user's claims held, counted as each claim ends.",
            labels=["user"],
        )
        cards = CounterMetricFamily(
            "fluksio_card_seconds",
            "Card-seconds the user's claims held, counted as each claim ends.",
            labels=["user"],
        )
        waits = HistogramMetricFamily(
            "fluksio_claim_wait_seconds",
            "How long the user's claims waited for their share, from joining the queue to "
            "being granted.",
            labels=["user"],
        )
        for user, mine in sorted(self._users.items()):
            for ending, count in sorted(mine.ended.items()):
                ended.add_metric([user, ending], count)
            cores.add_metric([user], mine.core_seconds)
            cards.add_metric([user], mine.card_seconds)
            below = 0
            buckets = []
            for bound, count in zip((*WAIT_BUCKETS_S, float("inf")), mine.waits, strict=True):
                below += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), below))
            if below:
                waits.add_metric([user], buckets, mine.waited_s)
        yield from (ended, cores, cards, waits)


def _number(value: Any) -> float | None:
    """A figure from a snapshot, if it is one: another user's readings are their word."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def snapshot_families(
    snapshot: Mapping[str, Any], waiting_by_user: Mapping[str, int] | None = None
) -> Iterator[Metric]:
    """The gauges: the machine, each user's claims and shares, each card and its squatters.

    ``waiting_by_user`` is each user's waiting claims counted in full, where
    the caller knows them (the service); otherwise they are counted from the
    claims the snapshot lists, which a busy queue cuts short.
    """
    machine = [
        ("fluksio_machine_cores", "Cores the books hand out.", snapshot["cpus"]["total"]),
        ("fluksio_machine_cores_free", "Cores no claim holds.", snapshot["cpus"]["free"]),
        ("fluksio_machine_cards", "Cards the books hand out.", snapshot["gpus"]["total"]),
        ("fluksio_machine_cards_free", "Cards no claim holds.", snapshot["gpus"]["free"]),
        (
            "fluksio_machine_ram_bytes",
            "Memory the books hand out.",
            snapshot["ram_bytes"]["total"],
        ),
        (
            "fluksio_machine_ram_free_bytes",
            "Memory no claim holds.",
            snapshot["ram_bytes"]["free"],
        ),
    ]
    for name, documentation, value in machine:
        yield GaugeMetricFamily(name, documentation, value=value)

    per_user: dict[str, dict[str, float]] = {}

    def of(user: str) -> dict[str, float]:
        return per_user.setdefault(
            user,
            dict.fromkeys(("running", "waiting", "cores", "cards", "ram", "card_memory"), 0.0),
        )

    for claim in snapshot.get("running", ()):
        mine = of(str(claim["user"]))
        allocation = claim["allocation"]
        mine["running"] += 1
        mine["cores"] += allocation["cpus"]
        mine["cards"] += len(allocation["gpus"])
        mine["ram"] += allocation["ram_bytes"]
        used = _number((claim.get("readings") or {}).get("gpu_bytes"))
        if used is not None:
            mine["card_memory"] += used
    if waiting_by_user is None:
        for claim in snapshot.get("waiting", ()):
            of(str(claim["user"]))["waiting"] += 1
        reader = snapshot.get("user")
        if reader is not None and snapshot.get("mine_unlisted"):
            of(str(reader))["waiting"] += snapshot["mine_unlisted"]
    else:
        for user, count in waiting_by_user.items():
            of(user)["waiting"] += count
    gauges = [
        ("running", "fluksio_claims_running", "Claims running, per user."),
        ("waiting", "fluksio_claims_waiting", "Claims waiting for their share, per user."),
        ("cores", "fluksio_user_cores", "Cores the user's running claims hold."),
        ("cards", "fluksio_user_cards", "Cards the user's running claims hold."),
        ("ram", "fluksio_user_ram_bytes", "Memory the user's running claims hold."),
        (
            "card_memory",
            "fluksio_user_card_memory_bytes",
            "Card memory the user's running claims use, as their kernels last read it.",
        ),
    ]
    for key, name, documentation in gauges:
        family = GaugeMetricFamily(name, documentation, labels=["user"])
        for user, figures in sorted(per_user.items()):
            family.add_metric([user], figures[key])
        yield family
    yield from _card_families(snapshot)


def _card_families(snapshot: Mapping[str, Any]) -> Iterator[Metric]:
    """Each card as last read, and what squatters hold on it; nothing where nothing read them."""
    cards = snapshot.get("cards") or []
    busy = GaugeMetricFamily(
        "fluksio_card_utilisation_ratio",
        "How busy the card was over the driver's last sample period, 0 to 1.",
        labels=["card"],
    )
    used = GaugeMetricFamily(
        "fluksio_card_memory_used_bytes", "Memory in use on the card.", labels=["card"]
    )
    total = GaugeMetricFamily(
        "fluksio_card_memory_total_bytes", "The card's memory.", labels=["card"]
    )
    squatting = GaugeMetricFamily(
        "fluksio_card_squatter_memory_bytes",
        "Card memory held by processes no claim on the card sits above.",
        labels=["card"],
    )
    held_by_squatters: dict[int, float] = {}
    for found in snapshot.get("squatters") or ():
        held_by_squatters[found["card"]] = held_by_squatters.get(found["card"], 0.0) + (
            _number(found.get("used_bytes")) or 0.0
        )
    for card in cards:
        index = [str(card["index"])]
        figures = (
            (busy, _number(card.get("utilisation_percent")), 0.01),
            (used, _number(card.get("used_bytes")), 1),
            (total, _number(card.get("total_bytes")), 1),
        )
        # A figure the card cannot give is no sample, never a zero.
        for family, value, scale in figures:
            if value is not None:
                family.add_metric(index, value * scale)
        if snapshot.get("squatters") is not None:
            squatting.add_metric(index, held_by_squatters.get(card["index"], 0.0))
    yield from (busy, used, total, squatting)


def with_cards_read(snapshot: dict[str, Any], reading: CardsReading | None) -> dict[str, Any]:
    """``snapshot`` with ``cards`` and ``squatters`` as the Jupyter server's snapshot has them.

    For the books service, which sees every claim and its kernel's pid: a
    process on a card is a squatter unless it sits below the kernel of a
    claim holding that card.
    """
    if reading is None:
        return snapshot
    holders: dict[int, list[int]] = {}
    for claim in snapshot.get("running", ()):
        if claim.get("pid") is not None:
            for card in claim["allocation"]["gpus"]:
                holders.setdefault(card, []).append(claim["pid"])
    return {
        **snapshot,
        "cards": [
            {
                "index": card.index,
                "utilisation_percent": card.utilisation_percent,
                "used_bytes": card.used_bytes,
                "total_bytes": card.total_bytes,
            }
            for card in reading.cards
        ],
        "squatters": [
            {"card": found.card, "used_bytes": found.process.used_bytes}
            for found in squatters(reading, holders)
        ],
    }


class _Families:
    """A collector of families made elsewhere: what ``generate_latest`` reads."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def text_of(families: Iterable[Metric]) -> bytes:
    """``families`` in Prometheus's text format (:data:`CONTENT_TYPE`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry)


def exposition(
    snapshot: Mapping[str, Any],
    tally: Tally,
    waiting_by_user: Mapping[str, int] | None = None,
) -> bytes:
    """Every family, in Prometheus's text format (:data:`CONTENT_TYPE`)."""
    return text_of([*snapshot_families(snapshot, waiting_by_user), *tally.families()])


class KeptText:
    """The text in parts, each made again only when what it comes from changed.

    The books change with every report of a claim's readings, the tally only
    as claims are granted and end: a scrape on a busy machine makes the
    gauges again, and the counters seldom.
    """

    def __init__(self) -> None:
        self._parts: dict[str, tuple[Any, bytes]] = {}

    def part(self, name: str, key: Any, families: Callable[[], Iterable[Metric]]) -> bytes:
        kept = self._parts.get(name)
        if kept is None or kept[0] != key:
            kept = self._parts[name] = (key, text_of(families()))
        return kept[1]
