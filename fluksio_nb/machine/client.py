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
- **An asker reads its own answer.** The thread that sent a request reads
  the connection until the answer is there, hearing whatever else arrives
  on the way, rather than sleeping until the reader thread wakes it: two
  threads woken for every claim were most of what a claim cost on a busy
  machine. The reader thread watches the connection only while this
  kernel has something to hear of, and steps aside for askers.
- **A service that restarts loses nothing.** The reader reconnects, writes
  this kernel's running claims back, each with the secret its grant came
  with, which only this kernel was told (:mod:`.ownership`; one not taken
  back is stopped, with the reason), and queues its waiting claims again.
- **The lifeline carries only this kernel's claims.** A snapshot of the
  machine, whose size other users' claims decide, is asked for on a
  connection of its own: whatever comes back, it cannot break the one
  that holds the claims.

It is long because one connection is read by whichever thread needs it now
(an asker, or the reader thread that watches for grants and stops), and
handing it between them, reconnecting and putting claims back after a
restart are one piece of state that cannot be split without a lock between
the halves.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.errors import BooksDisagree, ClaimTooLarge, NotYours, ServiceUnavailable
from fluksio_nb.machine import protocol
from fluksio_nb.machine.caps import Cap, fit_to_cap
from fluksio_nb.machine.connection import (
    ANSWER_WITHIN_S,
    REACH_WITHIN_S,
    Lines,
    ServiceAt,
)
from fluksio_nb.machine.ownership import Ownership
from fluksio_nb.machine.seen import Seen
from fluksio_nb.queue import (
    Ticket,
    fit_to_capacity,
    wait_for_grant,
    wait_on,
)
from fluksio_nb.resources import Resources
from fluksio_nb.stop_button import stop_held_back

#: How long a claim granted on the spot has run before the reader thread
#: starts watching the connection for news of it: a stop, or the service
#: going away. A cell's claim and give-back come microseconds apart far more
#: often than a claim is stopped in its first moment, and watching each at
#: once woke a thread for every claim.
WATCH_AFTER_S = 0.05
#: The longest an asker reads without looking up: how late the stop button
#: lands while the service is slow to answer.
READ_SLICE_S = 0.25
#: How long an asker keeps reading for its answer before it sleeps. The
#: service answers in about a tenth of a millisecond; an asker put to sleep
#: meanwhile waits for the scheduler to give it a core back, which on a
#: machine whose every core is busy took milliseconds (16 kernels claiming
#: at once on two cores: a median of 1.2-2.0 ms sleeping at once, 0.4 ms
#: reading this long first).
SPIN_S = 150e-6
#: How long an abandoned request's number is kept past the wait for its
#: answer, for an answer later than that still to be given back.
_FORGET_ABANDONED_S = 60.0


