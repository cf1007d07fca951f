"""Cards given back when they sit idle while someone waits: ``idle_card_minutes``.

On a shared machine the card is what people wait for, and the commonest
waste of one is a claim left holding it: a notebook that trained in the
morning and now sits at a prompt, its model still in card memory. Nobody
can tell from outside whether its owner will be back; the driver can tell
that the card does nothing. So an admin who sets ``"idle_card_minutes": N``
in ``machine.json`` has the books service give such cards back, as Slurm
ends a job past its limit and JupyterHub's idle culler ends a server:
with a warning first, and the reason after.

What it decides:

- **Idle is what the driver says, over the whole window.** A card is idle
  from the first reading that finds it at 0 % utilisation, for as long as
  every reading after finds it at 0 % with exactly as much memory used. A
  figure the driver cannot give (``None``), a card missing from a reading,
  or no reading at all is never idle: the window starts again. A claim is
  idle when every card it holds is, counted from no earlier than its
  grant, and only between readings: a stretch nobody read is not counted.
- **Only while someone waits for a card.** A claim idle for hours harms
  nobody while cards are free. It is warned once it has been idle for the
  window and another waiting claim wants more cards than are free; the
  warning is withdrawn, and its owner told, when its card is used again
  or nobody waits any more.
- **A warning first, with a time, and who set the limit.** The warning
  says how long the card has been idle, how many claims wait, that this
  machine's admin set ``idle_card_minutes``, and when the claim will be
  ended: ``idle_card_grace_minutes`` (5 by default) later, unless the card
  is used. Then it is ended as an admin's cancel is
  (:meth:`~fluksio_nb.machine.revoke.Stopping.end_claim`), with the
  same words in the past tense; its record, the service's and its
  kernel's, ends :data:`~fluksio_nb.records.IDLE_CARDS`. Messages name the
  claim by number, never by label: everyone's views show them.
- **Nobody waits on the driver.** The watch runs on the service's loop
  every :data:`WATCH_EVERY_S` and takes the cards' latest pass
  (:meth:`~fluksio_nb.gpu_usage.CardReader.latest`), which is read in a
  thread of its own; the driver's library is first opened on a thread too.
- **Counting who waits is bounded.** It is counted only while some claim
  has been idle for the window, and only up to :data:`WAITERS_COUNTED`.

The rule (:class:`IdleCardRule`) is plain data and arithmetic, fed the
readings and the running claims; :func:`watch_idle_cards` runs it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fluksio_nb.gpu_usage import GPU_INTERVAL_S, CardsReading
from fluksio_nb.records import IDLE_CARDS

if TYPE_CHECKING:
    from fluksio_nb.machine.books import Entry
    from fluksio_nb.machine.service import BooksService

log = logging.getLogger("fluksio_nb.machine")

#: How often the rule is run: twice per pass of the cards, so that a
#: deadline is kept to within a second, and a new pass is seen soon.
WATCH_EVERY_S = GPU_INTERVAL_S / 2
#: The most waiting claims counted for a warning: enough to say "100 or more".
WAITERS_COUNTED = 100
#: The default warning, in minutes, before an idle claim is ended.
DEFAULT_GRACE_MINUTES = 5.0


@dataclass(frozen=True)
class IdlePolicy:
    """The admin's setting, in seconds: how long idle, then how long warned."""

    idle_s: float
    grace_s: float = DEFAULT_GRACE_MINUTES * 60


@dataclass(frozen=True)
class RunningClaim:
    """What the rule needs of a running claim: its number, cards and grant."""

    number: int
    cards: tuple[int, ...]
    granted_at: float


@dataclass(frozen=True)
class Decision:
    """What to do about one claim, and the words its owner and everyone read."""

    number: int
    action: Literal["warn", "end", "clear"]
    message: str


