"""What shows the books service that this kernel's claims are its own.

Two moments need more than the connection a claim was made on:

- **After a restart** the connection is gone, and the service takes a
  share back only from the kernel it granted it to: with each grant comes a
  secret, which this kernel keeps and shows when it puts the share back
  (the service keeps only a digest, :mod:`.state`). Another user who read
  the share from a snapshot cannot show it.
- **An admin's cancel** the service carries out itself if this kernel does
  not (:mod:`.revoke`): it kills the processes this kernel said it started
  for the claim, once it has checked they are this user's, below this
  kernel. So each is told as it starts. And a worker killed so is told
  apart from one that died: before a cell says its worker died, it hears
  whatever the service sent first, which names who stopped it.

Kept apart from :mod:`.client`, whose class this is mixed into, because it
is about ownership, not about who reads the connection when.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from fluksio_nb.errors import ServiceUnavailable
from fluksio_nb.machine import protocol
from fluksio_nb.queue import Ticket

if TYPE_CHECKING:
    from fluksio_nb.machine.client import ServiceQueue

#: What a running claim's cell reads when a restart took its share.
TAKEN = (
    "this kernel's connection to the machine's books service broke (the service "
    "restarted, or the kernel stopped answering it), and what this claim held is taken"
)


class Ownership:
    """The secrets of this kernel's grants, and what it tells of its claims' processes.

    A mixin of :class:`~fluksio_nb.machine.client.ServiceQueue`, using its
    lock and connection; every method that says "lock held" is called with
    ``self._lock`` held.
    """

    def _init_ownership(self) -> None:
        #: Each running claim's secret, by ticket number, as its grant gave it.
        self._secrets: dict[int, str] = {}

    def _keep_secret(self, granted: dict[str, Any]) -> None:
        """A grant's secret, for this kernel alone to put its share back. Lock held."""
        secret = granted.get("secret")
        if isinstance(secret, str):
            self._secrets[granted["ticket"]] = secret

    def _forget_secret(self, number: int) -> None:
        """The claim is over: nothing to put back. Lock held."""
        self._secrets.pop(number, None)

    def processes(self: ServiceQueue, ticket: Ticket, pids: list[int]) -> None:
        """Tell the service the processes started for ``ticket``: what an admin's cancel stops."""
        with contextlib.suppress(ServiceUnavailable, OSError):
            self._send({"op": "processes", "ticket": ticket.number, "pids": pids})

    def hear_all_sent(self: ServiceQueue) -> None:
        """Hear everything the service sent this kernel before now: a stop, say.

        The service answers in the order it sends, so once this answer is
        read every line sent before it has been heard.
        """
        with contextlib.suppress(ServiceUnavailable, OSError):
            self._ask({"op": "news"})

    def _put_back(self: ServiceQueue) -> None:
        """After a restart: running claims written back if still free, waiting ones queued again."""
        with self._lock:
            mine, self._held_over = self._held_over, []
        for put, ticket in enumerate(mine):
            if ticket.state == "running" and ticket.allocation is not None:
                held = ticket.allocation
                with self._lock:
                    secret = self._secrets.get(ticket.number)
                request: dict[str, Any] = {
                    "op": "restore",
                    "label": ticket.label,
                    "cpus": held.cpus,
                    "gpus": list(held.gpus),
                    "ram_bytes": held.ram_bytes,
                    "cores": list(held.cores),
                    **({"gpu_bytes": held.gpu_bytes} if held.gpu_bytes else {}),
                    "ticket": ticket.number,
                    "secret": secret,
                }
            elif ticket.state == "waiting":
                r = ticket.resources
                need = protocol.need_said(r.cpus, r.card_ask, r.ram_bytes)
                request = {"op": "claim", "label": ticket.label, "need": need}
            else:
                continue
            asked = next(self._ids)
            try:
                answer = self._ask(request, asked)
            except ServiceUnavailable:
                # Gone again: the next connection puts these back.
                with self._lock:
                    self._held_over.extend(mine[put:])
                return
            self._own(asked)
            if answer["op"] != "ticket":
                reason = f"{TAKEN} (the service said: {answer.get('message')})"
                with self._lock:
                    self._forget_secret(ticket.number)
                    ticket.cancelled = reason
                    self._cond.notify_all()
                if ticket.state == "running" and ticket.on_cancel is not None:
                    ticket.on_cancel(reason)
                continue
            with self._lock:
                if ticket.state == "done":
                    # Released while the service was away: nothing to hold.
                    self._forget_secret(ticket.number)
                    self._give_back_unasked(answer["ticket"])
                    continue
                if (secret := self._secrets.pop(ticket.number, None)) is not None:
                    self._secrets[answer["ticket"]] = secret
                ticket.number = answer["ticket"]
                self._mine[ticket.number] = ticket
                if request["op"] == "claim" and "gpus" in answer:
                    self._heard({**answer, "op": "granted"})
                self._heard_early(ticket)
                self._reader_wakes.notify()
