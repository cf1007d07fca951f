"""A grant meets the card as it is: memory a process outside every claim holds is not free.

The books know what they granted; the card knows what is on it. A terminal's
training run, a cron job or a kernel that never claimed can hold most of a
card, and a claim granted a slice of it would fail on its first allocation.
So where the service reads the cards (:class:`~fluksio_nb.gpu_usage.CardReader`,
the machine's service), each grant is decided with each card's memory as read
and with what no claim holds on it counted as taken
(:attr:`~fluksio_nb.machine.books.MachineBooks.unclaimed`), and a claim that
waits for that reason is told so, in words that name the process:
"card 1 has 3.1GB free; 12.0GB held by pid 2096 (root), no claim".

Cards not read (no driver, or a user's own service, which reads none) are
counted as the books were told, as before.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import ByteSize

from fluksio_nb.gpu_usage import CardsReading, squatters
from fluksio_nb.machine.books import MachineBooks


def meet_the_cards(books: MachineBooks, reading: CardsReading | None) -> dict[int, str]:
    """Tell ``books`` each card's size and what no claim holds on it.

    Returns what to say of each card a process outside every claim holds memory on."""
    if reading is None:
        return {}
    holders: dict[int, list[int]] = {}
    for entry in books.running:
        for card in entry.gpus:
            holders.setdefault(card, []).append(entry.pid)
    unclaimed: dict[int, int] = {}
    said: dict[int, list[str]] = {}
    for found in squatters(reading, holders):
        if found.card not in books.gpu_ids:
            continue
        unclaimed[found.card] = unclaimed.get(found.card, 0) + (found.process.used_bytes or 0)
        said.setdefault(found.card, []).append(
            found.describe().removeprefix(f"card {found.card}: ")
        )
    for card in reading.cards:
        if card.index in books.gpu_ids and card.total_bytes:
            books.card_bytes[card.index] = card.total_bytes
    if unclaimed != books.unclaimed:
        books.unclaimed = unclaimed
        books.changed()
    words = {}
    for card, held in said.items():
        free = books.cards().room(card)
        words[card] = f"card {card} has {_gb(max(free, 0))} free; {', '.join(held)}"
    return words


def say_why_waiting(books: MachineBooks, words: dict[int, str]) -> None:
    """Each waiting claim that would go but for memory no claim holds is told whose it is."""
    if not words:
        for entry in books.waiting:
            if entry.warning and entry.warning.endswith(", no claim"):
                entry.warning = None
        return
    cards = books.cards()
    bare = type(cards)(cards.size, [(e.gpus, e.gpu_bytes) for e in books.running if e.gpus])
    for entry in books.waiting[:64]:
        ask = entry.card_ask
        if not ask or cards.place(ask) is not None:
            continue
        placed = bare.place(ask)
        squeezed = [c for c in (placed[0] if placed else ()) if c in words]
        entry.warning = words[squeezed[0]] if squeezed else None


#: How often a claim waiting on cards is looked at again, where cards are read:
#: a squatter that leaves frees its card without any claim ending.
RECHECK_S = 1.0


def watch_cards_as_they_are(service: Any) -> asyncio.Task | None:
    """Grant again every :data:`RECHECK_S` while a claim waits on cards.

    ``None`` where the service reads no cards."""
    if service.cards is None:
        return None

    async def run() -> None:
        while True:
            await asyncio.sleep(RECHECK_S)
            if any(e.card_ask for e in service.books.waiting[:64]):
                service.dispatch()

    return asyncio.get_running_loop().create_task(run())


def _gb(nbytes: int) -> str:
    # As the squatter's own words count it (gpu_usage.Squatter.describe).
    return ByteSize(nbytes).human_readable(decimal=True)