class CardStreaks:
    """Since when each card has sat idle, as far as the readings show."""

    def __init__(self) -> None:
        #: Per card: when its idle stretch began, and the memory used all along it.
        self._since: dict[int, tuple[float, int]] = {}
        #: When the latest reading was taken; ``None`` when there is none to go by.
        self.read_at: float | None = None

    def saw(self, reading: CardsReading | None) -> None:
        """One pass of the cards; ``None`` (nothing read) ends every stretch."""
        if reading is None:
            self._since.clear()
            self.read_at = None
            return
        if reading.at == self.read_at:
            return  # the same pass, seen again
        idle_now = set()
        for card in reading.cards:
            used = card.used_bytes
            if card.utilisation_percent != 0 or used is None:
                continue
            idle_now.add(card.index)
            before = self._since.get(card.index)
            if before is None or before[1] != used:
                self._since[card.index] = (reading.at, used)
        for index in set(self._since) - idle_now:
            del self._since[index]
        self.read_at = reading.at

    def idle_for(self, claim: RunningClaim) -> float | None:
        """How long all of ``claim``'s cards have been idle since its grant; ``None`` if not."""
        if self.read_at is None or not claim.cards:
            return None
        starts = [self._since.get(card) for card in claim.cards]
        if any(start is None for start in starts):
            return None
        began = max(claim.granted_at, *(start[0] for start in starts if start is not None))
        return max(0.0, self.read_at - began)


class IdleCardRule:
    """Which running claims to warn, to end, or to stop warning, given the cards' readings."""

    def __init__(self, policy: IdlePolicy) -> None:
        self.policy = policy
        self.streaks = CardStreaks()
        #: Each warned claim's number, and when it is to be ended.
        self.warned: dict[int, float] = {}

    def saw(self, reading: CardsReading | None) -> None:
        self.streaks.saw(reading)

    def decide(
        self, claims: Sequence[RunningClaim], waiters: Callable[[], int], now: float
    ) -> list[Decision]:
        """What to do now about each of ``claims``, the running claims that hold cards.

        ``waiters`` counts the other claims that wait for a card; it is
        called only when some claim has been idle for the window.
        """
        running = {claim.number for claim in claims}
        for number in set(self.warned) - running:
            del self.warned[number]  # ended, or given back by its owner
        idle = {
            claim.number: idle_for
            for claim in claims
            if (idle_for := self.streaks.idle_for(claim)) is not None
            and idle_for >= self.policy.idle_s
        }
        waiting = waiters() if idle else 0
        decisions = []
        for claim in claims:
            idle_for = idle.get(claim.number)
            deadline = self.warned.get(claim.number)
            if idle_for is None or waiting == 0:
                if deadline is not None:
                    del self.warned[claim.number]
                    why = "busy" if idle_for is None else "nobody waits"
                    decisions.append(Decision(claim.number, "clear", self._withdrawn(claim, why)))
                continue
            if deadline is None:
                deadline = self.warned[claim.number] = now + self.policy.grace_s
                message = self._warning(claim, idle_for, waiting, deadline)
                decisions.append(Decision(claim.number, "warn", message))
            elif now >= deadline:
                del self.warned[claim.number]
                message = self._ending(claim, idle_for, waiting, now)
                decisions.append(Decision(claim.number, "end", message))
        return decisions

    # -- the words ------------------------------------------------------------------

    def _warning(self, claim: RunningClaim, idle_for: float, waiting: int, at: float) -> str:
        one = len(claim.cards) == 1
        return (
            f"claim {claim.number}'s {_cards(claim)} {'has' if one else 'have'} been idle "
            f"(0 % use, memory unchanged) for {duration(idle_for)} while "
            f"{_waiters(waiting, past=False)} for a card; this machine's admin gives idle "
            f"cards back after {duration(self.policy.idle_s)} (idle_card_minutes in "
            f"machine.json): it will be ended at {self._clock(at)} unless "
            f"{'the card is' if one else 'its cards are'} used"
        )

    def _ending(self, claim: RunningClaim, idle_for: float, waiting: int, at: float) -> str:
        return (
            f"claim {claim.number}'s {_cards(claim)} had been idle (0 % use, memory "
            f"unchanged) for {duration(idle_for)} while {_waiters(waiting, past=True)} for a "
            f"card; this machine's admin gives idle cards back after "
            f"{duration(self.policy.idle_s)} (idle_card_minutes in machine.json), "
            f"{duration(self.policy.grace_s)} after a warning (idle_card_grace_minutes): "
            f"it was ended at {self._clock(at)}"
        )

    def _withdrawn(self, claim: RunningClaim, why: str) -> str:
        if why == "busy":
            one = len(claim.cards) == 1
            return (
                f"claim {claim.number}'s {_cards(claim)} {'is' if one else 'are'} in use "
                "again (or the driver cannot say): it will not be ended"
            )
        return f"no other claim waits for a card any more: claim {claim.number} will not be ended"

    def _clock(self, at: float) -> str:
        # Seconds only where the grace is shorter than a minute: a test's, mostly.
        shown = "%H:%M" if self.policy.grace_s >= 60 else "%H:%M:%S"
        return time.strftime(shown, time.localtime(at))


