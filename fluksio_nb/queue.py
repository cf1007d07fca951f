"""Waiting for a share: first come, first served, and visible while it lasts.

The books say whether a claim fits right now; this module decides who goes
next when several are waiting. The rule is first come, first served, with one
exception that keeps a machine from idling: a later claim may overtake the
claims ahead of it only if it takes nothing they still need. A cell waiting
for the one GPU does not hold up a CPU-only cell behind it when there are
cores to spare, but a stream of small CPU cells can never starve a large one,
because whatever the large one is short of is set aside for it. Cards are
placed by :mod:`fluksio_nb.card_slices`, where a claim short of a card is
first packed around, best-fit, and holds the cards it could use only once a
few later claims went ahead of it.

Grants are made here, centrally, under one lock, when something is asked for
and when something is given back, rather than by each waiter racing to take
for itself. Deciding in one place is what makes the order FIFO rather than
whichever thread the scheduler happened to wake first.

Oversized claims are shrunk to what the machine has, with a warning, so a
notebook written on a large box still runs on a laptop; ``strict`` refuses
them instead. Every way a claim can end (its block returns or raises, the
wait times out, it is cancelled, the user presses stop) gives its share back.

Every change to the books is made with the stop button held back
(:func:`~fluksio_nb.stop_button.stop_held_back`), so that it lands as the
change is whole; waiting is never held back.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ByteSize

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.card_slices import CardAsk, Cards
from fluksio_nb.errors import (
    ClaimCancelled,
    ClaimTimeout,
    ClaimTooLarge,
    ClampedWarning,
    warn_at_users_line,
)
from fluksio_nb.resources import Resources
from fluksio_nb.stop_button import stop_held_back

#: How often a waiter looks at its own deadline when nothing wakes it. Grants
#: and cancellations wake it at once; this only bounds how late a timeout is.
_WAKE_S = 0.25


@dataclass(eq=False)
class Ticket:
    """One claim's place in the queue, and later its share."""

    number: int
    resources: Resources
    label: str
    since: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    state: Literal["waiting", "running", "done"] = "waiting"
    allocation: Allocation | None = None
    #: When the share was granted (``time.time()``, comparable across processes).
    granted_at: float | None = None
    cancelled: str | None = None
    #: How the books that stopped it record its end, if they said
    #: (:data:`~fluksio_nb.records.BOOKS_ENDINGS`): its own record says the same.
    ended_as: str | None = None
    #: Called, outside the queue's lock, when a running claim is cancelled:
    #: whoever runs the claim knows how to stop it; the queue does not.
    on_cancel: Callable[[str], None] | None = None
    #: What the books warned of while it runs (a limit near, idle cards).
    warning: str | None = None
    #: Called, outside any lock, with each new warning: whoever runs the
    #: claim shows it in its cell.
    on_warning: Callable[[str], None] | None = None
    #: Later claims granted a card it could use while it waited
    #: (:data:`~fluksio_nb.card_slices.PASSES`).
    passed: int = 0

    @property
    def asked(self) -> dict[str, Any]:
        r = self.resources
        # As the machine's books say it (:func:`~fluksio_nb.machine.protocol.need_said`).
        asked: dict[str, Any] = {"cpus": r.cpus, "gpus": r.whole_gpus, "ram_bytes": r.ram_bytes}
        if r.is_slice and isinstance(r.gpus, float):
            asked["gpu_fraction"] = r.gpus
        elif r.is_slice:
            asked["gpu_bytes"] = r.gpu_ram_bytes
        return asked