class ServiceQueue(Ownership, Seen):
    """The kernel's accountant, keeping its books in the machine's service."""

    def __init__(self, at: ServiceAt | Path, share_labels: bool = False) -> None:
        #: The service, and how it is reached: the machine's, or the user's own.
        self.at = at if isinstance(at, ServiceAt) else ServiceAt(at)
        self.path = self.at.socket
        self._share_labels = share_labels
        #: Taken with ``with self._lock``, never ``with self._cond``: a stop
        #: landing as ``Condition.__enter__``, which is Python, returns leaves
        #: the lock held by nobody's ``with``, and the reader thread waits on
        #: it for ever. The lock's own ``__enter__`` is C, with no moment
        #: between taking the lock and the block that would let it go.
        self._lock = lock = threading.RLock()
        self._cond = threading.Condition(lock)
        #: What the reader thread sleeps on, under the same lock: woken only
        #: when it has something to do, not by every line it would hear.
        self._reader_wakes = threading.Condition(lock)
        self._send_lock = threading.Lock()
        self._ids = iter(range(1, 1 << 62))
        self._answers: dict[int, dict[str, Any] | None] = {}
        self._mine: dict[int, Ticket] = {}
        #: This kernel's claims on a connection that broke, for the new one
        #: to put back: kept apart from ``_mine``, where claims made on the
        #: new connection go, so that none is put back twice.
        self._held_over: list[Ticket] = []
        self._init_ownership()
        #: News of a ticket that came before the answer that named it was read.
        self._early: dict[int, dict[str, Any]] = {}
        #: Requests whose asker gave up (the stop button, mostly): a ticket
        #: that arrives for one is given straight back, never left held.
        #: It is read for, by the reader thread if nobody asks, until its
        #: answer has had time to come: until when, for each.
        self._abandoned: dict[int, float] = {}
        #: The ticket the service numbered for each claim request, written as
        #: the answer is read, and taken by the asker only once the ticket is
        #: its caller's. A KeyboardInterrupt may land between any two calls of
        #: the asking thread, never while a line is read (the stop is held
        #: back then): whatever it interrupts, the asker's cleanup finds the
        #: ticket here.
        self._ticket_of_request: dict[int, int] = {}
        self._sock: socket.socket | None = None
        self._closed = False
        #: Held by whichever thread reads the connection now: an asker, or
        #: the reader thread while it watches.
        self._reading = threading.Lock()
        #: Threads that read, or wait to read, for their own answers: when
        #: each will have given up. The reader thread stands aside for them,
        #: so a place left behind would keep this kernel from hearing its
        #: grants; :meth:`_ask` leaves none, and one left by anything it did
        #: not foresee is past its time within seconds, not there for ever.
        self._askers: dict[object, float] = {}
        #: The reader thread's states, which say who has to wake it.
        self._watching = self._asleep = self._stepped_aside = False
        #: Claims asked for so far: a reader thread that saw none made since
        #: its last look sleeps until the next.
        self._made = 0
        #: Written to move the watching reader thread out of its poll.
        self._nudge_out, self._nudge_in = os.pipe()
        os.set_blocking(self._nudge_in, False)
        os.set_blocking(self._nudge_out, False)
        #: What holds claims made here to their share, per resource, as
        #: :func:`fluksio_nb.kernel.enforcement_in_force` says: in every snapshot.
        self.enforcement: dict[str, Any] = {}
        self._attach()
        threading.Thread(target=self._read, name="fluksio-books", daemon=True).start()

    # -- the connection -----------------------------------------------------------

    def _attach(self) -> None:
        deadline = time.monotonic() + REACH_WITHIN_S
        while True:
            sock = self.at.reach()
            try:
                sock.sendall(protocol.line(self.at.hello(self._share_labels)))
                lines = Lines(sock)
                welcome = lines.next()
            except OSError:
                welcome = None
            if welcome is not None or time.monotonic() > deadline:
                break
            # Closed as it answered: a user's own service ending the moment
            # this kernel came. Reached again, it is started anew.
            sock.close()
        if welcome is None or welcome.get("op") != "welcome":
            sock.close()
            if welcome is not None and welcome.get("about") == "machine":
                raise BooksDisagree(str(welcome.get("message")))
            raise ServiceUnavailable(f"the books service at {self.path} refused: {welcome}")
        sock.settimeout(None)
        inventory = welcome["inventory"]
        self.user, self.uid = welcome["user"], welcome["uid"]
        self.records_dir = Path(welcome["records"]) if welcome.get("records") else None
        self.admin = welcome["admin"]
        self.hears_endings = bool(welcome.get("hears_endings"))
        self.cap = Cap.welcomed(welcome)
        cpus = max(1, inventory["cpus"])
        core_ids = inventory.get("core_ids") or []
        self.books = ResourceAccountant(
            cpus=cpus,
            gpus=inventory["gpu_ids"],
            ram_bytes=inventory["ram_bytes"],
            cores=core_ids if len(core_ids) == cpus else (),
        )
        with self._lock:
            self._lines, self._sock = lines, sock
            # A claim waiting out a restart is sent the moment this is here.
            self._cond.notify_all()

    def _send(self, message: dict[str, Any]) -> socket.socket:
        """Send ``message``; the connection it went on."""
        with self._send_lock:
            sock = self._sock
            if sock is None:
                raise ServiceUnavailable(self.at.not_answering("its connection closed"))
            try:
                sock.sendall(protocol.line(message))
                return sock
            except OSError as error:
                why = error.strerror or str(error)
        # The service went away while nothing was held (a restart, say), so
        # nobody was watching the connection: dropped here, or every request
        # after this one would fail on it too, for as long as the kernel lives.
        self._drop(sock)
        raise ServiceUnavailable(self.at.not_answering(why))

    def _send_once_connected(self, message: dict[str, Any]) -> socket.socket:
        """Send ``message``, waiting out a service that restarts as a new connection would."""
        deadline = time.monotonic() + REACH_WITHIN_S
        while True:
            try:
                return self._send(message)
            except ServiceUnavailable:
                with self._lock:
                    while self._sock is None and not self._closed:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        wait_on(self._cond, left)
                    if self._sock is None or time.monotonic() >= deadline:
                        raise

    def _ask(
        self, message: dict[str, Any], number: int | None = None, *, anew: bool = False
    ) -> dict[str, Any]:
        """The service's answer to ``message``, sent as request ``number``.

        A claim's asker passes its own ``number``, and gives back the ticket
        :attr:`_ticket_of_request` holds for it if it fails after the answer.
        With ``anew``, a request the service went away without answering is
        sent again once the reader thread has reconnected: safe for a new
        claim, whose grant, if any, went with the connection that held it.
        """
        number = next(self._ids) if number is None else number
        place = object()
        with self._lock:
            self._answers[number] = None
        try:
            send = self._send_once_connected if anew else self._send
            sent_on = send({**message, "id": number})
            deadline = time.monotonic() + ANSWER_WITHIN_S
            # Taken and given up in line, not in functions of their own: Python
            # runs a signal's handler as a function starts and as a call
            # returns, so a stop could land in such a function before it took
            # or gave up the place, and the reader thread would stand aside for
            # an asker that is gone. Here the place is in the books by the time
            # any call returns, and out of them before one starts.
            with self._lock:
                # Given up by then, at the latest: the answer's wait and a read slice.
                self._askers[place] = deadline + 2 * READ_SLICE_S
                if self._watching:
                    self._nudge()
            # Never with the condition held: the reader thread hears what it
            # read under the condition before it lets go of the connection.
            with self._reading:
                while True:
                    with self._lock:
                        answer = self._answers.get(number)
                        if answer is not None:
                            del self._answers[number]
                            return answer
                        # Replaced already, too, by a reader thread quick to reconnect.
                        went_away = self._sock is not sent_on
                    if went_away and anew:
                        sent_on = send({**message, "id": number})
                    elif went_away:
                        raise ServiceUnavailable(self.at.not_answering("its connection closed"))
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ServiceUnavailable(
                            f"the books service at {self.path} did not answer within "
                            f"{ANSWER_WITHIN_S:g} s"
                        )
                    # Held back while a line is read and heard: a stop landing
                    # halfway would lose the line. It lands once the slice ends.
                    with stop_held_back():
                        self._hear_what_is_there(min(left, READ_SLICE_S))
        except BaseException:
            with self._lock:
                if (
                    self._answers.pop(number, None) is None
                    and number not in self._ticket_of_request
                ):
                    # Not answered yet: whatever the answer brings is given back.
                    self._abandoned[number] = time.monotonic() + ANSWER_WITHIN_S
                    self._reader_wakes.notify()
            raise
        finally:
            with self._lock:
                self._askers.pop(place, None)
                if not self._askers and self._stepped_aside:
                    self._reader_wakes.notify()

    def _asked(self) -> float | None:
        """Until when an asker may want the connection; None if none does. Lock held.

        A place past its time was left behind by a stop, not given up.
        """
        return _latest_to_come(self._askers, forget_after=0.0)

    def _hear_what_is_there(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the connection, and hear every line on it.

        Only the thread holding :attr:`_reading` calls this. An asker reads
        for :data:`SPIN_S` before it sleeps. A connection that ends, or sends
        what is not the protocol, is dropped, and the reader thread makes a
        new one.
        """
        lines = self._lines
        sock = lines.sock
        if sock is not self._sock:
            return  # dropped, or being replaced: the reader thread reconnects
        spin_until = time.perf_counter() + (SPIN_S if wait_s else 0.0)
        messages = self._read_ready(lines)
        while messages == [] and time.perf_counter() < spin_until:
            messages = self._read_ready(lines)
        if messages == []:
            # poll, not select: a kernel may hold more descriptors than select takes.
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            if not poller.poll(wait_s * 1000):
                return
            messages = self._read_ready(lines)
        for message in messages or ():
            self._heard(message)

    def _read_ready(self, lines: Lines) -> list[dict[str, Any]] | None:
        """The whole lines there are now; ``None`` once the connection is dropped."""
        try:
            messages = lines.ready()
        except (OSError, ValueError):
            messages = None
        if messages is None:
            self._drop(lines.sock)
        return messages

    def _nudge(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._nudge_in, b"!")

    def _let_go_of(self, request: int) -> None:
        """Give back the ticket request ``request`` was answered with, if any: nobody holds it."""
        with self._lock:
            ticket = self._ticket_of_request.pop(request, None)
        if ticket is not None:
            self._let_go_of_ticket(ticket)

    def _let_go_of_ticket(self, number: int) -> None:
        with self._lock:
            self._mine.pop(number, None)
            self._forget_secret(number)
            self._give_back_unasked(number)

    def _own(self, request: int) -> None:
        """The ticket of request ``request`` is its caller's now: nothing to give back."""
        with self._lock:
            self._ticket_of_request.pop(request, None)

    # -- the reader thread ----------------------------------------------------------

    def _read(self) -> None:
        """Hear the service's news of this kernel's claims while nobody asks.

        It watches only while there is something to hear: a claim waiting
        for its grant, or one that has run :data:`WATCH_AFTER_S`. Otherwise
        it sleeps, and wakes only as often as that while claims come and go,
        and not at all while nothing is held.
        """
        looked_at: set[int] = set()
        made = -1
        while True:
            with self._lock:
                if self._closed:
                    os.close(self._nudge_in)
                    os.close(self._nudge_out)
                    return
                if self._sock is not None:
                    if (until := self._asked()) is not None:
                        self._stepped_aside = True
                        self._reader_wakes.wait(until - time.monotonic())
                        self._stepped_aside = False
                        continue
                    held = set(self._mine)
                    if not self._worth_watching(held & looked_at):
                        # Asleep for good only once a look found nothing held
                        # and no claim made since the last: enqueue wakes it.
                        self._asleep = not held and made == self._made
                        looked_at, made = held, self._made
                        self._reader_wakes.wait(None if self._asleep else WATCH_AFTER_S)
                        self._asleep = False
                        continue
                    self._watching = True
            if self._sock is None:
                self._reconnect()
                looked_at = set()
                continue
            try:
                self._watch()
            finally:
                with self._lock:
                    self._watching = False

    def _worth_watching(self, held_a_while: set[int]) -> bool:
        """Whether the connection may bring news a thread waits for. Condition held."""
        return (
            bool(held_a_while)
            or any(ticket.state == "waiting" for ticket in self._mine.values())
            or self._awaited() is not None
        )

    def _awaited(self) -> float | None:
        """Until when an abandoned request's answer may still come; None if none may. Lock held.

        Its answer may be a ticket, held until it is read and given back,
        with others waiting for it: read for it, though nobody asks. A
        request abandoned before it went (the stop landed first) has no
        answer to come; it is forgotten a while after.
        """
        return _latest_to_come(self._abandoned, forget_after=_FORGET_ABANDONED_S)

    def _watch(self) -> None:
        """Hear what comes until an asker wants the connection or nothing is held."""
        with self._reading:
            with self._lock:
                sock, nudged = self._sock, self._nudge_out
            if sock is None:
                return
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            poller.register(nudged, select.POLLIN)
            while True:
                with self._lock:
                    awaited = None if self._mine else self._awaited()
                    if (
                        self._asked() is not None
                        or self._closed
                        or self._sock is not sock
                        or not (self._mine or awaited)
                    ):
                        return
                left = None if awaited is None else max(0, awaited - time.monotonic())
                ready = dict(poller.poll(None if left is None else left * 1000))
                if nudged in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.read(nudged, 4096)
                if sock.fileno() in ready:
                    self._hear_what_is_there(0)

    def _drop(self, sock: socket.socket) -> None:
        """The connection ended or went wrong: the reader thread makes a new one."""
        with self._lock:
            if self._sock is not sock:
                return
            self._sock = None
            # Numbered by the service that went away: none of them is kept.
            self._held_over.extend(self._mine.values())
            self._mine.clear()
            self._early.clear()
            self._cond.notify_all()
            self._reader_wakes.notify()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with self._send_lock:
            sock.close()

    def _reconnect(self) -> None:
        """The service went away: reconnect, and put back what this kernel runs."""
        while not self._closed:
            try:
                self._attach()
                break
            except (OSError, ServiceUnavailable):
                time.sleep(0.5)
        if self._closed:
            return
        threading.Thread(target=self._put_back, daemon=True).start()

    def _heard(self, message: dict[str, Any]) -> None:
        stop = warn = None
        with self._lock:
            op = message.get("op")
            if message.get("id") in self._abandoned:
                del self._abandoned[message["id"]]
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
                self._keep_secret(message)
                if ticket.allocation is None:
                    r = ticket.resources
                    ticket.allocation = Allocation(
                        cpus=r.cpus,
                        gpus=tuple(message["gpus"]),
                        ram_bytes=r.ram_bytes,
                        cores=tuple(message.get("cores", ())),
                        gpu_bytes=int(message.get("gpu_bytes") or 0),
                    )
                    ticket.state, ticket.granted_at = "running", message["granted_at"]
            elif op == "stop":
                ticket = self._mine.get(message["ticket"])
                if ticket is not None and ticket.cancelled is None:
                    ticket.cancelled = message["reason"]
                    ending = message.get("ending")
                    ticket.ended_as = ending if isinstance(ending, str) else None
                    if ticket.state == "running":
                        stop = ticket.on_cancel
            elif op == "warning":
                ticket = self._mine.get(message["ticket"])
                if ticket is not None and ticket.state == "running":
                    # A withdrawn warning is still said in the cell, and shown no more.
                    ticket.warning = None if message.get("cleared") else message["message"]
                    warn = ticket.on_warning
            self._cond.notify_all()
        if stop is not None:
            stop(message["reason"])
        if warn is not None:
            warn(message["message"])

    def _give_back_unasked(self, number: int) -> None:
        """Release a ticket nobody waits for any more."""
        self._early.pop(number, None)
        with contextlib.suppress(ServiceUnavailable, OSError):
            self._send({"op": "release", "ticket": number})

    def holds_nothing(self) -> bool:
        """Whether no claim of this kernel's, running or waiting, is in these books."""
        with self._lock:
            return not self._mine and not self._held_over

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._cond.notify_all()
            self._reader_wakes.notify()
            if self._watching:
                self._nudge()
        with self._send_lock:
            # Taken once: the reader thread may be dropping it at this moment.
            sock, self._sock = self._sock, None
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    # -- asking ---------------------------------------------------------------------

    def fit_to_machine(self, wanted: Resources) -> Resources:
        return fit_to_capacity(fit_to_cap(wanted, self.cap, self.user), self.books)

    def enqueue(self, wanted: Resources, label: str | None = None) -> Ticket:
        fitted = self.fit_to_machine(wanted)
        given = label or wanted.label
        need = protocol.need_said(fitted.cpus, fitted.card_ask, fitted.ram_bytes)
        asked = next(self._ids)
        ticket: Ticket | None = None
        try:
            answer = self._ask(
                {"op": "claim", "need": need, "label": given or "claim"}, asked, anew=True
            )
            if answer["op"] == "error":
                raise ClaimTooLarge(f"{fitted.describe()}: {answer['message']}")
            with self._lock:
                number = answer["ticket"]
                ticket = Ticket(
                    number=number,
                    resources=fitted,
                    label=given or f"claim {number}",
                    since=answer["since"],
                )
                self._mine[number] = ticket
                self._made += 1
                if "gpus" in answer:
                    self._heard({**answer, "op": "granted"})
                # A grant or a stop that came before the ticket was known
                # (read with the answer, or by the reader thread) is heard now.
                self._heard_early(ticket)
                if self._asleep or ticket.state == "waiting":
                    self._reader_wakes.notify()
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
        return wait_for_grant(self._lock, self._cond, ticket, timeout, self.timeout_message)

    def release(self, ticket: Ticket, ending: str | None = None) -> None:
        """Give the share back; ``ending`` says how the claim ended, for the service's metrics."""
        with self._lock:
            known = self._mine.pop(ticket.number, None)
            self._forget_secret(ticket.number)
            # Under the lock: a restart's put-back checks it there, and a
            # claim released while it looked would be held for ever.
            ticket.state = "done"
        if known is None:
            return
        # Sent, not asked: the service reads this connection in order, so
        # whatever this kernel asks next already sees the share given back.
        said = {"ending": ending} if ending is not None and self.hears_endings else {}
        with contextlib.suppress(ServiceUnavailable, OSError):
            self._send({"op": "release", "ticket": ticket.number, **said})

    def cancel(self, number: int, reason: str = "cancelled by the user") -> bool:
        try:
            answer = self._ask({"op": "cancel", "ticket": number, "reason": reason})
        except ServiceUnavailable:
            # This kernel's own claim is stopped here, as the service's stop
            # would: a service that is down or taken away must not leave the
            # user unable to end their own work.
            if not self._stop_here(number, reason):
                raise
            return True
        if answer["op"] == "error":
            raise NotYours(answer["message"])
        return bool(answer.get("found"))

    def _stop_here(self, number: int, reason: str) -> bool:
        """Stop claim ``number`` if it is this kernel's, without the service; whether it is."""
        stop = None
        with self._lock:
            ticket = self._mine.get(number) or next(
                (held for held in self._held_over if held.number == number), None
            )
            if ticket is None:
                return False
            if ticket.cancelled is None:
                ticket.cancelled = reason
                if ticket.state == "running":
                    stop = ticket.on_cancel
            self._cond.notify_all()
        if stop is not None:
            stop(reason)
        return True

    def report(self, ticket: Ticket, readings: dict[str, Any]) -> None:
        with contextlib.suppress(ServiceUnavailable, OSError):
            self._send({"op": "report", "ticket": ticket.number, "readings": readings})

    def look(self) -> None:
        """Nothing to look for: the service says what changes as it changes."""


def _latest_to_come(deadlines: dict[Any, float], forget_after: float) -> float | None:
    """The latest of ``deadlines`` still to come; ``None`` if none is.

    Those past by more than ``forget_after`` seconds are dropped from it.
    """
    now = time.monotonic()
    for key, until in list(deadlines.items()):
        if until + forget_after <= now:
            del deadlines[key]
    return max((until for until in deadlines.values() if until > now), default=None)
