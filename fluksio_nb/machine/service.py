"""The machine's books service: one root process every user's kernels talk to.

It holds the books in memory and answers over a Unix socket in the machine's
run directory. Who is asking is what the kernel says ``SO_PEERCRED`` is; a
claim lives exactly as long as the connection that made it, so a kernel
killed by anything gives its share back the moment the kernel closes its
socket, without anybody having to notice.

What it decides:

- **It never waits for a client, and shares its time.** One asyncio loop;
  every write is buffered, and a client that stops reading is answered no
  more, then disconnected (which frees only its own claims). Lines are
  answered in turns between people, in bounded buffers, with connections
  limited per user and in all (:mod:`~fluksio_nb.machine.turns`). A client
  stopped with ``SIGSTOP`` stalls nobody but itself.
- **No request costs time in proportion to what one user queued.** A
  snapshot is made once per change of the books for each reader who asks
  (:meth:`BooksService.snapshot_line`), and lists a bounded part of the
  queue; counting and granting never walk a user's whole queue
  (:mod:`~fluksio_nb.machine.books`).
- **A line that does not parse ends its connection**, and nothing else.
  Every request is validated (:mod:`~fluksio_nb.machine.protocol`) before
  anything reads it.
- **Only the owner cancels**, or a member of the admin group the machine's
  config names; the owner's kernel is told who stopped it. A running claim
  still held :data:`~fluksio_nb.machine.revoke.STOP_GRACE_S` later is ended
  by the service: it kills the claim's processes it can verify are the
  owner's, and frees the share whatever the kernel does (:mod:`.revoke`).
- **Only the owner puts a share back after a restart**: each grant comes
  with a secret for the owner's kernel alone, and the service writes down
  in root's private state whose each running claim is and what it holds;
  a restore that does not match one in every part is refused. Ticket
  numbers are never given out twice, across restarts (:mod:`.state`).
- **Limits per user**: connections, unfinished lines and waiting claims,
  so one user cannot grow the service's memory for everyone; and what it
  refused is said in the log every few seconds, never line by line.
- **Every claim it saw end is written down**, as it saw it: who, what it
  granted, when it was asked for, granted and given back, into a file of
  root's per user (:mod:`~fluksio_nb.machine.accounts`), which root's
  usage report counts claims from. A connection the kernel closed with
  claims still held or waiting (it gave none of them back: it was killed)
  has each recorded ending :data:`~fluksio_nb.records.KERNEL_DIED`; what
  only the kernel knew (peak memory) stays unknown. A connection the
  service closed (a client that stopped reading, a bad line, the service
  stopping for a restart) leaves none: its kernel lives, and ends and
  records its claims itself.
- **Each user may read the records of their own killed kernels**, and no
  one else's: root's file is private, so the service reads it for them
  (``kernel_deaths``), the newest :data:`DEATHS_ANSWERED` at most. Reading
  takes the GIL from the loop that answers claims, so it is done on a
  thread, for one asker at a time, and busy at most a tenth of the time
  (:data:`DEATHS_DUTY`): nobody can slow everyone's claims by asking again
  and again.
- **Idle cards are given back where the admin asks** (``idle_card_minutes``):
  a claim whose cards sat idle while another claim waits for one is warned,
  then ended (:mod:`.idle_cards`, which runs on this loop).

It is long because every request is answered here, each in a few lines,
against the one set of books; what takes more deciding has a module of its
own (:mod:`.turns`, :mod:`.revoke`, :mod:`.restarts`, :mod:`.idle_cards`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import grp
import logging
import math
import os
import pwd
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from fluksio_nb.card_slices import CardAsk, Slice
from fluksio_nb.machine import protocol, turns
from fluksio_nb.machine.accounts import BooksAccounts
from fluksio_nb.machine.books import Entry, MachineBooks
from fluksio_nb.machine.caps import Cap
from fluksio_nb.machine.cards_as_they_are import (
    meet_the_cards,
    say_why_waiting,
    watch_cards_as_they_are,
)
from fluksio_nb.machine.idle_cards import IdlePolicy, watch_idle_cards
from fluksio_nb.machine.restarts import RESTORE_GRACE_S, AcrossRestarts
from fluksio_nb.machine.revoke import MOST_PIDS, Stopping
from fluksio_nb.machine.state import HeldClaim, ServiceState
from fluksio_nb.machine.time_limits import TimeLimits
from fluksio_nb.machine.turns import MAX_CONNECTIONS_PER_USER, Connection, connection_limits
from fluksio_nb.records import KERNEL_DIED, UsageRecord

if TYPE_CHECKING:
    from fluksio_nb.gpu_usage import CardReader
    from fluksio_nb.metrics import Tally

__all__ = ["MAX_CONNECTIONS_PER_USER", "BooksService", "Connection", "serve"]

log = logging.getLogger("fluksio_nb.machine")

#: How a claim ended, as the service saw it: its kernel gave it back, or it
#: was cancelled while it waited. How the cell ended is the kernel's to say.
RELEASED = "released"
CANCELLED = "cancelled"
#: Left in the run directory by a service that stopped while claims were held.
CLAIMS_HELD_NAME = "claims-held"

#: The most waiting claims one user may have. Far above what a person's
#: notebooks make, and low enough that the service's memory is bounded.
MAX_WAITING_PER_USER = 4096
#: The most records of a user's killed kernels one answer holds: some 300 KB,
#: well inside a line.
DEATHS_ANSWERED = 1000
#: The most of the service's time reading those records may take.
DEATHS_DUTY = 0.1

#: How the service reads its records for one user: ``(directory, uid, since,
#: most)`` to the newest records and how many more there were. Given by the
#: caller, which may import the reader (:func:`fluksio_nb.usage.read.kernel_deaths`).
DeathsReader = Callable[[Path, int, float | None, int], tuple[list[UsageRecord], int]]


def in_group(uid: int, group: str | None) -> bool:
    """Whether user ``uid`` is a member of ``group``, primary or supplementary."""
    if not group:
        return False
    try:
        gid = grp.getgrnam(group).gr_gid
        entry = pwd.getpwuid(uid)
    except KeyError:
        return False
    return gid in os.getgrouplist(entry.pw_name, entry.pw_gid)


class BooksService(AcrossRestarts, Stopping):
    """The books plus the connections that hold claims in them."""

    def __init__(
        self,
        books: MachineBooks,
        *,
        caps: dict[str, Cap] | None = None,
        admin_group: str | None = None,
        records: str | None = None,
        read_deaths: DeathsReader | None = None,
        accounts: BooksAccounts | None = None,
        state: ServiceState | None = None,
        cards: CardReader | None = None,
        idle_cards: IdlePolicy | None = None,
    ) -> None:
        self.books = books
        #: The machine's cards as the driver reads them, where a card source exists.
        self.cards = cards
        #: The admin's ``idle_card_minutes``, if set (:mod:`.idle_cards`).
        self.idle_cards = idle_cards
        #: The claims that ended, and the waits, as the metrics count them.
        # Not at the top: kernels import this module, and serve no metrics.
        from fluksio_nb.metrics import KeptText, Tally

        self.tally: Tally = Tally()
        self.metrics_kept = KeptText()
        #: Where the running claims are written down for the next service, if anywhere.
        self.state = state
        #: What the service before this one wrote down: the only restores taken.
        self.held_before: dict[int, HeldClaim] = {}
        self._state_due = self._state_frozen = False
        #: Where each claim that ends is written down, a file per user.
        self.accounts = accounts or (BooksAccounts(Path(records)) if records else None)
        self.cap_by_name = caps or {}
        self.admin_group = admin_group
        self.records = records
        self.read_deaths = read_deaths
        self.connections: set[Connection] = set()
        #: Who may connect: each user's connections, and everyone's, counted.
        self.admission = turns.Admission(self.connections)
        #: Each user's bytes of lines not ended yet, over their connections.
        self.unfinished: dict[int, int] = {}
        self.turns = turns.Turns()
        self.refusals = turns.RefusalLog()
        #: Each reader's snapshot line, for the books as they were at ``_snapshots_of``.
        self._snapshots: dict[tuple[int, bool], bytes] = {}
        self._snapshots_of = -1
        self._giving_back = False
        self._granting_from = 0.0
        #: When, on the loop's clock, the next read of killed kernels' records may start.
        self._deaths_free_at = 0.0
        #: Set to end :func:`serve`: by a signal, or by the service itself.
        self.stop: asyncio.Event | None = None
        #: Each running claim's warning and end at its user's ``max_hours``.
        self.time_limits = TimeLimits(self)

    def cap_for(self, user: str) -> Cap | None:
        return self.cap_by_name.get(user) or self.cap_by_name.get("*")

    # -- a connection's life ----------------------------------------------------

    def arrived(self, connection: Connection) -> None:
        """A new connection, counted, or refused in a line that says why and what to do."""
        if self.admission.admits(connection):
            self.connections.add(connection)

    def heard(self, connection: Connection, line: bytes) -> None:
        """One line from a connection: its hello first, then requests."""
        try:
            if connection.hello is None:
                connection.hello = protocol.read_hello(line)
                connection.admin = in_group(connection.uid, self.admin_group)
                refused = self.refuses(connection)
                if refused is not None:
                    connection.refuse(refused, "another machine described", about="machine")
                    return
                cap = self.cap_for(connection.user)
                if cap is not None:
                    self.books.caps[connection.uid] = cap
                connection.send(self.welcome(connection))
            else:
                self.answer(connection, protocol.read_request(line))
        except ValidationError as error:
            connection.refuse(f"bad request: {error}", "a request that does not parse")

    def refuses(self, connection: Connection) -> str | None:
        """Why the service will not take this connection, given its hello; ``None`` if it will.

        The machine's takes every user its socket lets in; a user's own
        service refuses a kernel that describes another machine (``machine``,
        the refusal says).
        """
        return None

    def left(self, connection: Connection) -> None:
        """A connection closed: whatever it held or waited for is free for everyone."""
        if connection.turned_away:
            return
        self.connections.discard(connection)
        self.admission.left(connection)
        if not self._giving_back:
            # Once for however many go together: a flood's end, mostly.
            self._giving_back = True
            asyncio.get_running_loop().call_later(turns.GIVE_BACK_AFTER_S, self._give_back)
        ended_at = time.time()
        for number in list(connection.entries):
            entry = self.books.remove(number)
            self.time_limits.forget(number)
            # Its kernel released every claim it ended, before recording it:
            # the lines before its end are read before the end is. What is
            # left, it never will.
            if entry is not None and not connection.dropped:
                self.record_end(entry, ended_at, KERNEL_DIED)
        connection.entries.clear()
        self.note_held()
        self.dispatch()

    def _give_back(self) -> None:
        self._giving_back = False
        turns.give_memory_back()

    def record_end(
        self, entry: Entry, ended_at: float, ending: str, told: str | None = None
    ) -> None:
        """The claim as the service saw it end, of whoever the OS said it was.

        ``told`` is how its kernel said it ended, where it said: what the
        metrics count, while the record says what the service saw.
        """
        running = entry.state == "running"
        ran_s = ended_at - entry.granted_at if running and entry.granted_at is not None else 0.0
        self.tally.ended(
            entry.user, told or ending, entry.need[0] if running else 0, len(entry.gpus), ran_s
        )
        if self.accounts is None:
            return
        try:
            record = UsageRecord(
                label=entry.label,
                notebook=entry.notebook,
                ticket=entry.number,
                cpus=entry.need[0] if running else 0,
                gpus=list(entry.gpus) if running else [],
                ram_bytes=entry.need[2] if running else 0,
                asked_at=entry.since,
                granted_at=entry.granted_at if running else None,
                ended_at=ended_at,
                ending=ending,
                uid=entry.uid,
                by_service=True,
            )
        except ValueError as error:
            log.warning("claim %s of %s not recorded: %s", entry.number, entry.user, error)
            return
        # Never raises: a record that cannot be written is a warning, here in the log.
        self.accounts.write(record)

    def welcome(self, connection: Connection) -> dict[str, Any]:
        cap = self.books.caps.get(connection.uid)
        return {
            "op": "welcome",
            "user": connection.user,
            "uid": connection.uid,
            "inventory": {
                "cpus": self.books.cpus,
                "gpu_ids": list(self.books.gpu_ids),
                "ram_bytes": self.books.ram_bytes,
                "core_ids": list(self.books.core_ids),
                "core_nodes": {str(c): n for c, n in self.books.core_nodes.items()},
            },
            **({"cap": None} if cap is None else cap.welcome()),
            "admin": connection.admin,
            "records": self.records,
            # A release may say how its claim ended (protocol.Release.ending).
            "hears_endings": True,
        }

    # -- requests -----------------------------------------------------------------

    def answer(self, connection: Connection, request: Any) -> None:
        handler = getattr(self, f"_on_{request.op}")
        handler(connection, request)

    def _on_claim(self, connection: Connection, request: protocol.Claim) -> None:
        need = (request.need.cpus, request.need.gpus, request.need.ram_bytes)
        piece = request.need.piece()
        too_big = self._too_big(connection, need, piece)
        if too_big:
            connection.send({"op": "error", "id": request.id, "message": too_big})
            return
        waiting = self.books.waiting_count(connection.uid)
        if waiting >= MAX_WAITING_PER_USER:
            self.refusals.refused(connection, "claims past the most one user may queue")
            connection.send(
                {
                    "op": "error",
                    "id": request.id,
                    "message": f"{connection.user} already has {waiting} claims waiting here",
                }
            )
            return
        entry = self._new_entry(connection, need, request.label, piece=piece)
        answer: dict[str, Any] = {
            "op": "ticket",
            "id": request.id,
            "ticket": entry.number,
            "since": entry.since,
        }
        granted = [] if self._holding() else self._grant()
        if entry in granted:
            # Granted on the spot, as most claims are: said in the answer,
            # which saves the kernel a second wake-up.
            granted.remove(entry)
            self.time_limits.granted(entry)
            answer.update(
                gpus=list(entry.gpus),
                gpu_bytes=entry.gpu_bytes,
                cores=list(entry.cores),
                granted_at=entry.granted_at,
                secret=self._grant_secret(entry),
            )
            self.note_held()
        connection.send(answer)
        self.tell_granted(granted)

    def _new_entry(
        self,
        connection: Connection,
        need: tuple[int, int, int],
        label: str,
        number: int | None = None,
        **running: Any,
    ) -> Entry:
        """A claim in the books, owned by whoever the OS says is at the other end.

        Waiting, unless ``running`` says what it runs with (a claim put back,
        under the ``number`` it had).
        """
        hello = connection.hello
        assert hello is not None
        entry = Entry(
            number=self.books.next_number() if number is None else number,
            uid=connection.uid,
            user=connection.user,
            pid=connection.pid,
            need=need,
            label=label,
            owner=connection,
            kernel_id=hello.kernel_id,
            notebook=hello.notebook,
            share_labels=hello.share_labels,
            **running,
        )
        self.books.add(entry)
        connection.entries[entry.number] = entry
        return entry

    def _too_big(
        self, connection: Connection, need: tuple[int, int, int], piece: Slice | None = None
    ) -> str | None:
        """Why a claim can never be granted, or ``None``. The kernel fits claims first."""
        books = self.books
        if need[0] > books.cpus or need[1] > len(books.gpu_ids) or need[2] > books.ram_bytes:
            return "the claim asks for more than this machine has to hand out"
        if piece is not None and not books.cards().fits_ever(CardAsk(piece=piece)):
            return "the claim asks for a slice larger than any card of this machine"
        cap = books.caps.get(connection.uid)
        if piece is not None:
            need = (need[0], 1, need[2])  # a slice is at most one card, against a cap
        if cap is not None and not all(
            limit is None or n <= limit
            for n, limit in zip(need, (cap.cpus, cap.gpus, cap.ram_bytes), strict=True)
        ):
            return f"the claim asks for more than {connection.user} may hold on this machine"
        return None

    def _on_release(self, connection: Connection, request: protocol.Release) -> None:
        entry = connection.entries.pop(request.ticket, None)
        if entry is not None:
            self.books.remove(entry.number)
            self.time_limits.forget(entry.number)
            # Stopped by the service, and given back by its kernel as it should be.
            self.record_end(entry, time.time(), entry.ended_as or RELEASED, told=request.ending)
            self.note_held()
            self.dispatch()

    def _on_cancel(self, connection: Connection, request: protocol.Cancel) -> None:
        entry = self.books.entries.get(request.ticket)
        if entry is None:
            connection.send({"op": "ok", "id": request.id, "found": False})
            return
        admin = in_group(connection.uid, self.admin_group)
        if entry.uid != connection.uid and not admin:
            connection.send(
                {
                    "op": "error",
                    "id": request.id,
                    "kind": "not_yours",
                    "message": f"claim {entry.number} belongs to {entry.user}; "
                    "only they, or a member of the machine's admin group, may cancel it",
                }
            )
            return
        reason = request.reason
        if entry.uid != connection.uid:
            reason = f"stopped by {connection.user}, an admin of this machine ({reason})"
        self.end_claim(entry, reason, CANCELLED)
        connection.send({"op": "ok", "id": request.id, "found": True})

    def _on_processes(self, connection: Connection, request: protocol.Processes) -> None:
        entry = connection.entries.get(request.ticket)
        if entry is not None:
            # The latest, bounded: a worker reused by claim after claim is one pid.
            known = dict.fromkeys((*entry.pids, *request.pids))
            entry.pids = tuple(known)[-MOST_PIDS:]

    def _on_news(self, connection: Connection, request: protocol.News) -> None:
        connection.send({"op": "ok", "id": request.id})

    def _on_report(self, connection: Connection, request: protocol.Report) -> None:
        entry = connection.entries.get(request.ticket)
        if entry is not None:
            entry.readings = request.readings.model_dump()
            self.books.changed()

    def _on_snapshot(self, connection: Connection, request: protocol.Snapshot) -> None:
        line = b'{"op":"snapshot","id":%d,"snapshot":%s}\n' % (
            request.id,
            self.snapshot_line(connection),
        )
        if len(line) > protocol.MAX_LINE_BYTES:
            # Only the reader's own claims can make it this long now; a line
            # the reader would refuse to read is never sent.
            line = protocol.line(
                {
                    "op": "error",
                    "id": request.id,
                    "message": f"the machine is too busy to show: {connection.user}'s own "
                    "waiting claims alone are more than a snapshot holds",
                }
            )
        connection.send_line(line)

    def snapshot_line(self, connection: Connection) -> bytes:
        """The machine as ``connection``'s user may see it, as JSON.

        Made once per change of the books for each reader (and admin or
        not) who asks: a client asking again and again costs the service a
        lookup, and a change costs one snapshot per reader, bounded in size.
        """
        if self.books.version != self._snapshots_of:
            self._snapshots.clear()
            self._snapshots_of = self.books.version
        key = (connection.uid, connection.admin)
        if self._holding():
            # Not kept: it says until when, which changes by the moment.
            return self._snapshot_json(connection)
        made = self._snapshots.get(key)
        if made is None:
            made = self._snapshots[key] = self._snapshot_json(connection)
        return made

    def _snapshot_json(self, connection: Connection) -> bytes:
        snapshot = self.books.snapshot(
            connection.uid, admin=connection.admin, sees_pids=connection.uid == 0
        )
        if self._holding():
            # Said, so that a claim waiting with the machine free says why.
            left = self._granting_from - asyncio.get_running_loop().time()
            snapshot["grants_resume_at"] = time.time() + left
        return protocol.line(snapshot)[:-1]

    def _on_kernel_deaths(self, connection: Connection, request: protocol.KernelDeaths) -> None:
        """The asker's own killed kernels' records, read from root's files on a thread."""
        uid, read, loop = connection.uid, self.read_deaths, asyncio.get_running_loop()
        if not self.records or read is None:
            connection.send({"op": "kernel_deaths", "id": request.id, "records": [], "more": 0})
            return
        wait = self._deaths_free_at - loop.time()
        if wait > 0:
            # How long, unknown while a read runs: the asker tries again in a moment.
            again = 1.0 if math.isinf(wait) else round(wait, 2)
            message = (
                "the books service is reading, or has just read, usage records for "
                f"someone; ask again in {math.ceil(again)} s"
            )
            connection.send(
                {"op": "error", "id": request.id, "message": message, "retry_in": again}
            )
            return
        self._deaths_free_at = math.inf
        directory, since = Path(self.records), request.since
        started = loop.time()
        reading = loop.run_in_executor(None, read, directory, uid, since, DEATHS_ANSWERED)

        def answer(done: asyncio.Future) -> None:
            now = loop.time()
            self._deaths_free_at = now + (now - started) * (1 - DEATHS_DUTY) / DEATHS_DUTY
            try:
                records, more = done.result()
            except Exception as error:
                log.warning("the records of %s's killed kernels were not read: %s", uid, error)
                message = f"the records could not be read: {error}"
                connection.send({"op": "error", "id": request.id, "message": message})
                return
            connection.send(
                {
                    "op": "kernel_deaths",
                    "id": request.id,
                    "records": [
                        record.model_dump(mode="json", exclude_none=True) for record in records
                    ],
                    "more": more,
                }
            )

        reading.add_done_callback(answer)

    def dispatch(self) -> None:
        if self._holding():
            return
        self.tell_granted(self._grant())

    def _grant(self) -> list[Entry]:
        """Whatever may go now, granted in the books, each wait counted for the metrics."""
        reading = self.cards.latest(wait_for_first=False) if self.cards is not None else None
        if (
            reading is None
            and self.cards is not None
            and self.cards.before_the_first_pass()
            and any(e.card_ask for e in self.books.waiting[:64])
        ):
            # The cards' sizes are not read yet (a service just started, or restarted
            # under waiting claims): a slice sized on a guess may be more than its card
            # holds. The watch grants again within a second (:mod:`.cards_as_they_are`).
            return []
        squatted = meet_the_cards(self.books, reading)
        granted = self.books.dispatch()
        if reading is not None:
            say_why_waiting(self.books, squatted)
        for entry in granted:
            if entry.granted_at is not None:
                self.tally.waited(entry.user, entry.granted_at - entry.since)
        return granted

    def tell_granted(self, granted: list[Entry]) -> None:
        for entry in granted:
            self.time_limits.granted(entry)
            owner: Connection = entry.owner
            owner.send(
                {
                    "op": "granted",
                    "ticket": entry.number,
                    "gpus": list(entry.gpus),
                    "gpu_bytes": entry.gpu_bytes,
                    "cores": list(entry.cores),
                    "granted_at": entry.granted_at,
                    "secret": self._grant_secret(entry),
                }
            )
        if granted:
            self.note_held()