class ClaimQueue:
    """FIFO claims over one machine's books, usable from many threads."""

    def __init__(self, books: ResourceAccountant) -> None:
        self.books = books
        #: What holds claims made here to their share, per resource, as
        #: :func:`fluksio_nb.kernel.enforcement_in_force` says: in every snapshot.
        self.enforcement: dict[str, Any] = {}
        #: Taken with ``with self._lock``, never ``with self._cond``: a stop
        #: landing as ``Condition.__enter__``, which is Python, returns leaves
        #: the lock held by no ``with``, and every other thread waits on it for
        #: ever. The lock's own ``__enter__`` is C, and lets no stop in between.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting: list[Ticket] = []
        self._running: dict[int, Ticket] = {}
        self._numbers = itertools.count(1)

    # -- asking ---------------------------------------------------------------

    def fit_to_machine(self, wanted: Resources) -> Resources:
        """The claim shrunk to what exists, or refused if it is strict."""
        return fit_to_capacity(wanted, self.books)

    def enqueue(self, wanted: Resources, label: str | None = None) -> Ticket:
        """Join the queue. The ticket may already be granted when this returns."""
        fitted = self.fit_to_machine(wanted)
        ticket: Ticket | None = None
        try:
            with stop_held_back(), self._lock:
                number = next(self._numbers)
                ticket = Ticket(
                    number=number,
                    resources=fitted,
                    label=label or wanted.label or f"claim {number}",
                )
                self._waiting.append(ticket)
                self._dispatch()
        except BaseException:
            # The stop button may land after the books have the claim and
            # before the caller does: nobody would ever give it back.
            if ticket is not None:
                self.release(ticket)
            raise
        return ticket

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Allocation:
        """Block until the ticket is granted, cancelled or out of time.

        On any exception, KeyboardInterrupt included, the ticket is still in
        the books' care: the caller must :meth:`release` it, as :meth:`claim`
        does in its ``finally``.
        """
        return wait_for_grant(self._lock, self._cond, ticket, timeout, self.timeout_message)

    def release(self, ticket: Ticket, ending: str | None = None) -> None:
        """Leave the queue, or give the share back: safe to call on any ticket, twice.

        ``ending`` is for a books service's metrics; the kernel's own books count none.
        """
        with stop_held_back(), self._lock:
            if ticket.state == "waiting" and ticket in self._waiting:
                self._waiting.remove(ticket)
            elif ticket.state == "running":
                del self._running[ticket.number]
                assert ticket.allocation is not None
                self.books.give_back(ticket.allocation)
            ticket.state = "done"
            self._dispatch()

    @contextmanager
    def claim(
        self,
        wanted: Resources,
        *,
        label: str | None = None,
        timeout: float | None = None,
    ) -> Iterator[Allocation]:
        """Hold a share for the length of a ``with`` block, waiting for it first.

        ``timeout`` bounds the wait; it defaults to the claim's own timeout.
        """
        ticket = self.enqueue(wanted, label)
        try:
            yield self.wait(ticket, wanted.timeout if timeout is None else timeout)
        finally:
            self.release(ticket)

    def cancel(self, number: int, reason: str = "cancelled by the user") -> bool:
        """Cancel a waiting claim, or ask a running one to stop. False if unknown."""
        stop = None
        with stop_held_back(), self._lock:
            ticket = self._running.get(number) or next(
                (t for t in self._waiting if t.number == number), None
            )
            if ticket is None:
                return False
            ticket.cancelled = reason
            if ticket.state == "waiting":
                self._waiting.remove(ticket)
                ticket.state = "done"
                self._dispatch()
                self._cond.notify_all()
            else:
                stop = ticket.on_cancel
        if stop is not None:
            stop(reason)
        return True

    def report(self, ticket: Ticket, readings: dict[str, object]) -> None:
        """Readings of a running claim. The kernel's own books need not keep them."""

    # -- who goes next --------------------------------------------------------

    def _dispatch(self) -> None:
        """Grant whatever can be granted now, in order. Called with the lock held."""
        free_cpus, _, free_ram = self.books.free()
        needs = [(t.resources.cpus, t.resources.ram_bytes) for t in self._waiting]
        going, passed = who_goes_on_cards(
            needs,
            (free_cpus, free_ram),
            self.books.cards_now(),
            self._asks(),
            [t.passed for t in self._waiting],
        )
        for index, times in passed.items():
            self._waiting[index].passed = times
        for index, placed in going:
            ticket = self._waiting[index]
            r = ticket.resources
            allocation = self.books.try_take(r.cpus, r.card_ask, r.ram_bytes, on=placed)
            assert allocation is not None, "who_goes_next granted more than is free"
            ticket.allocation, ticket.state = allocation, "running"
            ticket.granted_at = time.time()
            self._running[ticket.number] = ticket
        granted = {index for index, _ in going}
        self._waiting = [t for i, t in enumerate(self._waiting) if i not in granted]
        if going:
            self._cond.notify_all()

    def _asks(self) -> list[CardAsk]:
        return [t.resources.card_ask for t in self._waiting]

    # -- what is going on -----------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        """Totals and free, the waiting list in order, and the running claims."""
        with self._lock:
            books = self.books.snapshot()
            waiting = [
                {**_describe(ticket), "position": position, "asked": ticket.asked}
                for position, ticket in enumerate(self._waiting, start=1)
            ]
            running = [
                {
                    **_describe(ticket),
                    "allocation": ticket.allocation.as_dict(),
                    "granted_at": ticket.granted_at,
                }
                for ticket in self._running.values()
                if ticket.allocation is not None
            ]
        return {**books, "waiting": waiting, "running": running, "enforcement": self.enforcement}

    def position(self, ticket: Ticket) -> int | None:
        """Where a waiting ticket stands, 1 being next; ``None`` once it is not waiting."""
        with self._lock:
            try:
                return self._waiting.index(ticket) + 1
            except ValueError:
                return None

    def holders(self) -> list[Ticket]:
        """The running claims, oldest first: who holds what a waiter waits for."""
        with self._lock:
            return sorted(self._running.values(), key=lambda t: t.number)

    def timeout_message(self, ticket: Ticket, timeout: float | None) -> str:
        return timeout_message(ticket, timeout, self.holders())


