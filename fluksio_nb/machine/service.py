"""The machine's books service: one root process every user's kernels talk to.

It holds the books in memory and answers over a Unix socket in the machine's
run directory. Who is asking is what the kernel says ``SO_PEERCRED`` is; a
claim lives exactly as long as the connection that made it, so a kernel
killed by anything gives its share back the moment the kernel closes its
socket, without anybody having to notice.

What it decides:

- **It never waits for a client.** One asyncio loop; every write is
  buffered, and a client that stops reading past :data:`MAX_BACKLOG_BYTES`
  is disconnected (which frees only its own claims). A client stopped with
  ``SIGSTOP`` stalls nobody but itself.
- **A line that does not parse ends its connection**, and nothing else.
  Every request is validated (:mod:`~fluksio_nb.machine.protocol`) before
  anything reads it.
- **Only the owner cancels**, or a member of the admin group the machine's
  config names; the owner's kernel is told who stopped it.
- **Limits per user**: connections and waiting claims, so one user cannot
  grow the service's memory for everyone.
- **A kernel that died still leaves its claims' records.** A connection the
  kernel closed with claims still held or waiting (it gave none of them
  back: it was killed) has a usage record written for each, ending
  :data:`~fluksio_nb.records.KERNEL_DIED`, into the machine's records
  directory, in a file of root's that says whose each one is. What only
  the kernel knew (peak memory) stays unknown. A connection the service
  closed (a client that stopped reading, a bad line, the service stopping
  for a restart) leaves none: its kernel lives, and ends and records its
  claims itself.
- **Each user may read the records of their own killed kernels**, and no
  one else's: root's file is private, so the service reads it for them
  (``kernel_deaths``), the newest :data:`DEATHS_ANSWERED` at most. Reading
  takes the GIL from the loop that answers claims, so it is done on a
  thread, for one asker at a time, and busy at most a tenth of the time
  (:data:`DEATHS_DUTY`): nobody can slow everyone's claims by asking again
  and again.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import math
import os
import pwd
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fluksio_nb.identity import user_name
from fluksio_nb.machine import protocol
from fluksio_nb.machine.books import Entry, MachineBooks
from fluksio_nb.machine.caps import Cap
from fluksio_nb.records import KERNEL_DIED, UsageRecord, process_log

log = logging.getLogger("fluksio_nb.machine")

#: How long a service that just started grants nothing, so that kernels whose
#: claims ran across a restart put them back before anything waiting is
#: granted what they still hold.
RESTORE_GRACE_S = 3.0
#: Left in the run directory by a service that stopped while claims were held.
CLAIMS_HELD_NAME = "claims-held"
#: How much unread output a client may leave in the service's buffers before
#: it is taken to be stuck and disconnected.
MAX_BACKLOG_BYTES = 4 << 20
#: The most connections and waiting claims one user may have. Far above what a
#: person's notebooks make, and low enough that the service's memory is bounded.
MAX_CONNECTIONS_PER_USER = 512
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


class Connection(asyncio.Protocol):
    """One kernel (or server, or terminal) talking to the service.

    A protocol rather than a stream reader and a task: each line is answered
    as it is read, with no task to wake in between, which was a third of
    what the service spent on a claim.
    """

    def __init__(self, service: BooksService) -> None:
        self.service = service
        self.transport: asyncio.Transport | None = None
        self.pid = self.uid = -1
        self.user = ""
        self.hello: protocol.Hello | None = None
        self.entries: dict[int, Entry] = {}
        self.closed = False
        #: Closed by the service, not by its kernel: the kernel lives on.
        self.dropped = False
        self._buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.pid, self.uid, _ = protocol.peer_credentials(transport.get_extra_info("socket"))
        self.user = user_name(self.uid)
        self.service.arrived(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while not self.closed and b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            self.service.heard(self, line)
        if len(self._buffer) > protocol.MAX_LINE_BYTES:
            self.refuse("a line longer than the protocol allows")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.service.left(self)

    def send(self, message: dict[str, Any]) -> None:
        self.send_line(protocol.line(message))

    def send_line(self, line: bytes) -> None:
        """A message already made into its line."""
        if self.closed or self.transport is None:
            return
        if self.transport.get_write_buffer_size() > MAX_BACKLOG_BYTES:
            log.warning("dropping pid %s (%s): it stopped reading", self.pid, self.user)
            self.close()
            return
        self.transport.write(line)

    def refuse(self, why: str) -> None:
        """Say why, and end this connection, and only this one."""
        log.warning("pid %s (%s) refused: %s", self.pid, self.user, why)
        self.send({"op": "refused", "message": why[:2000]})
        if not self.closed and self.transport is not None:
            self.closed = self.dropped = True
            # close(), not abort(): the refusal is flushed before the end.
            self.transport.close()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = self.dropped = True
            self.transport.abort()


class BooksService:
    """The books plus the connections that hold claims in them."""

    def __init__(
        self,
        books: MachineBooks,
        *,
        caps: dict[str, Cap] | None = None,
        admin_group: str | None = None,
        records: str | None = None,
        read_deaths: DeathsReader | None = None,
    ) -> None:
        self.books = books
        self.cap_by_name = caps or {}
        self.admin_group = admin_group
        self.records = records
        self.read_deaths = read_deaths
        self.connections: set[Connection] = set()
        self._granting_from = 0.0
        #: When, on the loop's clock, the next read of killed kernels' records may start.
        self._deaths_free_at = 0.0

    def cap_for(self, user: str) -> Cap | None:
        return self.cap_by_name.get(user) or self.cap_by_name.get("*")

    # -- a connection's life ----------------------------------------------------

    def arrived(self, connection: Connection) -> None:
        if sum(c.uid == connection.uid for c in self.connections) >= MAX_CONNECTIONS_PER_USER:
            connection.refuse("too many connections from this user")
            return
        self.connections.add(connection)

    def heard(self, connection: Connection, line: bytes) -> None:
        """One line from a connection: its hello first, then requests."""
        try:
            if connection.hello is None:
                connection.hello = protocol.read_hello(line)
                cap = self.cap_for(connection.user)
                if cap is not None:
                    self.books.caps[connection.uid] = cap
                connection.send(self.welcome(connection))
            else:
                self.answer(connection, protocol.read_request(line))
        except ValidationError as error:
            connection.refuse(f"bad request: {error}")

    def left(self, connection: Connection) -> None:
        """A connection closed: whatever it held or waited for is free for everyone."""
        self.connections.discard(connection)
        ended_at = time.time()
        for number in list(connection.entries):
            entry = self.books.remove(number)
            # Its kernel released every claim it ended, before recording it:
            # the lines before its end are read before the end is. What is
            # left, it never will.
            if entry is not None and not connection.dropped:
                self.record_death(entry, ended_at)
        connection.entries.clear()
        self.dispatch()

    def record_death(self, entry: Entry, ended_at: float) -> None:
        """The usage record a killed kernel could not write, of whoever the OS said it was."""
        if not self.records:
            return
        running = entry.state == "running"
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
                ending=KERNEL_DIED,
                uid=entry.uid,
            )
        except ValueError as error:
            log.warning("claim %s of %s not recorded: %s", entry.number, entry.user, error)
            return
        # Never raises: a record that cannot be written is a warning, here in the log.
        process_log(Path(self.records), create=False).write(record)

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
            "cap": None if cap is None else cap.__dict__,
            "admin": in_group(connection.uid, self.admin_group),
            "records": self.records,
        }

    # -- requests -----------------------------------------------------------------

    def answer(self, connection: Connection, request: Any) -> None:
        handler = getattr(self, f"_on_{request.op}")
        handler(connection, request)

    def _on_claim(self, connection: Connection, request: protocol.Claim) -> None:
        need = (request.need.cpus, request.need.gpus, request.need.ram_bytes)
        too_big = self._too_big(connection, need)
        if too_big:
            connection.send({"op": "error", "id": request.id, "message": too_big})
            return
        waiting = sum(
            e.state == "waiting" for e in self.books.entries.values() if e.uid == connection.uid
        )
        if waiting >= MAX_WAITING_PER_USER:
            connection.send(
                {
                    "op": "error",
                    "id": request.id,
                    "message": f"{connection.user} already has {waiting} claims waiting here",
                }
            )
            return
        entry = self._new_entry(connection, need, request.label)
        answer: dict[str, Any] = {
            "op": "ticket",
            "id": request.id,
            "ticket": entry.number,
            "since": entry.since,
        }
        granted = [] if self._holding() else self.books.dispatch()
        if entry in granted:
            # Granted on the spot, as most claims are: said in the answer,
            # which saves the kernel a second wake-up.
            granted.remove(entry)
            answer.update(
                gpus=list(entry.gpus), cores=list(entry.cores), granted_at=entry.granted_at
            )
        connection.send(answer)
        self.tell_granted(granted)

    def _new_entry(self, connection: Connection, need: tuple[int, int, int], label: str) -> Entry:
        """A claim in the books, owned by whoever the OS says is at the other end."""
        hello = connection.hello
        assert hello is not None
        entry = Entry(
            number=self.books.next_number(),
            uid=connection.uid,
            user=connection.user,
            pid=connection.pid,
            need=need,
            label=label,
            owner=connection,
            kernel_id=hello.kernel_id,
            notebook=hello.notebook,
            share_labels=hello.share_labels,
        )
        self.books.add(entry)
        connection.entries[entry.number] = entry
        return entry

    def _too_big(self, connection: Connection, need: tuple[int, int, int]) -> str | None:
        """Why a claim can never be granted, or ``None``. The kernel fits claims first."""
        books = self.books
        if need[0] > books.cpus or need[1] > len(books.gpu_ids) or need[2] > books.ram_bytes:
            return "the claim asks for more than this machine has to hand out"
        cap = books.caps.get(connection.uid)
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
        entry.cancel = reason
        owner: Connection = entry.owner
        if entry.state == "waiting":
            # Gone from the queue at once; the owner learns why when told.
            self.books.remove(entry.number)
            owner.entries.pop(entry.number, None)
        owner.send({"op": "stop", "ticket": entry.number, "reason": reason})
        connection.send({"op": "ok", "id": request.id, "found": True})
        self.dispatch()

    def _on_report(self, connection: Connection, request: protocol.Report) -> None:
        entry = connection.entries.get(request.ticket)
        if entry is not None:
            entry.readings = dict(request.readings)

    def _on_snapshot(self, connection: Connection, request: protocol.Snapshot) -> None:
        snapshot = self.books.snapshot(
            connection.uid, admin=in_group(connection.uid, self.admin_group)
        )
        if self._holding():
            # Said, so that a claim waiting with the machine free says why.
            left = self._granting_from - asyncio.get_running_loop().time()
            snapshot["grants_resume_at"] = time.time() + left
        line = protocol.line({"op": "snapshot", "id": request.id, "snapshot": snapshot})
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

    def _on_restore(self, connection: Connection, request: protocol.Restore) -> None:
        """A kernel's running claim from before the service restarted, back in the books.

        Taken only in the grace after a restart, while nothing is granted, and
        only if what it names is free, and within its user's cap beside what
        they hold: at any other time a restore would be a way past the queue
        and the cap.
        """
        need = (request.cpus, len(request.gpus), request.ram_bytes)
        why = None
        if not self._holding():
            why = "a claim is put back only while the service restarts"
        elif (
            len(set(request.gpus)) != len(request.gpus)
            or len(set(request.cores)) != len(request.cores)
            or (request.cores and len(request.cores) != request.cpus)
            or not set(request.gpus) <= set(self.books.gpu_ids)
            or self._too_big(connection, need)
            or not self.books.within_cap(connection.uid, need)
            or not self.books.fits_free(
                request.cpus, request.gpus, request.ram_bytes, request.cores
            )
        ):
            why = "no longer free"
        if why is not None:
            connection.send({"op": "error", "id": request.id, "message": why})
            return
        entry = self._new_entry(connection, need, request.label)
        entry.state, entry.gpus, entry.granted_at = "running", tuple(request.gpus), entry.since
        entry.cores = tuple(request.cores)
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

    def dispatch(self) -> None:
        if self._holding():
            return
        self.tell_granted(self.books.dispatch())

    def tell_granted(self, granted: list[Entry]) -> None:
        for entry in granted:
            owner: Connection = entry.owner
            owner.send(
                {
                    "op": "granted",
                    "ticket": entry.number,
                    "gpus": list(entry.gpus),
                    "cores": list(entry.cores),
                    "granted_at": entry.granted_at,
                }
            )


async def serve(socket_path: Path, service: BooksService, ready: Any = None) -> None:
    """Answer on ``socket_path`` until SIGTERM or SIGINT.

    A service that follows one which had claims (it left its socket behind,
    having crashed, or said so as it stopped) grants nothing for a grace
    period, while their kernels put them back.
    """
    held = socket_path.with_name(CLAIMS_HELD_NAME)
    follows_claims = socket_path.exists() or held.exists()
    with contextlib.suppress(FileNotFoundError):
        socket_path.unlink()
    with contextlib.suppress(FileNotFoundError):
        held.unlink()
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: Connection(service), path=str(socket_path))
    if follows_claims:
        service.hold_grants(RESTORE_GRACE_S)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if ready is not None:
        ready(server)
    try:
        await stop.wait()
    finally:
        # The name goes first, so that a kernel reconnecting finds the next
        # service rather than this one on its way out.
        with contextlib.suppress(FileNotFoundError):
            socket_path.unlink()
        server.close()
        if any(c.entries for c in service.connections):
            held.touch(mode=0o644)
        for connection in list(service.connections):
            connection.close()
        await server.wait_closed()