def _cards(claim: RunningClaim) -> str:
    if len(claim.cards) == 1:
        return f"card {claim.cards[0]}"
    return "cards " + ", ".join(str(card) for card in claim.cards)


def _waiters(count: int, *, past: bool) -> str:
    if count == 1:
        return "another claim waited" if past else "another claim waits"
    more = " or more" if count >= WAITERS_COUNTED else ""
    return f"{count}{more} claims {'waited' if past else 'wait'}"


def duration(seconds: float) -> str:
    """``1.2 s``, ``45 s``, ``30 min``, ``1.5 h``: as an admin wrote the limit, roughly."""
    if seconds < 60:
        return f"{seconds:.2g} s"
    minutes = seconds / 60
    if minutes < 120:
        return f"{minutes:.3g} min"
    return f"{minutes / 60:.3g} h"


# -- on the service's loop ----------------------------------------------------------


class IdleCardsWatch:
    """The rule, run on the service's loop against its books and its cards."""

    def __init__(self, service: BooksService, policy: IdlePolicy) -> None:
        self.service = service
        self.rule = IdleCardRule(policy)

    def tick(self, now: float) -> None:
        service, cards = self.service, self.service.cards
        if cards is None:
            return
        # The last pass, at once; the next starts in its own thread if due.
        self.rule.saw(cards.latest(wait_for_first=False))
        if service._holding():
            return  # kernels are putting claims back after a restart: not the time
        holding: dict[int, Entry] = {
            entry.number: entry
            for entry in service.books.running
            if entry.gpus and entry.cancel is None
        }
        claims = [
            RunningClaim(entry.number, entry.gpus, entry.granted_at or now)
            for entry in holding.values()
        ]
        for decision in self.rule.decide(claims, self._waiters, now):
            entry = holding[decision.number]
            if decision.action == "warn":
                log.info("claim %s of %s warned: %s", entry.number, entry.user, decision.message)
                service.warn_claim(entry, decision.message)
            elif decision.action == "end":
                log.info("claim %s of %s ended: %s", entry.number, entry.user, decision.message)
                service.end_claim(entry, decision.message, IDLE_CARDS)
            else:
                service.clear_warning(entry, decision.message)

    def _waiters(self) -> int:
        """The waiting claims that want more cards than are free, up to :data:`WAITERS_COUNTED`."""
        books = self.service.books
        free = len(books.free()[1])
        count = 0
        for entry in books.entries.values():
            if entry.state == "waiting" and entry.need[1] > free:
                count += 1
                if count >= WAITERS_COUNTED:
                    break
        return count

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        cards = self.service.cards
        if cards is None:
            return
        # Opening NVML may take the driver a while: never on the loop.
        source = await loop.run_in_executor(None, lambda: cards.source)
        log.info(
            "idle cards are given back after %s idle while a claim waits, %s after a "
            "warning; the cards are read with %s",
            duration(self.rule.policy.idle_s),
            duration(self.rule.policy.grace_s),
            source or "nothing (no NVML, no nvidia-smi): no card is ever idle",
        )
        while True:
            try:
                self.tick(time.time())
            except Exception:
                # The books go on whatever the watch does.
                log.exception("the idle-card watch failed a round")
            await asyncio.sleep(WATCH_EVERY_S)


def watch_idle_cards(service: BooksService) -> asyncio.Task | None:
    """Start the watch on the running loop, where the admin asked for it and cards are read."""
    policy = service.idle_cards
    if policy is None or service.cards is None:
        return None
    return asyncio.get_running_loop().create_task(IdleCardsWatch(service, policy).run())