def wait_for_grant(
    lock: Any,
    granted: threading.Condition,
    ticket: Ticket,
    timeout: float | None,
    timeout_message: Callable[[Ticket, float | None], str],
) -> Allocation:
    """Sleep on ``granted`` until the ticket has its share, is cancelled, or runs out of time.

    Whoever grants or cancels notifies ``granted``; the wake every
    :data:`_WAKE_S` only bounds how late a timeout is noticed. ``lock`` is
    the condition's, taken as itself (:class:`ClaimQueue` says why).
    """
    if ticket.allocation is not None:
        return ticket.allocation  # granted as it was asked for: set once, never unset
    deadline = None if timeout is None else time.monotonic() + timeout
    with lock:
        while ticket.allocation is None:
            if ticket.cancelled is not None:
                raise ClaimCancelled(
                    f"{ticket.label} was cancelled while waiting: {ticket.cancelled}"
                )
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            wait_on(granted, _WAKE_S if left is None else min(left, _WAKE_S))
        else:
            return ticket.allocation
    # Said with ``granted`` let go of: who holds what may be the machine's
    # books service to ask, and its answer is read under that lock.
    raise ClaimTimeout(timeout_message(ticket, timeout))


Need = tuple[int, int, int]


def wait_on(condition: threading.Condition, timeout: float) -> None:
    """``condition.wait(timeout)``, the stop button landing once the lock is held again.

    ``Condition.wait`` takes its lock back in a ``finally``. A stop raised in
    there before it has leaves the caller's ``with`` releasing a lock it no
    longer holds, and the user reads "cannot release un-acquired lock" instead
    of the interrupt. Held back, the stop lands as the wait returns: at most
    ``timeout`` late, which every caller keeps to a fraction of a second.
    """
    with stop_held_back():
        condition.wait(timeout)


