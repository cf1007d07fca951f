"""The kernel's accountant when its books are the user's ledger: :class:`MachineQueue`.

A kernel asks its accountant the same questions whichever books are in
force (:mod:`fluksio_nb.kernel` picks them). This one answers them with the
rules of :class:`~fluksio_nb.queue.ClaimQueue`, from the ledger every kernel
of the user shares, and keeps this kernel's tickets in step with it.

What it decides:

- **A claim granted on the spot opens no socket.** Only a claim that has to
  wait gets one to be woken on (:class:`~fluksio_nb.ledger.wake.Waker`).
- **A claim the ledger recorded is never lost to the stop button.** If
  asking is interrupted after the ledger has the claim, it is given back,
  and giving back is never cut in half, by a second stop or by this
  kernel's own looking thread writing back what it is giving back.
- **A kernel holding a share keeps looking.** Every half second it reads
  the ledger: a cancel from another process reaches its claim, its claims'
  readings are written, and claims a rebuilt ledger lost are written back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.errors import BadClaim, ClaimCancelled, ClaimTimeout
from fluksio_nb.inventory import Inventory
from fluksio_nb.ledger.file import LedgerFile
from fluksio_nb.ledger.owner import identity
from fluksio_nb.ledger.rules import cancel_claim, dispatch
from fluksio_nb.ledger.snapshot import machine_snapshot
from fluksio_nb.ledger.wake import Waker, wake
from fluksio_nb.queue import Ticket, fit_to_capacity, timeout_message
from fluksio_nb.resources import Resources
from fluksio_nb.stop_button import stop_held_back

#: How often a waiter or a running claim looks at the ledger when nobody wakes
#: it: the bound on how long a silently dead holder keeps its share.
LOOK_EVERY_S = 0.5

#: How long the looking thread stays once this kernel holds nothing, waking
#: each :data:`LOOK_EVERY_S` without reading the ledger.
LINGER_S = 30.0


class MachineQueue:
    """The kernel's accountant, keeping its books in the machine's ledger.

    It answers what :class:`~fluksio_nb.queue.ClaimQueue` answers, with the same
    rules; only where the books live differs.
    """

    def __init__(self, directory: Path, inventory: Inventory) -> None:
        self.books = ResourceAccountant.from_inventory(inventory)
        self.ledger = LedgerFile(
            directory,
            inventory.for_books(),
        )
        self.owner = identity()
        #: What holds claims made here to their share, per resource, as
        #: :func:`fluksio_nb.kernel.enforcement_in_force` says: in every snapshot.
        self.enforcement: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._mine: dict[int, Ticket] = {}
        #: Claims being given back: no look may write them back or adopt a
        #: grant for them, though they stay in ``_mine`` until the ledger is
        #: written (a failed write leaves them to be given back again).
        self._giving_back: set[int] = set()
        self._wakers: dict[int, Waker] = {}
        self._readings: dict[int, dict[str, Any]] = {}
        #: The other kernels holding shares, as the last transaction found
        #: them: a waiter here watches them end.
        self._holding_elsewhere: list[dict[str, Any]] = []
        self._looker: threading.Thread | None = None

    # -- asking ---------------------------------------------------------------

    def fit_to_machine(self, wanted: Resources) -> Resources:
        return fit_to_capacity(wanted, self.books)

    def enqueue(self, wanted: Resources, label: str | None = None) -> Ticket:
        fitted = self.fit_to_machine(wanted)
        waker = None
        ticket: Ticket | None = None
        try:
            # Held back throughout, the stop lands once this kernel knows the
            # claim as well as the ledger does.
            with stop_held_back():
                with self.ledger.transaction() as state:
                    if self.ledger.disagreement is not None:
                        raise BadClaim(_not_queued(label or wanted.label, self.ledger.disagreement))
                    number = state["next"]
                    state["next"] += 1
                    ticket = Ticket(
                        number=number,
                        resources=fitted,
                        label=label or wanted.label or f"claim {number}",
                    )
                    self._restore_missing(state)
                    entry = self._entry(ticket, None)
                    state["tickets"].append(entry)
                    woken = dispatch(state, checked=True)
                    # Only a claim that has to wait needs waking: one granted on
                    # the spot, as most are, opens no socket.
                    if entry["state"] == "waiting":
                        waker = Waker(self.ledger)
                        entry["wake"] = waker.address
                with self._lock:
                    self._mine[number] = ticket
                    if waker is not None:
                        self._wakers[number] = waker
                self._adopt(state)
                wake(self.ledger, woken)
        except BaseException:
            # The stop button may land after the ledger has the claim and
            # before the caller does: nobody would ever give it back.
            if ticket is not None:
                with contextlib.suppress(Exception):
                    self.release(ticket)
            if waker is not None:
                waker.close()
            raise
        return ticket

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Allocation:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if ticket.allocation is not None:
                return ticket.allocation
            if ticket.cancelled is not None:
                raise ClaimCancelled(
                    f"{ticket.label} was cancelled while waiting: {ticket.cancelled}"
                )
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ClaimTimeout(self.timeout_message(ticket, timeout))
            waker = self._wakers.get(ticket.number)
            pause = LOOK_EVERY_S if left is None else min(left, LOOK_EVERY_S)
            if waker is not None:
                waker.watch(self._holding_elsewhere)
                waker.sleep(pause)
            else:
                time.sleep(pause)
            self.look()

    def release(self, ticket: Ticket) -> None:
        if ticket.state == "done" and ticket.number not in self._mine:
            return
        # Held back throughout: a second stop, landing while the first one's
        # cleanup gives the claim back, would leave it in the ledger.
        with stop_held_back():
            # Marked before the ledger changes: the looking thread may take the
            # ledger between this transaction and the forgetting below, and
            # write back a claim still "running" here, held by nobody.
            with self._lock:
                self._giving_back.add(ticket.number)
            with self.ledger.transaction() as state:
                self._restore_missing(state)
                state["tickets"] = [t for t in state["tickets"] if t["number"] != ticket.number]
                woken = dispatch(state, checked=True)
            ticket.state = "done"
            self._forget(ticket.number)
            self._adopt(state)
            wake(self.ledger, woken)

    def cancel(self, number: int, reason: str = "cancelled by the user") -> bool:
        """Cancel a waiting claim, or ask a running one to stop, in any kernel of this user."""
        found = cancel_claim(self.ledger, number, reason)
        self.look()
        return found

    # -- keeping up with the ledger -------------------------------------------

    def look(self) -> None:
        """Read the ledger, reap the dead, grant what can go, and learn our own news."""
        with self.ledger.transaction() as state:
            self._restore_missing(state)
            for entry in state["tickets"]:
                reading = self._readings.get(entry["number"])
                if reading is not None and entry["owner"]["pid"] == self.owner["pid"]:
                    entry["readings"] = reading
            woken = dispatch(state, checked=True)
        self._adopt(state)
        wake(self.ledger, woken)

    def report(self, ticket: Ticket, readings: dict[str, Any]) -> None:
        """The latest readings of a running claim, written on the next look.

        A claim reports a reading only when it is news (:func:`~fluksio_nb.sampler.is_news`),
        so a steady claim leaves the document alone and ``at`` is when its
        figures last moved.
        """
        self._readings[ticket.number] = readings

    def _adopt(self, state: dict[str, Any]) -> None:
        """Bring this kernel's tickets up to date with what the ledger says of them."""
        by_number = {t["number"]: t for t in state["tickets"]}
        self._holding_elsewhere = [
            t["owner"]
            for t in state["tickets"]
            if t["state"] == "running" and t["owner"]["pid"] != self.owner["pid"]
        ]
        stop = []
        with self._lock:
            for number, ticket in list(self._mine.items()):
                entry = by_number.get(number)
                if number in self._giving_back:
                    continue
                if entry is None:
                    if ticket.state == "waiting" and ticket.cancelled is None:
                        ticket.cancelled = "cancelled from another process"
                    continue
                if entry["state"] == "running" and ticket.allocation is None:
                    ticket.allocation = Allocation.from_dict(entry["allocation"])
                    ticket.state, ticket.granted_at = "running", entry["granted_at"]
                    self._start_looking()
                if entry.get("cancel") and ticket.cancelled is None:
                    ticket.cancelled = entry["cancel"]
                    if ticket.state == "running" and ticket.on_cancel is not None:
                        stop.append((ticket.on_cancel, entry["cancel"]))
        for on_cancel, reason in stop:
            on_cancel(reason)

    def _restore_missing(self, state: dict[str, Any]) -> None:
        """Write back this kernel's running claims if the ledger lost them."""
        present = {t["number"] for t in state["tickets"]}
        with self._lock:
            for number, ticket in self._mine.items():
                lost = number not in present and number not in self._giving_back
                if lost and ticket.state == "running":
                    state["tickets"].append(self._entry(ticket, None, restored=True))
                    state["next"] = max(state["next"], number + 1)
            state["tickets"].sort(key=lambda t: t["number"])

    def _entry(self, ticket: Ticket, wake_address: str | None, restored: bool = False):
        entry = {
            "number": ticket.number,
            "state": "waiting",
            "label": ticket.label,
            "asked": {
                "cpus": ticket.resources.cpus,
                "gpus": ticket.resources.gpus,
                "ram_bytes": ticket.resources.ram_bytes,
            },
            "allocation": None,
            "owner": self.owner,
            "since": ticket.since,
            "granted_at": None,
            "wake": wake_address,
            "cancel": None,
            "readings": None,
        }
        if restored and ticket.allocation is not None:
            entry["state"] = "running"
            entry["allocation"] = ticket.allocation.as_dict()
            entry["granted_at"] = ticket.granted_at
        return entry

    def _forget(self, number: int) -> None:
        with self._lock:
            self._mine.pop(number, None)
            self._giving_back.discard(number)
            self._readings.pop(number, None)
            waker = self._wakers.pop(number, None)
        if waker is not None:
            waker.close()

    def _start_looking(self) -> None:
        """While this kernel holds a share, look every half second. Lock held.

        The looking thread stays for :data:`LINGER_S` after the kernel's last
        share is given back, only to be there for the next one: a notebook's
        claimed cells come seconds apart, and starting a thread for each was
        a tenth of a millisecond of a trivial claim, on the main thread.
        """
        if self._looker is not None and self._looker.is_alive():
            return

        def keep_looking() -> None:
            idle_since: float | None = None
            while True:
                time.sleep(LOOK_EVERY_S)
                now = time.monotonic()
                with self._lock:
                    holding = any(t.state == "running" for t in self._mine.values())
                    idle_since = None if holding else (idle_since or now)
                    if idle_since is not None and now - idle_since >= LINGER_S:
                        self._looker = None
                        return
                if holding:
                    with contextlib.suppress(Exception):
                        self.look()

        self._looker = threading.Thread(target=keep_looking, name="fluksio-ledger", daemon=True)
        self._looker.start()

    # -- what is going on -----------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The machine: totals, free, every kernel's waiting and running claims."""
        state = self.ledger.read()
        # The description the books are kept over, which is this kernel's
        # unless it would drop claims other kernels hold (LedgerFile._in_force).
        shown = machine_snapshot(state, state["inventory"], checked=True)
        return {**shown, "enforcement": self.enforcement}

    def position(self, ticket: Ticket) -> int | None:
        waiting = [t["number"] for t in self.ledger.read()["tickets"] if t["state"] == "waiting"]
        return waiting.index(ticket.number) + 1 if ticket.number in waiting else None

    def holders(self) -> list[Ticket]:
        holders = []
        for entry in self.ledger.read()["tickets"]:
            if entry["state"] != "running":
                continue
            held = entry["allocation"]
            ticket = Ticket(
                number=entry["number"],
                resources=Resources(cpus=max(1, held["cpus"]), gpus=len(held["gpus"])),
                label=entry["label"],
                since=entry["since"],
                pid=entry["owner"]["pid"],
                state="running",
                allocation=Allocation.from_dict(held),
            )
            holders.append(ticket)
        return holders

    def timeout_message(self, ticket: Ticket, timeout: float | None) -> str:
        return timeout_message(ticket, timeout, self.holders())


def _not_queued(label: str | None, disagreement: str) -> str:
    return (
        f"{label or 'the claim'} was not queued: {disagreement}. Kernels sharing books must "
        "describe the machine alike: start this kernel with the same FLUKSIO_CPUS, "
        "FLUKSIO_GPUS, FLUKSIO_RAM, FLUKSIO_RESERVE_CPUS and FLUKSIO_PIN_CORES as theirs "
        "(or the same config file), or give it books of its own by setting FLUKSIO_LEDGER "
        "to another directory. Once their claims have ended, this kernel's description is taken"
    )