async def serve(
    socket_path: Path,
    service: BooksService,
    ready: Any = None,
    metrics: tuple[str, int] | None = None,
) -> None:
    """Answer on ``socket_path`` until SIGTERM or SIGINT; and metrics at ``metrics``, if given.

    A service that follows one which had claims (it left its socket behind,
    having crashed, or said so as it stopped) grants nothing for a grace
    period, while their kernels put them back. Where the metrics are served
    is written beside the socket (:mod:`.metrics_http`).
    """
    held = socket_path.with_name(CLAIMS_HELD_NAME)
    follows_claims = socket_path.exists() or held.exists()
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()
    with contextlib.suppress(FileNotFoundError):
        held.unlink()
    loop = asyncio.get_running_loop()
    # Asked now: whoever runs this raised the descriptor limit first.
    service.admission.per_user, service.admission.in_all = connection_limits()
    server = await loop.create_unix_server(lambda: Connection(service), path=str(socket_path))
    scraped = None
    if metrics is not None:
        from fluksio_nb.machine.metrics_http import metrics_text, start_metrics

        text = functools.partial(metrics_text, service)
        scraped = await start_metrics(text, *metrics, socket_path.parent)
    if follows_claims:
        service.take_over()
        service.hold_grants(RESTORE_GRACE_S)
    stop = service.stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if ready is not None:
        ready(server)
    idle_watch = watch_idle_cards(service)
    cards_watch = watch_cards_as_they_are(service)
    try:
        await stop.wait()
    finally:
        for watch in (idle_watch, cards_watch):
            if watch is not None:
                watch.cancel()
        # The name goes first, so that a kernel reconnecting finds the next
        # service rather than this one on its way out.
        with contextlib.suppress(FileNotFoundError):
            socket_path.unlink()
        if scraped is not None:
            scraped.close()
        server.close()
        service.freeze_held()
        if any(c.entries for c in service.connections):
            held.touch(mode=0o644)
        for connection in list(service.connections):
            connection.close()
        await server.wait_closed()