def who_goes_next(needs: list[Need], free: Need) -> list[int]:
    """Which of the waiting claims, given in queue order, are granted now.

    First come, first served, except that a later claim may overtake the ones
    ahead of it when it takes nothing they still need. Walking the queue, a
    claim that cannot go has what it needs set aside, so that what is left
    (possibly less than nothing: a shortfall nobody behind may take from) is
    all that later claims may use. A claim asking for none of a resource is
    never held back by a shortage of it.
    """
    spare = list(free)
    going = []
    for index, need in enumerate(needs):
        if all(n == 0 or n <= s for n, s in zip(need, spare, strict=True)):
            going.append(index)
        spare = [s - n for s, n in zip(spare, need, strict=True)]
    return going


def who_goes_on_cards(
    needs: Sequence[tuple[int, ...]],
    free: Sequence[float],
    cards: Cards,
    asks: Sequence[CardAsk],
    passed: Sequence[int] | None = None,
) -> tuple[list[tuple[int, tuple[tuple[int, ...], int]]], dict[int, int]]:
    """:func:`who_goes_next` with each claim's cards placed on ``cards``: which go, and where.

    The cards are walked by :mod:`fluksio_nb.card_slices`, which counts the
    later claims granted a card a claim that cannot go could use (``passed``,
    from earlier walks), and closes those cards for it once that is
    :data:`~fluksio_nb.card_slices.PASSES`: so a whole-card claim is not
    starved by a stream of slices. Cores and memory keep the rule of
    :func:`who_goes_next`. Returns who goes, and each waiter's passes now.
    """
    spare = list(free)
    going = []
    waiters = {}
    for index, (need, ask) in enumerate(zip(needs, asks, strict=True)):
        placed = cards.place(ask) if ask else ((), 0)
        if placed is not None and all(n == 0 or n <= s for n, s in zip(need, spare, strict=True)):
            cards.take(*placed)
            going.append((index, placed))
        elif ask:
            waiters[index] = cards.walked_past(ask, passed[index] if passed else 0)
        spare = [s - n for s, n in zip(spare, need, strict=True)]
    return going, {index: waiter.passed for index, waiter in waiters.items()}


def fit_to_capacity(wanted: Resources, books: ResourceAccountant) -> Resources:
    """The claim shrunk to what the machine has, with a warning, or refused if strict."""
    if books.fits(wanted.cpus, wanted.card_ask, wanted.ram_bytes):
        return wanted
    capacity = f"cpus={books.cpus} gpus={books.gpus} ram={_size(books.ram_bytes)}"
    if wanted.strict:
        raise ClaimTooLarge(
            f"{wanted.describe()} asks for more than this machine has to hand out "
            f"({capacity}); ask for less, or drop --strict to be given what there is"
        )
    ram = None if wanted.ram is None else (min(wanted.ram, books.ram_bytes) or None)
    gpus = min(wanted.gpus, books.gpus)
    gpu_ram = wanted.gpu_ram if gpus else None
    if wanted.is_slice and not isinstance(wanted.gpus, float) and books.gpus:
        # A slice of more memory than the biggest card has is that card.
        gpu_ram = ByteSize(min(int(wanted.gpu_ram or 0), max(books.cards_now().size.values())))
    shrunk = Resources(
        **{
            **wanted.model_dump(exclude_unset=True),
            "cpus": min(wanted.cpus, books.cpus),
            "gpus": gpus,
            "ram": ram,
            # A budget of card memory with no card left to hold it is no budget.
            "gpu_ram": gpu_ram,
        }
    )
    given = shrunk.describe(gpus_if_none=bool(wanted.gpus))
    # Only what was too much is named, beside what the machine has of it.
    given_words = dict(word.split("=", 1) for word in given.split())
    over = [
        (key, value)
        for key, value in (word.split("=", 1) for word in wanted.describe().split())
        if given_words.get(key) != value
    ]
    has = {"cpus": f"cpus={books.cpus}", "gpus": f"gpus={books.gpus}"}
    has["ram"] = f"ram={_size(books.ram_bytes)}"
    if any(key == "gpu_ram" for key, _ in over):
        biggest = max(books.cards_now().size.values(), default=0)
        has["gpu_ram"] = f"{_size(biggest)} on its biggest card" if biggest else "no cards"
    warn_at_users_line(
        f"{' '.join(f'{key}={value}' for key, value in over) or wanted.describe()} is more "
        f"than this machine has to hand out ({', '.join(has[key] for key, _ in over) or capacity}"
        f"); running with {given} instead. Add --strict to refuse instead.",
        ClampedWarning,
    )
    return shrunk


