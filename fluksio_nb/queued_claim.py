"""A claim on this machine waiting its turn in the kernel's queue: visibly, and never for ever.

A claim on this machine (:class:`~fluksio_nb.local_claim.Claim`) is granted
its share by the kernel's queue (:mod:`fluksio_nb.queue`, kept by the
kernel's accountant), which may make it wait behind other claims, the user's
own and other users'. :class:`QueuedClaim` is that wait, and it decides:

- **A place in the queue is taken once, when the cell asks**
  (:meth:`~QueuedClaim.enqueue`), so that background cells started in order
  are granted in order. Its timeout counts from then: waiting counts, as
  starting and running do after it.
- **Where it stands is shown while it waits**: its place, who holds what it
  waits for, by what they hold rather than by ticket numbers, which read like
  a cell's ``In[n]``, and when it may start, guessed from the queue and past
  runs every :data:`GUESS_EVERY_S` at most. A guess that cannot be made is
  left unsaid; a claim granted on the spot shows nothing of the queue.
- **A wait that could never end is refused before it starts**: for what
  claims of the same thread hold around it until their ``with`` blocks end,
  or with ``gpu_ram=`` where nothing reads the cards' memory to hold it to.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fluksio_nb.books import Allocation
from fluksio_nb.errors import BadClaim, ClaimTimeout
from fluksio_nb.expected_wait import describe_wait, expected_waits
from fluksio_nb.gpu_usage import kernel_cards
from fluksio_nb.kernel import accountant
from fluksio_nb.lifecycle import ClaimLifecycle
from fluksio_nb.queue import ClaimQueue, Ticket, held_words
from fluksio_nb.resources import Resources
from fluksio_nb.status import StatusView
from fluksio_nb.usage.recent import process_recent_usage

#: How long the status may lag the queue while a claim waits.
_STATUS_EVERY_S = 0.5

#: How often a waiting claim guesses again when it may start: each guess reads
#: the queue and the usage records, and the answer moves in minutes.
GUESS_EVERY_S = 5.0

#: The claims each thread holds now: one made inside another's ``with`` block,
#: in the same thread, cannot wait for what the outer one holds.
_held_by_thread = threading.local()


def held_in_this_thread() -> list[QueuedClaim]:
    """The claims this thread holds now; a claim joins once started and leaves as it ends."""
    held = getattr(_held_by_thread, "claims", None)
    if held is None:
        held = _held_by_thread.claims = []
    return held


class QueuedClaim(ClaimLifecycle):
    """A claim granted its share by the kernel's queue, shown where it stands while it waits."""

    def __init__(
        self,
        wanted: Resources,
        *,
        label: str,
        view: StatusView | None,
        show_after: float | None,
        queue: ClaimQueue | None,
    ) -> None:
        super().__init__(wanted, label=label, view=view, show_after=show_after)
        self._queue = queue or accountant()
        self._ticket: Ticket | None = None
        self._deadline: float | None = None
        #: When its wait was last guessed: the first guess comes a second into the wait.
        self._guessed_at = time.monotonic() - GUESS_EVERY_S + 1.0

    def take_place(self) -> None:
        self.enqueue()

    def enqueue(self) -> Ticket:
        """Take a place in the queue and show it; does not wait. Idempotent."""
        if self._ticket is not None:
            return self._ticket
        asked_at = time.monotonic()
        if self.wanted.gpu_ram is not None:
            # Refused now, not after a wait in the queue for a card it could not use.
            self._cards_read_for_gpu_ram(self.wanted)
        ticket = self._queue.enqueue(self.wanted)
        self._ticket = ticket
        if ticket.resources.timeout != self.wanted.timeout:
            # Cut to the admin's time limit as it queued (:mod:`fluksio_nb.machine.caps`).
            self.wanted = self.wanted.model_copy(update={"timeout": ticket.resources.timeout})
        if self.wanted.timeout is not None:
            self._deadline = asked_at + self.wanted.timeout
        self._remember_the_cell()
        self.status.label, self.status.ticket = ticket.label, ticket.number
        self.status.asked = ticket.resources
        # A claim granted on the spot has no place in the queue to show, and
        # asking the books for one cost a warm trivial cell two more reads.
        if ticket.allocation is None:
            self._refresh_queue_position()
        if self._show_after is None:
            self._show()
        return ticket

    @property
    def granted_at(self) -> float | None:
        """When the queue granted the share (``time.time()``), if it has."""
        return None if self._ticket is None else self._ticket.granted_at

    def cancel(self, reason: str) -> bool:
        """Leave the queue, or stop the work if it is running. False if it never queued."""
        if self._ticket is None:
            return False
        return self._queue.cancel(self._ticket.number, reason)

    def _refuse_to_wait_on_this_thread(self, ticket: Ticket) -> None:
        """Refuse a wait that could never end: for what claims around it, here, hold."""
        around = [
            claim.allocation
            for claim in held_in_this_thread()
            if claim.allocation is not None and claim.status.phase != "done"
        ]
        if not around:
            return
        wanted, books = ticket.resources, self._queue.books
        if books.fits(
            wanted.cpus + sum(held.cpus for held in around),
            wanted.gpus + sum(len(held.gpus) for held in around),
            wanted.ram_bytes + sum(held.ram_bytes for held in around),
        ):
            return
        holding = " and ".join(held_words(held) for held in around)
        raise BadClaim(
            f"{ticket.label} would wait for ever: it asks for {wanted.describe()} inside a "
            f"claim of this same thread that holds {holding} until its `with` block ends, "
            "and the machine has not that much beside it. Ask for less, or claim it all "
            "in the outer block and use that."
        )

    def _cards_read_for_gpu_ram(self, wanted: Resources) -> Any:
        """The cards' reading, for a claim with ``gpu_ram=``; refused if nothing reads them."""
        reading = kernel_cards().read()
        if reading is None:
            asked = wanted.gpu_ram.human_readable(decimal=True) if wanted.gpu_ram else "?"
            raise BadClaim(
                f"{self.status.label} asks for gpu_ram={asked}, "
                "and nothing here reads the cards' memory to hold it to that: NVML's "
                "library (libnvidia-ml, with the driver) could not be loaded and nvidia-smi "
                "is not on PATH. Drop gpu_ram=, or run where the driver is installed"
            )
        return reading

    def _wait(self, ticket: Ticket) -> Allocation:
        # The first look comes sooner: a claim still waiting then is shown
        # waiting, and one granted by then never needed to be.
        every = _STATUS_EVERY_S if self._show_after is None else self._show_after
        while True:
            left = None if self._deadline is None else self._deadline - time.monotonic()
            try:
                return self._queue.wait(ticket, every if left is None else min(max(left, 0), every))
            except ClaimTimeout:
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    raise ClaimTimeout(
                        self._queue.timeout_message(ticket, self.wanted.timeout)
                    ) from None
            every = _STATUS_EVERY_S
            self._refresh_queue_position()
            self._show()
            self._update_view()

    def _refresh_queue_position(self) -> None:
        ticket = self._ticket
        if ticket is None:
            return
        self.status.position = self._queue.position(ticket)
        self._guess_the_wait(ticket)
        # By what they hold, not their ticket numbers, which read like a cell's In[n].
        self.status.holders = [
            f"{holder.label!r} ({held_words(holder.allocation)})"
            for holder in self._queue.holders()
            if holder.number != ticket.number
        ]

    def _guess_the_wait(self, ticket: Ticket) -> None:
        """When the claim may start, from the queue and past runs; every few seconds at most."""
        now = time.monotonic()
        if ticket.allocation is not None or now - self._guessed_at < GUESS_EVERY_S:
            return
        self._guessed_at = now
        try:
            snapshot = self._queue.snapshot()
            durations, shapes = process_recent_usage().past_runs()
            guesses = expected_waits(snapshot, durations, shapes=shapes)
        except Exception:
            # A guess is a courtesy: records that cannot be read never fail a claim.
            return
        for waiting, guess in zip(snapshot.get("waiting", ()), guesses, strict=True):
            if waiting.get("ticket") == ticket.number:
                self.status.expected_wait = describe_wait(guess)
