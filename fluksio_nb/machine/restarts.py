"""What the books service keeps across its own restart, and who may take it back.

An admin's ``machine init`` restarts the service, and a crash does too, while
claims run: their kernels hold their shares through it, and put them back in
the new service's books as they reconnect. For that short grace
(:data:`RESTORE_GRACE_S`) nothing is granted, so nothing waiting is given
what a running claim still holds.

A put-back is a way past the queue and the cap, so it is taken only as the
service before wrote the claim down (:mod:`.state`): the asker's uid, the
secret that claim's grant gave its kernel alone, and exactly its share.
Another user who read the share in a snapshot and races its owner's kernel
to put it back is refused, and is not told whose it was. Each written-down
claim is taken once, under its old number.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from fluksio_nb.card_slices import Slice
from fluksio_nb.machine import protocol
from fluksio_nb.machine.books import Entry
from fluksio_nb.machine.state import HeldClaim, ServiceState, digest, matches, new_secret
from fluksio_nb.machine.turns import Connection

if TYPE_CHECKING:
    from fluksio_nb.machine.books import MachineBooks
    from fluksio_nb.machine.time_limits import TimeLimits

#: How soon a change of the running claims is written down for the next
#: service: often enough that a crash loses little, rarely enough that
#: writing costs the claims nothing.
HELD_WRITTEN_WITHIN_S = 0.25

#: How long a service that just started grants nothing, so that kernels whose
#: claims ran across a restart put them back before anything waiting is
#: granted what they still hold.
RESTORE_GRACE_S = 3.0


class AcrossRestarts:
    """The part of :class:`~fluksio_nb.machine.service.BooksService` a restart needs.

    It takes a claim with the service's own ``_new_entry``, checks it
    against ``_too_big``, and grants what waits with ``dispatch`` once the
    grace is over.
    """

    books: MachineBooks
    state: ServiceState | None
    held_before: dict[int, HeldClaim]
    _granting_from: float
    _state_due: bool
    _state_frozen: bool
    time_limits: TimeLimits

    def _on_restore(self, connection: Connection, request: protocol.Restore) -> None:
        """A kernel's running claim from before the service restarted, back in the books.

        Taken only in the grace after a restart, while nothing is granted;
        only as the claim the service before wrote down, of the asker's
        uid, with the secret its grant gave and exactly its share, so that
        nobody may take what they read of another's claim in a snapshot;
        and only if that is free, and within its user's cap beside what
        they hold: at any other time a restore would be a way past the queue
        and the cap.
        """
        sliced = request.gpu_bytes
        need = (request.cpus, 0 if sliced else len(request.gpus), request.ram_bytes)
        held = self.held_before.get(request.ticket) if request.ticket is not None else None
        why = None
        if not self._holding():
            why = "a claim is put back only while the service restarts"
        elif (
            held is None
            or held.uid != connection.uid
            or not matches(request.secret, held.secret_sha256)
            or not held.holds(request.cpus, request.gpus, request.ram_bytes, request.cores, sliced)
        ):
            # Whose it was, if anyone's, is not said: that is for a snapshot to show.
            named = "" if request.ticket is None else f" as claim {request.ticket}"
            why = (
                f"not put back: the service did not grant this share to {connection.user}"
                f"{named} with the secret given, and only the kernel that held a claim may "
                "put it back after a restart"
            )
        elif (
            len(set(request.gpus)) != len(request.gpus)
            or len(set(request.cores)) != len(request.cores)
            or (request.cores and len(request.cores) != request.cpus)
            or (sliced and len(request.gpus) != 1)
            or not set(request.gpus) <= set(self.books.gpu_ids)
            or self._too_big(connection, need)
            or not self.books.within_cap(connection.uid, need)
            or not self.books.fits_free(
                request.cpus, request.gpus, request.ram_bytes, request.cores, sliced
            )
        ):
            why = "no longer free"
        if why is not None:
            connection.send({"op": "error", "id": request.id, "message": why})
            return
        assert held is not None
        # Taken once: a second restore of it is nobody's.
        del self.held_before[held.ticket]
        now = time.time()
        entry = self._new_entry(
            connection,
            need,
            request.label,
            # Its number as before: the one its owner, and an admin, read.
            number=held.ticket,
            state="running",
            gpus=tuple(request.gpus),
            cores=tuple(request.cores),
            gpu_bytes=sliced,
            piece=Slice(nbytes=sliced) if sliced else None,
            since=now,
            # Its grant as before: a restart gives no claim more time (:mod:`.time_limits`).
            granted_at=held.granted_at or now,
            secret_sha256=held.secret_sha256,
        )
        self.time_limits.granted(entry)
        self.note_held()
        connection.send(
            {"op": "ticket", "id": request.id, "ticket": entry.number, "since": entry.since}
        )

    def _holding(self) -> bool:
        return bool(self._granting_from) and asyncio.get_running_loop().time() < self._granting_from

    def hold_grants(self, seconds: float) -> None:
        """Grant nothing for ``seconds``, then everything that fits: a restart's grace."""
        loop = asyncio.get_running_loop()
        self._granting_from = loop.time() + seconds
        loop.call_later(seconds, self.dispatch)

    def _grant_secret(self, entry: Entry) -> str:
        """A secret for the owner's kernel alone: what it shows to put the share back."""
        secret = new_secret()
        entry.secret_sha256 = digest(secret)
        return secret

    # -- what the next service reads ------------------------------------------------

    def take_over(self) -> None:
        """Read what the service before this one held: the only claims put back."""
        if self.state is not None:
            self.held_before = self.state.held_before()

    def note_held(self) -> None:
        """The running claims changed: written down within :data:`HELD_WRITTEN_WITHIN_S`.

        Not at every change: rewriting the file at every grant took the
        median claim with 16 processes contending from 0.2 to 4-8 ms. A
        service that crashes in between loses the newest grants' put-back
        (their kernels are told why); one stopped by its admin writes what
        it holds as it stops (:meth:`freeze_held`).
        """
        if self.state is None or self._state_due or self._state_frozen:
            return
        self._state_due = True
        asyncio.get_running_loop().call_later(HELD_WRITTEN_WITHIN_S, self._write_held)

    def _write_held(self) -> None:
        self._state_due = False
        if self.state is None or self._state_frozen:
            return
        self.state.write_held(self.books.running)

    def freeze_held(self) -> None:
        """Stopping: what is held now is what the next service reads, whatever closes after."""
        self._write_held()
        self._state_frozen = True
