"""Where a claim's cards come from, when a card may be shared by slices.

A notebook that needs 4 GB of card memory should not take an 80 GB card from
everyone else. So a claim may ask for a slice of one card (``gpus=0.5``, or
``gpu_ram=20G`` without ``gpus=``) besides whole cards, and a card is then
either held whole by one claim, shared by slices, or idle. This module is the
one place that decides which card a claim gets; the kernel's books and the
machine's books both walk their waiting claims through it.

What it decides:

- **A slice goes best-fit**: on the card whose room after it is smallest,
  lowest index on a tie, so the emptier cards stay whole for the claims that
  need them whole, and many small notebooks fit on one card.
- **A slice never goes beside a whole-card claim**, and a whole-card claim
  only on a card with no slices: a claim granted a whole card has every byte
  and every cycle of it.
- **A slice's size is memory**: ``gpus=0.5`` is half the card's memory,
  ``gpu_ram=20G`` twenty gigabytes of it. A card's room is its memory less
  its slices, and less what the card itself says no claim holds (a squatter):
  a grant meets the card as it is, where cards are read.
- **Nobody is passed more than** :data:`PASSES` **times.** A claim walked
  past because it does not fit sets nothing aside at first: later claims
  go around it, best-fit, as an offline packer would place them. Each later
  claim granted a card it could have had counts as one pass; at
  :data:`PASSES` it is due, and closes every card it could be granted once
  that card drains. Nothing new lands on those, so they drain, and the first
  to have room is its (or that of a due claim ahead of it).

Why this rule, of the ways to keep a stream of slices from starving a
whole-card claim. Setting a card aside at once, for every claim walked past,
cost up to a card of four in runs where a whole-card claim came while every
card held a slice: the card's room stayed unused until it drained (77 % of
an offline best-fit packing in the worst of 50 runs, ``bench/books.py``).
Backfilling a card set aside (a later slice may go if the waiter is not
delayed) needs to know when claims end, which nobody knows. Counting passes
needs nothing but the walk, and gives one number to check: no claim sees
more than :data:`PASSES` later claims granted a card it could use before it.
Once due, a claim is held to the queue's own rule for cores (a shortfall
nobody behind may take from), and pays its price: while it waits, the cards
it could use take no new claim, which is what lets them drain for it.

Cards whose size is not known (declared with ``FLUKSIO_GPUS``, or unified
memory) are counted as :data:`UNREAD_CARD_BYTES`, which keeps fractions
exact and a ``gpu_ram=`` slice placeable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The size a card is counted at when nothing read its memory: a fraction of
#: it is still that fraction, and an 80 GB card is the common case.
UNREAD_CARD_BYTES = 80 * 10**9

#: How many later claims may be granted a card a waiting claim could use before
#: it is due and closes those cards. As few as keep packing within 90 % of an
#: offline best fit with room to spare: of 200 random claims on 4 cards asked at
#: once (``bench/books.py``, 1000 runs), 4 passes fell to 85 % in 10 runs, 6
#: held 93 % or more, 8 hold 96 % or more. The rule before, a card set aside
#: at once for every claim walked past, fell to 77 % in 50 runs.
PASSES = 8


@dataclass(frozen=True, slots=True)
class Slice:
    """A share of one card: a fraction of its memory, or that many bytes of it."""

    fraction: float | None = None
    nbytes: int | None = None

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.nbytes is None):
            raise ValueError("a slice is a fraction of a card or a number of bytes of it")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise ValueError(f"a slice is more than 0 and less than 1 card, not {self.fraction}")
        if self.nbytes is not None and self.nbytes <= 0:
            raise ValueError(f"a slice holds more than 0 bytes, not {self.nbytes}")

    def on(self, card_bytes: int) -> int:
        """How many bytes of a card of ``card_bytes`` this slice takes."""
        if self.nbytes is not None:
            return self.nbytes
        return max(1, int(self.fraction * card_bytes))  # type: ignore[operator]

    def of(self, card_bytes: int) -> float:
        """The fraction of a card of ``card_bytes`` this slice is: what caps count."""
        return min(1.0, self.on(card_bytes) / card_bytes) if card_bytes else 1.0


@dataclass(frozen=True, slots=True)
class CardAsk:
    """What one claim asks of the cards: whole cards, or one slice, or nothing."""

    whole: int = 0
    piece: Slice | None = None

    def __post_init__(self) -> None:
        if self.whole and self.piece is not None:
            raise ValueError("a claim asks for whole cards or for a slice of one, not both")

    def __bool__(self) -> bool:
        return bool(self.whole) or self.piece is not None


@dataclass(slots=True)
class Waiter:
    """One claim walked past on one walk: the cards it could use, and its passes."""

    ask: CardAsk
    #: The cards it could be granted once they drain: what it closes when due.
    usable: frozenset[int]
    #: Later claims granted one of ``usable`` while it waited, this walk and before.
    passed: int = 0
    #: Whether it has closed its cards (it was due).
    closed: bool = False


class Cards:
    """The cards as they are held now, for one walk over the waiting claims.

    Made from the claims running, then told, claim by claim in the order the
    books consider them, to :meth:`take` what fits, and that the books
    :meth:`walked_past` what does not. Plain data, no lock: each set of books
    makes its own, under its own lock or in its own thread.
    """

    def __init__(
        self,
        sizes: Mapping[int, int | None] | Iterable[int],
        held: Iterable[tuple[Iterable[int], int]] = (),
        unclaimed: Mapping[int, int] | None = None,
    ) -> None:
        if not isinstance(sizes, Mapping):
            sizes = dict.fromkeys(sizes)
        self.size = {card: size or UNREAD_CARD_BYTES for card, size in sorted(sizes.items())}
        self.whole: set[int] = set()
        self.sliced = dict.fromkeys(self.size, 0)
        self.count = dict.fromkeys(self.size, 0)
        #: Card memory held by no claim, as the cards last read said.
        self.unclaimed = {card: max(0, int(b)) for card, b in (unclaimed or {}).items()}
        #: Cards a due claim walked past has closed: nothing new goes on them.
        self.aside: set[int] = set()
        #: The claims walked past on this walk and not yet due: each grant counts.
        self.waiters: list[Waiter] = []
        for cards, nbytes in held:
            self.take(tuple(cards), nbytes)

    def copy(self) -> Cards:
        """The same cards held the same way, with nothing set aside: for a new walk."""
        fresh = Cards(self.size, (), self.unclaimed)
        fresh.whole, fresh.sliced, fresh.count = (
            set(self.whole),
            dict(self.sliced),
            dict(self.count),
        )
        return fresh

    def room(self, card: int) -> int:
        """The bytes of ``card`` a new slice may take now."""
        if card in self.whole:
            return 0
        return self.size[card] - self.sliced[card] - self.unclaimed.get(card, 0)

    def idle(self, card: int) -> bool:
        return card not in self.whole and not self.count[card]

    def place(self, ask: CardAsk) -> tuple[tuple[int, ...], int] | None:
        """The cards ``ask`` would get now and the bytes of a slice (0 if whole), or ``None``."""
        if ask.piece is not None:
            best: tuple[int, int] | None = None
            for card in self.size:
                if card in self.aside:
                    continue
                left = self.room(card) - ask.piece.on(self.size[card])
                if left >= 0 and (best is None or left < best[0]):
                    best = (left, card)
            if best is None:
                return None
            card = best[1]
            return (card,), ask.piece.on(self.size[card])
        free = [c for c in self.size if c not in self.aside and self.idle(c) and self.fits_whole(c)]
        if len(free) < ask.whole:
            return None
        return tuple(free[: ask.whole]), 0

    def fits_whole(self, card: int) -> bool:
        # A whole card is granted only as the card is: not one a squatter half fills.
        return self.unclaimed.get(card, 0) * 2 <= self.size[card]

    def take(self, cards: tuple[int, ...], nbytes: int) -> None:
        """Hold ``cards`` for one claim: whole if ``nbytes`` is 0, else a slice of one."""
        for card in cards:
            if card not in self.size:
                raise ValueError(f"card {card} is not one of these books' cards")
            if nbytes:
                if card in self.whole:
                    raise ValueError(f"card {card} is held whole: no slice goes beside it")
                self.sliced[card] += nbytes
            else:
                if not self.idle(card):
                    raise ValueError(f"card {card} is not idle: it cannot be held whole")
                self.whole.add(card)
            self.count[card] += 1
        if cards and self.waiters:
            self._passed(set(cards))

    def _passed(self, cards: set[int]) -> None:
        # A grant of a card a waiter could use passes it; at PASSES it is due.
        for waiter in self.waiters:
            if waiter.usable & cards:
                waiter.passed += 1
                if waiter.passed >= PASSES:
                    self._close(waiter)
        self.waiters = [w for w in self.waiters if not w.closed]

    def _close(self, waiter: Waiter) -> None:
        self.aside |= waiter.usable
        waiter.closed = True

    def give_back(self, cards: tuple[int, ...], nbytes: int) -> None:
        for card in cards:
            if nbytes:
                if self.count[card] < 1 or self.sliced[card] < nbytes:
                    raise ValueError(f"no slice of {nbytes} bytes is held on card {card}")
                self.sliced[card] -= nbytes
            else:
                if card not in self.whole:
                    raise ValueError(f"card {card} is not held whole")
                self.whole.discard(card)
            self.count[card] -= 1

    def walked_past(self, ask: CardAsk, passed: int = 0) -> Waiter:
        """A claim that does not go now, passed ``passed`` times on earlier walks.

        Due (``passed`` at :data:`PASSES`), it closes the cards it could use at
        once; else later grants on them count, and close them when it is due.
        The books keep :attr:`Waiter.passed` for the claim's next walk.
        """
        waiter = Waiter(ask, self.usable(ask), min(passed, PASSES))
        if not ask:
            return waiter
        if waiter.passed >= PASSES:
            self._close(waiter)
        else:
            self.waiters.append(waiter)
        return waiter

    def usable(self, ask: CardAsk) -> frozenset[int]:
        """The cards ``ask`` could be granted once they drain, as they are now.

        A card a process outside every claim fills is not: it drains only when
        that process leaves, and closing it for a claim would hold up every
        slice that fits beside the squatter, for nothing.
        """
        if ask.piece is not None:
            return frozenset(
                c
                for c, size in self.size.items()
                if size - self.unclaimed.get(c, 0) >= ask.piece.on(size)
            )
        if ask.whole:
            return frozenset(c for c in self.size if self.fits_whole(c))
        return frozenset()

    def fits_ever(self, ask: CardAsk) -> bool:
        """Whether these cards could grant ``ask`` were they all idle."""
        if ask.piece is not None:
            return any(ask.piece.on(size) <= size for size in self.size.values())
        return ask.whole <= len(self.size)

    def rows(self) -> list[dict[str, object]]:
        """Each card as the views show it: "card 0: 3 claims, 60/80 GB"."""
        return [
            {
                "index": card,
                "claims": self.count[card],
                "whole": card in self.whole,
                "held_bytes": self.size[card] if card in self.whole else self.sliced[card],
                "total_bytes": self.size[card],
            }
            for card in self.size
        ]


def card_words(row: Mapping[str, object]) -> str:
    """One card's row as a person reads it: ``card 0: 3 claims, 60/80 GB``."""
    claims = int(row.get("claims") or 0)  # type: ignore[call-overload]
    held = int(row.get("held_bytes") or 0) / 1e9  # type: ignore[call-overload]
    total = int(row.get("total_bytes") or 0) / 1e9  # type: ignore[call-overload]
    if row.get("whole"):
        return f"card {row.get('index')}: held whole"
    noun = "claim" if claims == 1 else "claims"
    return f"card {row.get('index')}: {claims} {noun}, {held:.0f}/{total:.0f} GB"
