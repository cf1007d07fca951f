"""The kernel's side of the machine's books service.

:class:`ServiceQueue` answers what the kernel's own queue answers (``enqueue``,
``wait``, ``release``, ``cancel``, ``snapshot``), by asking the service. One
connection per process, kept open: the service frees this process's claims
when it closes, so the connection is the claims' lifeline and nothing else
needs to be cleaned up when a kernel dies.

What it decides:

- **It trusts only a service run by root**, in a run directory only root can
  write, checked with ``SO_PEERCRED`` on the connection itself. Another user
  cannot plant a socket that collects this kernel's claims.
- **Waiting is local.** A waiter sleeps on a condition the connection's
  reader thread signals when the service pushes a grant or a stop, so
  ``--timeout`` and the stop button work whatever any other process does.
- **A service that restarts loses nothing.** The reader reconnects, writes
  this kernel's running claims back (taken only if still free: one that is
  not is stopped, with the reason), and queues its waiting claims again.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.errors import (
    ClaimTooLarge,
    ClampedWarning,
    NotYours,
    ServiceUnavailable,
    warn_at_users_line,
)
from fluksio_nb.machine import protocol
from fluksio_nb.machine.books import Cap
from fluksio_nb.queue import Ticket, fit_to_capacity, timeout_message, wait_for_grant, wait_on
from fluksio_nb.resources import Resources

#: How long a request waits for the service's answer before it is an error.
ANSWER_WITHIN_S = 10.0
#: How long a kernel keeps trying to reach a service that is set up but not
#: answering, before a claim says so.
REACH_WITHIN_S = 3.0


def connect(path: Path, within: float = REACH_WITHIN_S) -> socket.socket:
    """A connection to the service at ``path``, checked to be root's."""
    deadline = time.monotonic() + within
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(ANSWER_WITHIN_S)
            sock.connect(str(path))
            _, uid, _ = protocol.peer_credentials(sock)
            if uid != 0:
                raise ServiceUnavailable(
                    f"the process answering at {path} runs as uid {uid}, not root; "
                    "fluksio_nb trusts only a books service run by root"
                )
            return sock
        except OSError as error:
            sock.close()
            if time.monotonic() >= deadline:
                raise ServiceUnavailable(
                    f"this machine's books are set up at {path.parent}, but their service "
                    f"does not answer ({error.strerror or error}). `fluksio-nb machine status` "
                    "says more; the machine's admin restarts it with `fluksio-nb machine init`."
                ) from None
            time.sleep(0.1)
        except BaseException:
            sock.close()
            raise


def _hello(share_labels: bool) -> dict[str, Any]:
    from fluksio_nb.ledger.owner import identity

    me = identity()
    return {
        "op": "hello",
        "kernel_id": me.get("kernel_id"),
        "notebook": me.get("notebook"),
        "share_labels": share_labels,
    }


