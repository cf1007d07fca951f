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
- **Nobody starves behind a stream of others.** A claim walked past because
  it does not fit sets aside what it needs, as the queue's rule says
  (:func:`fluksio_nb.queue.who_goes_next`): a whole-card claim the idle cards
  and then the cards closest to idle, a slice the card with the most room.
  No new claim goes on a card set aside, so its slices drain and the waiting
  claim gets it.

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


class Cards:
    """The cards as they are held now, for one walk over the waiting claims.

    Made from the claims running, then told, claim by claim in the order the
    books consider them, to :meth:`take` what fits and :meth:`set_aside` what
    does not. Plain data, no lock: each set of books makes its own, under its
    own lock or in its own thread.
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
        #: Cards a waiting claim walked past has set aside: nothing new goes on them.
        self.aside: set[int] = set()
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

    def set_aside(self, ask: CardAsk) -> None:
        """What a claim walked past needs: no claim behind it may take that."""
        open_cards = [c for c in self.size if c not in self.aside and c not in self.whole]
        if ask.piece is not None:
            if any(ask.piece.on(self.size[c]) <= self.size[c] for c in self.aside):
                # It waits behind a card set aside already, which drains for the
                # first in line and then for it: the other cards stay open.
                return
            if open_cards:
                # The card it will fit on soonest: the one with the most room.
                self.aside.add(max(open_cards, key=lambda c: (self.room(c), -c)))
            return
        if not ask.whole or len(self.aside) >= ask.whole:
            # Nothing, or as many cards as it needs set aside already: it waits behind them.
            return
        # The idle cards first, then those closest to idle: they drain, and nothing new lands.
        nearest = sorted(
            (c for c in self.size if c not in self.aside),
            key=lambda c: (c in self.whole, self.count[c], self.sliced[c], c),
        )
        self.aside.update(nearest[: ask.whole])

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