def timeout_message(ticket: Ticket, timeout: float | None, holders: list[Ticket]) -> str:
    """Why a claim gave up waiting, naming who held what it waited for."""
    held = ", ".join(
        f"{t.label!r} ({held_words(t.allocation)})" for t in holders if t.allocation is not None
    )
    return (
        f"{ticket.label} waited {timeout:g} s for {ticket.resources.describe()} "
        f"and it did not come free (held by {held or 'nobody; claims ahead of it'}). "
        "Raise the timeout (--timeout, or timeout= in claim()), or, if a claim holding it "
        "is yours, stop it from `%claims`."
    )


def _describe(ticket: Ticket) -> dict[str, object]:
    return {
        "ticket": ticket.number,
        "label": ticket.label,
        "since": ticket.since,
        "pid": ticket.pid,
        # A kernel's own books hold its own claims: jupyter_server names its notebook.
        "notebook": os.environ.get("JPY_SESSION_NAME") if ticket.pid == os.getpid() else None,
    }


def held_words(allocation: Allocation | None) -> str:
    """What a claim holds, as the claim line says it: ``cpus=2 gpus=1 (card 0) ram=4.0GB``."""
    if allocation is None:
        return "nothing"
    return share_words(
        allocation.cpus, allocation.gpus, allocation.ram_bytes, gpu_bytes=allocation.gpu_bytes
    )


def share_words(
    cpus: int, cards: Sequence[int], ram_bytes: int, cores: str = "", gpu_bytes: int = 0
) -> str:
    """A share as the claim line counts it, with which cores and cards it holds.

    ``gpus=`` is a count on the line, so the cards' ids go in words beside it:
    ``gpus=0`` said of card 0 reads as no card. A share with no ``ram=``
    budget says none.
    """
    words = [f"cpus={cpus}" + (f" (cores {cores})" if cores else "")]
    if cards and gpu_bytes:
        words.append(f"a slice of card {cards[0]} (gpu_ram={_size(gpu_bytes)})")
    elif cards:
        words.append(cards_words(cards))
    if ram_bytes:
        words.append(f"ram={_size(ram_bytes)}")
    return " ".join(words)


def asked_words(asked: Mapping[str, int]) -> str:
    """What a waiting claim asks for, as its line says it: ``cpus=2 gpus=1 ram=4.0GB``."""
    words = [f"cpus={asked.get('cpus', 1)}"]
    if asked.get("gpus"):
        words.append(f"gpus={asked['gpus']}")
    elif asked.get("gpu_fraction"):
        words.append(f"gpus={asked['gpu_fraction']:g}")
    elif asked.get("gpu_bytes"):
        words.append(f"gpu_ram={_size(int(asked['gpu_bytes']))}")
    if asked.get("ram_bytes"):
        words.append(f"ram={_size(asked['ram_bytes'])}")
    return " ".join(words)


def cards_words(cards: Sequence[int]) -> str:
    """``gpus=2 (cards 0,3)``: how many, as the line counts, and which."""
    ids = ",".join(str(card) for card in cards)
    return f"gpus={len(cards)} ({'card' if len(cards) == 1 else 'cards'} {ids})"


def _size(n: int) -> str:
    return ByteSize(n).human_readable(decimal=True)
