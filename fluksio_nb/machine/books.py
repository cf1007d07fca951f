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
  that does not sets aside what it needs, so later claims may overtake it
  only with what it does not need (:func:`~fluksio_nb.queue.who_goes_next`).
- **Cores are handed out by id**, as cards are, with
  :func:`~fluksio_nb.books.pick_cores`: disjoint between running claims,
  on one NUMA node where one has room.
- **An admin's cap is a user's own ceiling.** A claim its user's cap holds
  back sets nothing aside: one capped user never holds up anyone else.
- **What a reader is shown is bounded.** A snapshot lists the reader's own
  claims, the first :data:`OTHERS_WAITING_LISTED` of the queue and how many
  more wait, and other users' words cut short: no user can make it longer
  than a reader will take.

Everything here is plain data and runs in the service's one thread, so
there is no lock: the order the service reads its sockets in is the order
of the books.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fluksio_nb.books import pick_cores
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
    granted_at: float | None = None
    cancel: str | None = None
    readings: dict[str, Any] | None = None

    @property
    def held(self) -> Need:
        return (self.need[0], len(self.gpus), self.need[2])


#: How many of the queue's first waiting claims a snapshot lists besides the
#: reader's own, and how much of another user's label, kernel id and notebook
#: path it shows: together they keep a snapshot far below the protocol's
#: longest line, whatever other users ask for or call their claims.
OTHERS_WAITING_LISTED = 100
OTHERS_LABEL_CHARS = 120
OTHERS_NOTEBOOK_CHARS = 240


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
    ) -> None:
        self.cpus, self.gpu_ids, self.ram_bytes = cpus, tuple(sorted(gpu_ids)), ram_bytes
        self.core_ids, self.core_nodes = tuple(sorted(core_ids)), dict(core_nodes or {})
        self.entries: dict[int, Entry] = {}
        self.caps: dict[int, Cap] = {}
        self._numbers = itertools.count(1)
        #: When each user's last claim was granted: who goes first in a round.
        self._last_granted: dict[int, float] = {}

    def next_number(self) -> int:
        return next(self._numbers)

    def add(self, entry: Entry) -> None:
        self.entries[entry.number] = entry

    def remove(self, number: int) -> Entry | None:
        return self.entries.pop(number, None)

    @property
    def running(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == "running"]

    @property
    def waiting(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.state == "waiting"]

    def free(self) -> tuple[int, list[int], int]:
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
        self, cpus: int, gpus: Iterable[int], ram_bytes: int, cores: Iterable[int] = ()
    ) -> bool:
        """Whether a share named to the card is free now: for a claim restored after a restart."""
        free_cpus, free_gpus, free_ram = self.free()
        return (
            cpus <= free_cpus
            and set(gpus) <= set(free_gpus)
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
        by_user: dict[int, list[Entry]] = {}
        for entry in sorted(self.waiting, key=lambda e: e.number):
            by_user.setdefault(entry.uid, []).append(entry)
        users = sorted(
            by_user,
            key=lambda uid: (self._last_granted.get(uid, -math.inf), by_user[uid][0].number),
        )
        rounds = itertools.zip_longest(*(by_user[uid] for uid in users))
        return [entry for one_round in rounds for entry in one_round if entry is not None]

    def dispatch(self) -> list[Entry]:
        """Grant whatever may go now, fairly; returns the claims just granted."""
        if not any(e.state == "waiting" for e in self.entries.values()):
            return []
        free_cpus, free_gpus, free_ram = self.free()
        free_cores = self.free_cores()
        spare: list[float] = [free_cpus, len(free_gpus), free_ram]
        room = {uid: cap.room(self.held_by(uid)) for uid, cap in self.caps.items()}
        granted = []
        for entry in self.fair_order():
            mine = room.get(entry.uid)
            if mine is not None and not _fits(entry.need, mine):
                continue
            if _fits(entry.need, spare):
                cards, free_gpus = free_gpus[: entry.need[1]], free_gpus[entry.need[1] :]
                entry.cores = pick_cores(free_cores, entry.need[0], self.core_nodes)
                free_cores = [c for c in free_cores if c not in entry.cores]
                entry.state, entry.gpus, entry.granted_at = "running", tuple(cards), time.time()
                self._last_granted[entry.uid] = time.monotonic()
                granted.append(entry)
                if mine is not None:
                    mine[:] = [r - n for r, n in zip(mine, entry.need, strict=True)]
            # Granted or not, what it needs is spoken for: a claim behind it
            # may overtake it only with what it does not need.
            spare = [s - n for s, n in zip(spare, entry.need, strict=True)]
        return granted

    def snapshot(self, uid: int, *, admin: bool = False) -> dict[str, Any]:
        """The machine as user ``uid`` may see it: everyone's shares, their own labels."""
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
                "pid": entry.pid,
                "kernel_id": said(entry.kernel_id, OTHERS_LABEL_CHARS),
                "notebook": said(entry.notebook, OTHERS_NOTEBOOK_CHARS),
                "user": entry.user,
                "uid": entry.uid,
                "mine": mine,
                "cancel": entry.cancel,
            }

        order = self.fair_order()
        # Every claim of the reader's own, and the first of everyone else's:
        # one user's thousands of waiting claims are not every reader's to carry.
        listed = [
            (position, e)
            for position, e in enumerate(order, start=1)
            if e.uid == uid or position <= OTHERS_WAITING_LISTED
        ]
        return {
            "cpus": {"total": self.cpus, "free": max(free_cpus, 0), "free_ids": self.free_cores()},
            "gpus": {"total": len(self.gpu_ids), "free": len(free_gpus), "free_ids": free_gpus},
            "ram_bytes": {"total": self.ram_bytes, "free": max(free_ram, 0)},
            "waiting": [
                {
                    **who(e),
                    "position": position,
                    "asked": {"cpus": e.need[0], "gpus": e.need[1], "ram_bytes": e.need[2]},
                }
                for position, e in listed
            ],
            "waiting_unlisted": len(order) - len(listed),
            "running": [
                {
                    **who(e),
                    "allocation": {
                        "cpus": e.need[0],
                        "gpus": list(e.gpus),
                        "ram_bytes": e.need[2],
                        "cores": list(e.cores),
                    },
                    "granted_at": e.granted_at,
                    "readings": e.readings,
                }
                for e in sorted(self.running, key=lambda e: e.number)
            ],
            "can_cancel_any": admin,
        }
