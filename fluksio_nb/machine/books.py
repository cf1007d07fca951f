"""The machine's books as the service keeps them: who waits, who holds, who goes next.

The kernel's own queue (:mod:`fluksio_nb.queue`) orders claims by arrival.
On a machine shared by people that is not enough: one user who queues fifty
``--background`` claims would make everyone else wait for all fifty. So the
waiting claims are ordered between people first, then by arrival:

- **People take turns.** The waiting claims are dealt out one per user per
  round, and in each round the user whose last claim was granted longest
  ago (or never) goes first. One user's fiftieth claim waits behind another
  user's first.
- **Then the usual rule.** Walking that order, a claim that fits goes; one
  that does not sets aside the cores and memory it needs, so later claims
  may overtake it only with what it does not need
  (:func:`~fluksio_nb.queue.who_goes_next`); of cards, only after
  :data:`~fluksio_nb.card_slices.PASSES` later claims went ahead of it
  (:mod:`fluksio_nb.card_slices`), as on the kernel's books.
- **Cores are handed out by id**, as cards are, with
  :func:`~fluksio_nb.books.pick_cores`: disjoint between running claims,
  on one NUMA node where one has room.
- **Cards, whole or sliced, are placed by** :mod:`fluksio_nb.card_slices`,
  as the kernel's books place them: slices best-fit, never beside a
  whole-card claim, and a card a process outside every claim fills (as the
  service last read the cards, :attr:`MachineBooks.unclaimed`) not granted.
- **An admin's cap is a user's own ceiling.** A claim its user's cap holds
  back sets nothing aside: one capped user never holds up anyone else.
- **What a reader is shown is bounded.** A snapshot lists the first
  :data:`OTHERS_WAITING_LISTED` of the queue, the first
  :data:`MINE_WAITING_LISTED` of the reader's own claims behind them, and
  counts the rest; other users' words are cut short. No user can make it
  longer than a reader will take, nor make it cost the service time in
  proportion to what they queued.
- **No request walks the whole queue.** The waiting claims are kept by
  user, in order, and the running ones apart, so counting a user's waiting
  claims costs nothing, and a grant walks the fair order only until the
  cores run out (every claim asks for at least one): one user's thousands
  of waiting claims do not make everyone's claim slower.

Everything here is plain data and runs in the service's one thread, so
there is no lock: the order the service reads its sockets in is the order
of the books.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fluksio_nb.books import pick_cores
from fluksio_nb.card_slices import CardAsk, Cards, Slice, Waiter
from fluksio_nb.machine.caps import Cap, Need


@dataclass(eq=False)
class Entry:
    """One claim, as the service knows it: its owner comes from the OS."""

    number: int
    uid: int
    user: str
    pid: int
    need: Need
    label: str
    #: Which connection made it; the service drops its entries when it closes.
    owner: Any = None
    kernel_id: str | None = None
    notebook: str | None = None
    share_labels: bool = False
    since: float = field(default_factory=time.time)
    state: Literal["waiting", "running"] = "waiting"
    gpus: tuple[int, ...] = ()
    cores: tuple[int, ...] = ()
    #: A slice of one card it asks for instead of whole cards (``need[1]`` is 0).
    piece: Slice | None = None
    #: The card memory of its slice, once granted; 0 for whole cards.
    gpu_bytes: int = 0
    granted_at: float | None = None
    cancel: str | None = None
    #: How the service ended it, if it did: what its record says, whoever
    #: gives its share back (:meth:`~fluksio_nb.machine.revoke.Stopping.end_claim`).
    ended_as: str | None = None
    #: What the service warned its owner of, while it runs (a limit near, idle
    #: cards): shown in the owner's cell and in everyone's views.
    warning: str | None = None
    readings: dict[str, Any] | None = None
    #: The digest of the secret its owner's kernel was given with the grant,
    #: which a restore after a restart must match (:mod:`.state`).
    secret_sha256: str | None = None
    #: The processes its kernel said it started for it: what an admin's cancel
    #: kills if the kernel does not end the claim (:mod:`.revoke`). Never shown.
    pids: tuple[int, ...] = ()
    #: Later claims granted a card it could use while it waited
    #: (:data:`~fluksio_nb.card_slices.PASSES`). Not kept over a restart.
    passed: int = 0

    @property
    def held(self) -> Need:
        # A slice counts as the share of its card it holds, for caps.
        cards = self.gpu_share if self.gpu_bytes else len(self.gpus)
        return (self.need[0], cards, self.need[2])  # type: ignore[return-value]

    @property
    def card_ask(self) -> CardAsk:
        return CardAsk(whole=self.need[1], piece=self.piece)

    #: The share of a card its slice holds, set at the grant: what caps count.
    gpu_share: float = 0.0


#: How many of the queue's first waiting claims a snapshot lists besides the
#: reader's own, and how much of another user's label, kernel id and notebook
#: path it shows: together they keep a snapshot far below the protocol's
#: longest line, whatever other users ask for or call their claims.
OTHERS_WAITING_LISTED = 100
OTHERS_LABEL_CHARS = 120
OTHERS_NOTEBOOK_CHARS = 240
#: How many of the reader's own waiting claims behind the head a snapshot
#: lists; the rest are counted (``mine_unlisted``). Far more than a person's
#: notebooks queue; a client that queues thousands is shown a number.
MINE_WAITING_LISTED = 100
#: How many claims of one capped user a grant looks at past their cap before
#: it passes over that user's others until the next grant: a capped user's
#: thousands of waiting claims do not make every grant walk them all.
CAPPED_LOOKED_AT = 64


def _fits(need: Iterable[float], room: Iterable[float]) -> bool:
    # A claim asking for none of a resource is never held back by a shortage of it.
    return all(n == 0 or n <= r for n, r in zip(need, room, strict=True))


class MachineBooks:
    """Every user's claims on one machine, granted fairly between people."""

    def __init__(
        self,
        cpus: int,
        gpu_ids: Iterable[int],
        ram_bytes: int,
        *,
        core_ids: Sequence[int] = (),
        core_nodes: Mapping[int, int] | None = None,
        numbers: Iterator[int] | None = None,
        card_bytes: Mapping[int, int | None] | None = None,
    ) -> None:
        self.cpus, self.gpu_ids, self.ram_bytes = cpus, tuple(sorted(gpu_ids)), ram_bytes
        #: Each card's memory, where it was read; a slice's bytes are of it.
        self.card_bytes: dict[int, int | None] = dict(card_bytes or {})
        #: Card memory held by no claim, per card, as the service last read the
        #: cards: a grant meets the card as it is (:mod:`fluksio_nb.card_slices`).
        self.unclaimed: dict[int, int] = {}
        self.core_ids, self.core_nodes = tuple(sorted(core_ids)), dict(core_nodes or {})
        self.entries: dict[int, Entry] = {}
        self.caps: dict[int, Cap] = {}
        #: Never one a service before this one gave out, given ``numbers`` from
        #: its state (:meth:`~.state.ServiceState.ticket_numbers`).
        self.numbers = numbers if numbers is not None else itertools.count(1)
        #: When each user's last claim was granted: who goes first in a round.
        self._last_granted: dict[int, float] = {}
        self._running: dict[int, Entry] = {}
        #: Each user's waiting claims, in the order they were added (by number).
        self._waiting: dict[int, dict[int, Entry]] = {}
        #: Counts every change a snapshot would show, for the service's cache.
        self.version = 0

    def next_number(self) -> int:
        return next(self.numbers)

    def add(self, entry: Entry) -> None:
        """A claim in the books: waiting, or running if it was put back after a restart."""
        self.entries[entry.number] = entry
        if entry.state == "running":
            self._running[entry.number] = entry
        else:
            self._waiting.setdefault(entry.uid, {})[entry.number] = entry
        self.version += 1

    def remove(self, number: int) -> Entry | None:
        entry = self.entries.pop(number, None)
        if entry is not None:
            self._running.pop(number, None)
            mine = self._waiting.get(entry.uid)
            if mine is not None and mine.pop(number, None) is not None and not mine:
                del self._waiting[entry.uid]
            self.version += 1
        return entry

    def changed(self) -> None:
        """Something a snapshot shows changed outside these books (readings, a cancel)."""
        self.version += 1

    def waiting_count(self, uid: int | None = None) -> int:
        """How many claims wait: user ``uid``'s, or everyone's."""
        if uid is not None:
            return len(self._waiting.get(uid, ()))
        return sum(map(len, self._waiting.values()))

    def waiting_by_user(self) -> dict[str, int]:
        """How many claims each user has waiting, by name: a count per user, no walk."""
        return {next(iter(mine.values())).user: len(mine) for mine in self._waiting.values()}

    @property
    def running(self) -> list[Entry]:
        return list(self._running.values())

    @property
    def waiting(self) -> list[Entry]:
        return sorted(
            (e for mine in self._waiting.values() for e in mine.values()), key=lambda e: e.number
        )

    def cards(self) -> Cards:
        """The cards as the running claims hold them, for a walk to place on."""
        return Cards(
            {g: self.card_bytes.get(g) for g in self.gpu_ids},
            [(e.gpus, e.gpu_bytes) for e in self._running.values() if e.gpus],
            self.unclaimed,
        )

    def free(self) -> tuple[int, list[int], int]:
        """Free cores, idle cards (no claim on them, whole or sliced), free bytes."""
        running = self.running
        held = {g for e in running for g in e.gpus}
        return (
            self.cpus - sum(e.need[0] for e in running),
            [g for g in self.gpu_ids if g not in held],
            self.ram_bytes - sum(e.need[2] for e in running),
        )

    def free_cores(self) -> list[int]:
        if not self.core_ids:
            # Nothing to pin to: no walk over the running claims on every grant.
            return []
        held = {c for e in self.running for c in e.cores}
        return [c for c in self.core_ids if c not in held]

    def fits_free(
        self,
        cpus: int,
        gpus: Iterable[int],
        ram_bytes: int,
        cores: Iterable[int] = (),
        gpu_bytes: int = 0,
    ) -> bool:
        """Whether a share named to the card is free now: for a claim restored after a restart."""
        free_cpus, free_gpus, free_ram = self.free()
        cards = self.cards()
        gpus = list(gpus)
        return (
            cpus <= free_cpus
            and (
                set(gpus) <= set(free_gpus)
                if not gpu_bytes
                else all(g in cards.size and cards.room(g) >= gpu_bytes for g in gpus)
            )
            and set(cores) <= set(self.free_cores())
            and ram_bytes <= max(free_ram, 0)
        )

    def within_cap(self, uid: int, need: Need) -> bool:
        """Whether user ``uid`` may hold ``need`` beside what they hold now."""
        cap = self.caps.get(uid)
        return cap is None or _fits(need, cap.room(self.held_by(uid)))

    def held_by(self, uid: int) -> Need:
        mine = [e.held for e in self.running if e.uid == uid]
        return tuple(sum(column) for column in zip(*mine, strict=True)) if mine else (0, 0, 0)  # type: ignore[return-value]

    def fair_order(self) -> list[Entry]:
        """The waiting claims in the order they are considered: one per user per round."""
        return list(self._fair_walk())

    def _fair_walk(self, passed_over: set[int] | None = None) -> Iterator[Entry]:
        """:meth:`fair_order`, one claim at a time: a walk that stops early costs only
        what it walked. Users in ``passed_over`` (which may grow meanwhile) are skipped."""

        def first_turn(uid: int) -> tuple[float, int]:
            return self._last_granted.get(uid, -math.inf), next(iter(self._waiting[uid]))

        users = sorted(self._waiting, key=first_turn)
        turns = deque((uid, iter(self._waiting[uid].values())) for uid in users)
        while turns:
            uid, theirs = turns.popleft()
            if passed_over and uid in passed_over:
                continue
            entry = next(theirs, None)
            if entry is not None:
                yield entry
                turns.append((uid, theirs))

    def dispatch(self) -> list[Entry]:
        """Grant whatever may go now, fairly; returns the claims just granted."""
        if not self._waiting:
            return []
        free_cpus, _, free_ram = self.free()
        free_cores = self.free_cores()
        cards = self.cards()
        # Cards are walked by card_slices; spare keeps cores and memory (and a
        # 0 for cards, which only caps read).
        spare: list[float] = [free_cpus, 0, free_ram]
        room = {uid: cap.room(self.held_by(uid)) for uid, cap in self.caps.items()}
        granted: list[Entry] = []
        capped: dict[int, int] = {}
        passed_over: set[int] = set()
        waiters: list[tuple[Entry, Waiter]] = []
        for entry in self._fair_walk(passed_over):
            if spare[0] < 1:
                # Every claim asks for a core (the protocol's Need), and every
                # one walked sets aside what it needs: none behind can go now.
                break
            mine = room.get(entry.uid)
            ask = entry.card_ask
            if mine is not None and not _fits(self._counted(entry, cards), mine):
                capped[entry.uid] = looked = capped.get(entry.uid, 0) + 1
                if mine[0] < 1 or looked >= CAPPED_LOOKED_AT:
                    passed_over.add(entry.uid)
                continue
            need = (entry.need[0], 0, entry.need[2])
            placed = cards.place(ask) if ask else ((), 0)
            if placed is not None and _fits(need, spare):
                cards.take(*placed)
                entry.cores = pick_cores(free_cores, entry.need[0], self.core_nodes)
                free_cores = [c for c in free_cores if c not in entry.cores]
                entry.state, entry.gpus, entry.granted_at = "running", placed[0], time.time()
                entry.gpu_bytes = placed[1]
                if placed[1]:
                    entry.gpu_share = placed[1] / cards.size[placed[0][0]]
                self._last_granted[entry.uid] = time.monotonic()
                granted.append(entry)
                if mine is not None:
                    mine[:] = [r - n for r, n in zip(mine, entry.held, strict=True)]
            elif ask:
                waiters.append((entry, cards.walked_past(ask, entry.passed)))
            # Granted or not, what it needs is spoken for: a claim behind it
            # may overtake it only with what it does not need.
            spare = [s - n for s, n in zip(spare, need, strict=True)]
        for entry, waiter in waiters:
            entry.passed = waiter.passed
        for entry in granted:
            # Moved only now: the walk reads these dicts as it goes.
            self._waiting[entry.uid].pop(entry.number)
            if not self._waiting[entry.uid]:
                del self._waiting[entry.uid]
            self._running[entry.number] = entry
        if granted:
            self.version += 1
        return granted

    def _counted(self, entry: Entry, cards: Cards) -> Need:
        """What a waiting claim would count against its user's cap: a slice as its share."""
        if entry.piece is None:
            return entry.need
        size = min(cards.size.values(), default=0)
        return (entry.need[0], entry.piece.of(size) if size else 1, entry.need[2])  # type: ignore[return-value]

    def snapshot(self, uid: int, *, admin: bool = False, sees_pids: bool = False) -> dict[str, Any]:
        """The machine as user ``uid`` may see it: everyone's shares, their own labels.

        Another user's kernel's pid only to an admin (or, with ``sees_pids``,
        root): ``/proc/<pid>/cmdline`` names the kernel's id, which is theirs
        to share (``share_labels``), and any user may read it.
        """
        free_cpus, free_gpus, free_ram = self.free()

        def who(entry: Entry) -> dict[str, Any]:
            mine = entry.uid == uid
            shown = mine or entry.share_labels

            def said(text: str | None, most: int) -> str | None:
                # Another user's words are theirs to choose, and every reader
                # gets them: cut short, so nobody can make the snapshot huge.
                if not shown or text is None:
                    return None
                return text if mine or len(text) <= most else text[: most - 1] + "…"

            return {
                "ticket": entry.number,
                "label": said(entry.label, OTHERS_LABEL_CHARS),
                "since": entry.since,
                "pid": entry.pid if mine or admin or sees_pids else None,
                "kernel_id": said(entry.kernel_id, OTHERS_LABEL_CHARS),
                "notebook": said(entry.notebook, OTHERS_NOTEBOOK_CHARS),
                "user": entry.user,
                "uid": entry.uid,
                "mine": mine,
                "cancel": entry.cancel,
                "warning": entry.warning,
            }

        # The head of the queue, and the first of the reader's own behind it:
        # one user's thousands of waiting claims are not every reader's to
        # carry, nor theirs to make the service walk.
        waiting, mine_waiting = self.waiting_count(), self.waiting_count(uid)
        listed: list[tuple[int, Entry]] = []
        mine_listed = mine_behind = 0
        for position, e in enumerate(self._fair_walk(), start=1):
            if position <= OTHERS_WAITING_LISTED or (
                e.uid == uid and mine_behind < MINE_WAITING_LISTED
            ):
                listed.append((position, e))
                if e.uid == uid:
                    mine_listed += 1
                    mine_behind += position > OTHERS_WAITING_LISTED
            if position >= OTHERS_WAITING_LISTED and (
                mine_behind >= MINE_WAITING_LISTED or mine_listed >= mine_waiting
            ):
                break
        mine_unlisted = mine_waiting - mine_listed
        return {
            "cpus": {"total": self.cpus, "free": max(free_cpus, 0), "free_ids": self.free_cores()},
            "gpus": {
                "total": len(self.gpu_ids),
                "free": len(free_gpus),
                "free_ids": free_gpus,
                "cards": self.cards().rows(),
            },
            "ram_bytes": {"total": self.ram_bytes, "free": max(free_ram, 0)},
            "waiting": [
                {
                    **who(e),
                    "position": position,
                    "asked": {
                        "cpus": e.need[0],
                        "gpus": e.need[1],
                        "ram_bytes": e.need[2],
                        **_slice_asked(e.piece),
                    },
                }
                for position, e in listed
            ],
            # Other users' claims not listed, and the reader's own.
            "waiting_unlisted": waiting - len(listed) - mine_unlisted,
            "mine_unlisted": mine_unlisted,
            "running": [
                {
                    **who(e),
                    "allocation": {
                        "cpus": e.need[0],
                        "gpus": list(e.gpus),
                        "ram_bytes": e.need[2],
                        "cores": list(e.cores),
                        **({"gpu_bytes": e.gpu_bytes} if e.gpu_bytes else {}),
                    },
                    "granted_at": e.granted_at,
                    "readings": e.readings,
                }
                for e in sorted(self.running, key=lambda e: e.number)
            ],
            "can_cancel_any": admin,
        }


def _slice_asked(piece: Slice | None) -> dict[str, Any]:
    if piece is None:
        return {}
    if piece.fraction is not None:
        return {"gpu_fraction": piece.fraction}
    return {"gpu_bytes": piece.nbytes}