class _Lines:
    """Reading whole lines from a socket, no longer than the protocol allows."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def next(self) -> dict[str, Any] | None:
        while b"\n" not in self.buffer:
            if len(self.buffer) > protocol.MAX_LINE_BYTES:
                raise ValueError("the service sent a line longer than the protocol allows")
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(raw)


def ask_once(path: Path, request: dict[str, Any], within: float = REACH_WITHIN_S) -> dict[str, Any]:
    """One request on a connection of its own: for the server and the terminal."""
    with connect(path, within) as sock:
        sock.sendall(protocol.line(_hello(False)) + protocol.line({**request, "id": 1}))
        lines = _Lines(sock)
        welcome = lines.next()
        if welcome is None or welcome.get("op") != "welcome":
            raise ServiceUnavailable(f"the books service at {path} refused: {welcome}")
        while True:
            message = lines.next()
            if message is None:
                raise ServiceUnavailable(f"the books service at {path} closed the connection")
            if message.get("id") == 1:
                return {**message, "welcome": welcome}


def read_snapshot(path: Path) -> dict[str, Any]:
    answer = ask_once(path, {"op": "snapshot"})
    return {**answer["snapshot"], "user": answer["welcome"]["user"], "books": "machine"}


def cancel_claim(path: Path, number: int, reason: str) -> bool:
    answer = ask_once(path, {"op": "cancel", "ticket": number, "reason": reason})
    if answer["op"] == "error":
        raise NotYours(answer["message"])
    return bool(answer.get("found"))


class ServiceQueue:
    """The kernel's accountant, keeping its books in the machine's service."""

    def __init__(self, path: Path, share_labels: bool = False) -> None:
        self.path = path
        self._share_labels = share_labels
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._ids = iter(range(1, 1 << 62))
        self._answers: dict[int, dict[str, Any] | None] = {}
        self._mine: dict[int, Ticket] = {}
        #: News of a ticket that came before the answer that named it was read.
        self._early: dict[int, dict[str, Any]] = {}
        #: Requests whose asker gave up (the stop button, mostly): a ticket
        #: that arrives for one is given straight back, never left held.
        self._abandoned: set[int] = set()
        #: The ticket the service numbered for each claim request, written by
        #: the reader thread as the answer arrives, and taken by the asker only
        #: once the ticket is its caller's. A KeyboardInterrupt may land between
        #: any two calls of the asking thread, never in the reader's: whatever
        #: it interrupts, the asker's cleanup finds the ticket here.
        self._ticket_of_request: dict[int, int] = {}
        self._sock: socket.socket | None = None
        self._closed = False
        #: What holds claims made here to their share, per resource, as
        #: :func:`fluksio_nb.kernel.enforcement_in_force` says: in every snapshot.
        self.enforcement: dict[str, Any] = {}
        self._attach()
        threading.Thread(target=self._read, name="fluksio-books", daemon=True).start()

    # -- the connection -----------------------------------------------------------

    def _attach(self) -> None:
        sock = connect(self.path)
        sock.sendall(protocol.line(_hello(self._share_labels)))
        lines = _Lines(sock)
        welcome = lines.next()
        if welcome is None or welcome.get("op") != "welcome":
            sock.close()
            raise ServiceUnavailable(f"the books service at {self.path} refused: {welcome}")
        sock.settimeout(None)
        inventory = welcome["inventory"]
        self.user, self.uid = welcome["user"], welcome["uid"]
        self.records_dir = Path(welcome["records"]) if welcome.get("records") else None
        self.admin = welcome["admin"]
        self.cap = Cap(**welcome["cap"]) if welcome.get("cap") else None
        cpus = max(1, inventory["cpus"])
        core_ids = inventory.get("core_ids") or []
        self.books = ResourceAccountant(
            cpus=cpus,
            gpus=inventory["gpu_ids"],
            ram_bytes=inventory["ram_bytes"],
            cores=core_ids if len(core_ids) == cpus else (),
        )
        self._sock, self._lines = sock, lines

    def _send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            sock = self._sock
            if sock is None:
                raise ServiceUnavailable(f"the books service at {self.path} went away")
            sock.sendall(protocol.line(message))

    def _ask(self, message: dict[str, Any], number: int | None = None) -> dict[str, Any]:
        """The service's answer to ``message``, sent as request ``number``.

        A claim's asker passes its own ``number``, and gives back the ticket
        :attr:`_ticket_of_request` holds for it if it fails after the answer.
        """
        number = next(self._ids) if number is None else number
        with self._cond:
            self._answers[number] = None
        try:
            self._send({**message, "id": number})
            deadline = time.monotonic() + ANSWER_WITHIN_S
            with self._cond:
                while self._answers.get(number) is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._sock is None:
                        raise ServiceUnavailable(
                            f"the books service at {self.path} did not answer within "
                            f"{ANSWER_WITHIN_S:g} s"
                        )
                    wait_on(self._cond, min(left, 0.25))
                return self._answers.pop(number)  # type: ignore[return-value]
        except BaseException:
            with self._cond:
                if (
                    self._answers.pop(number, None) is None
                    and number not in self._ticket_of_request
                ):
                    # Not answered yet: whatever the answer brings is given back.
                    self._abandoned.add(number)
            raise

    def _let_go_of(self, request: int) -> None:
        """Give back the ticket request ``request`` was answered with, if any: nobody holds it."""
        with self._cond:
            ticket = self._ticket_of_request.pop(request, None)
        if ticket is not None:
            self._let_go_of_ticket(ticket)

    def _let_go_of_ticket(self, number: int) -> None:
        with self._cond:
            self._mine.pop(number, None)
            self._give_back_unasked(number)

    def _own(self, request: int) -> None:
        """The ticket of request ``request`` is its caller's now: nothing to give back."""
        with self._cond:
            self._ticket_of_request.pop(request, None)

    def _read(self) -> None:
        while not self._closed:
            try:
                message = self._lines.next()
            except (OSError, ValueError):
                message = None
            if message is None:
                self._lost()
                continue
            self._heard(message)

    def _heard(self, message: dict[str, Any]) -> None:
        stop = None
        with self._cond:
            op = message.get("op")
            if message.get("id") in self._abandoned:
                self._abandoned.discard(message["id"])
                if op == "ticket":
                    self._give_back_unasked(message["ticket"])
            elif "id" in message and message["id"] in self._answers:
                self._answers[message["id"]] = message
                if op == "ticket":
                    self._ticket_of_request[message["id"]] = message["ticket"]
            elif op in ("granted", "stop") and message["ticket"] not in self._mine:
                self._early[message["ticket"]] = message
            elif op == "granted":
                ticket = self._mine[message["ticket"]]
                if ticket.allocation is None:
                    r = ticket.resources
                    ticket.allocation = Allocation(
                        cpus=r.cpus,
                        gpus=tuple(message["gpus"]),
                        ram_bytes=r.ram_bytes,
                        cores=tuple(message.get("cores", ())),
                    )
                    ticket.state, ticket.granted_at = "running", message["granted_at"]
            elif op == "stop":
                ticket = self._mine.get(message["ticket"])
                if ticket is not None and ticket.cancelled is None:
                    ticket.cancelled = message["reason"]
                    if ticket.state == "running":
                        stop = ticket.on_cancel
            self._cond.notify_all()
        if stop is not None:
            stop(message["reason"])

    def _give_back_unasked(self, number: int) -> None:
        """Release a ticket nobody waits for any more."""
        self._early.pop(number, None)
        with contextlib.suppress(ServiceUnavailable, OSError):
            self._send({"op": "release", "ticket": number})

    def _lost(self) -> None:
        """The service went away: reconnect, and put back what this kernel runs."""
        with self._send_lock, self._cond:
            if self._sock is not None:
                self._sock.close()
            self._sock = None
            self._cond.notify_all()
        while not self._closed:
            try:
                self._attach()
                break
            except (OSError, ServiceUnavailable):
                time.sleep(0.5)
        if self._closed:
            return
        threading.Thread(target=self._put_back, daemon=True).start()

    def _put_back(self) -> None:
        """After a restart: running claims written back if still free, waiting ones queued again."""
        with self._cond:
            # Numbered afresh by the new service: the old numbers may be given
            # to other claims of this kernel, so none of them is kept.
            mine = list(self._mine.values())
            self._mine.clear()
            self._early.clear()
        for ticket in mine:
            if ticket.state == "running" and ticket.allocation is not None:
                held = ticket.allocation
                request: dict[str, Any] = {
                    "op": "restore",
                    "label": ticket.label,
                    "cpus": held.cpus,
                    "gpus": list(held.gpus),
                    "ram_bytes": held.ram_bytes,
                    "cores": list(held.cores),
                }
            elif ticket.state == "waiting":
                r = ticket.resources
                need = {"cpus": r.cpus, "gpus": r.gpus, "ram_bytes": r.ram_bytes}
                request = {"op": "claim", "label": ticket.label, "need": need}
            else:
                continue
            asked = next(self._ids)
            try:
                answer = self._ask(request, asked)
            except ServiceUnavailable:
                return
            self._own(asked)
            if answer["op"] != "ticket":
                reason = "the machine's books service restarted, and what this claim held is taken"
                with self._cond:
                    ticket.cancelled = reason
                    self._cond.notify_all()
                if ticket.state == "running" and ticket.on_cancel is not None:
                    ticket.on_cancel(reason)
                continue
            with self._cond:
                if ticket.state == "done":
                    # Released while the service was away: nothing to hold.
                    self._give_back_unasked(answer["ticket"])
                    continue
                ticket.number = answer["ticket"]
                self._mine[ticket.number] = ticket
                if request["op"] == "claim" and "gpus" in answer:
                    self._heard({**answer, "op": "granted"})
                self._heard_early(ticket)

    def close(self) -> None:
        self._closed = True
        with self._send_lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                self._sock.close()
                self._sock = None

    # -- asking ---------------------------------------------------------------------

    def fit_to_machine(self, wanted: Resources) -> Resources:
        return fit_to_capacity(fit_to_cap(wanted, self.cap, self.user), self.books)

    def enqueue(self, wanted: Resources, label: str | None = None) -> Ticket:
        fitted = self.fit_to_machine(wanted)
        given = label or wanted.label
        need = {"cpus": fitted.cpus, "gpus": fitted.gpus, "ram_bytes": fitted.ram_bytes}
        asked = next(self._ids)
        ticket: Ticket | None = None
        try:
            with self._cond:
                # Held across the request so that a grant pushed right behind
                # the ticket finds the ticket to grant.
                answer = self._ask({"op": "claim", "need": need, "label": given or "claim"}, asked)
                if answer["op"] == "error":
                    raise ClaimTooLarge(f"{fitted.describe()}: {answer['message']}")
                number = answer["ticket"]
                ticket = Ticket(
                    number=number,
                    resources=fitted,
                    label=given or f"claim {number}",
                    since=answer["since"],
                )
                self._mine[number] = ticket
                if "gpus" in answer:
                    self._heard({**answer, "op": "granted"})
                self._heard_early(ticket)
            self._own(asked)
        except BaseException:
            # The stop button, between the service's ticket and the caller's:
            # nobody would ever release it.
            if ticket is not None:
                self._let_go_of_ticket(ticket.number)
            self._let_go_of(asked)
            raise
        # Nothing from here to the caller's assignment can be interrupted:
        # CPython runs a signal's handler as a call ends or a loop jumps back,
        # and there is neither.
        return ticket

    def _heard_early(self, ticket: Ticket) -> None:
        """A grant that arrived before the ticket was known. Lock held."""
        early = self._early.pop(ticket.number, None)
        if early is not None:
            self._heard(early)

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Allocation:
        return wait_for_grant(self._cond, ticket, timeout, self.timeout_message)

    def release(self, ticket: Ticket) -> None:
        with self._cond:
            known = self._mine.pop(ticket.number, None)
        ticket.state = "done"
        if known is None:
            return
        # Sent, not asked: the service reads this connection in order, so
        # whatever this kernel asks next already sees the share given back.
        with contextlib.suppress(ServiceUnavailable, OSError):
            self._send({"op": "release", "ticket": ticket.number})

    def cancel(self, number: int, reason: str = "cancelled by the user") -> bool:
        answer = self._ask({"op": "cancel", "ticket": number, "reason": reason})
        if answer["op"] == "error":
            raise NotYours(answer["message"])
        return bool(answer.get("found"))

    def report(self, ticket: Ticket, readings: dict[str, Any]) -> None:
        with contextlib.suppress(ServiceUnavailable, OSError):
            self._send({"op": "report", "ticket": ticket.number, "readings": readings})

    def look(self) -> None:
        """Nothing to look for: the service says what changes as it changes."""

    # -- what is going on -------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        answer = self._ask({"op": "snapshot"})
        return {
            **answer["snapshot"],
            "user": self.user,
            "books": "machine",
            "enforcement": self.enforcement,
        }

    def position(self, ticket: Ticket) -> int | None:
        for claim in self.snapshot()["waiting"]:
            if claim["ticket"] == ticket.number:
                return claim["position"]
        return None

    def holders(self) -> list[Ticket]:
        holders = []
        for claim in self.snapshot()["running"]:
            held = claim["allocation"]
            holders.append(
                Ticket(
                    number=claim["ticket"],
                    resources=Resources(cpus=max(1, held["cpus"]), gpus=len(held["gpus"])),
                    label=claim["label"] or f"a claim of {claim['user']}",
                    since=claim["since"],
                    pid=claim["pid"],
                    state="running",
                    allocation=Allocation.from_dict(held),
                )
            )
        return holders

    def timeout_message(self, ticket: Ticket, timeout: float | None) -> str:
        return timeout_message(ticket, timeout, self.holders())


def fit_to_cap(wanted: Resources, cap: Cap | None, user: str) -> Resources:
    """The claim shrunk to what its user may hold, or refused if strict; says which cap."""
    if cap is None:
        return wanted
    limits = {"cpus": cap.cpus, "gpus": cap.gpus, "ram": cap.ram_bytes}
    over = {
        name: limit
        for name, limit in limits.items()
        if limit is not None and (getattr(wanted, name) or 0) > limit
    }
    if not over:
        return wanted
    from fluksio_nb.budget import human

    said = " ".join(
        f"{name}={human(limit) if name == 'ram' else limit}" for name, limit in over.items()
    )
    where = f"the cap this machine's admin set for {user} ({said})"
    if wanted.strict:
        raise ClaimTooLarge(
            f"{wanted.describe()} asks for more than {where}; ask for less, or drop "
            "--strict to be given what the cap allows"
        )
    shrunk = Resources(**{**wanted.model_dump(exclude_unset=True), **over})
    warn_at_users_line(
        f"{wanted.describe()} is more than {where}; running with {shrunk.describe()} instead. "
        "Add --strict to refuse instead.",
        ClampedWarning,
    )
    return shrunk
