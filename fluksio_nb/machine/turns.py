"""How the books service shares its attention: turns, bounded buffers, limits, a small log.

The service is one thread, and every user's kernels wait on it, so anything
one client can make it do at length is time taken from everyone. Once it
answered every whole line it had read from a connection before it listened
to anyone else: 300 snapshot requests in one write froze it for 20 s, and
10⁵ claims pipelined on one connection made another user's claim wait
seconds. What it decides here:

- **Turns between people.** A connection's lines are answered in turns:
  each user whose connections have lines to answer gets one turn in every
  round, of at most :data:`LINES_PER_TURN` lines of one of their
  connections (their connections take turns among themselves) or
  :data:`USER_TURN_S`, and after :data:`ROUND_S` of work the service goes
  back to its sockets, to read and accept, before the next. One user's
  hundred flooding connections have the same share of the service as
  another's one kernel.
- **Bounded memory per connection and per user.** Bytes are read into one
  buffer the service shares (:class:`asyncio.BufferedProtocol`), and each
  connection keeps only what it has not answered yet: reading stops while
  :data:`PAUSE_READING_AT` of whole lines wait, an unfinished line longer
  than any request (:data:`MAX_REQUEST_BYTES`) ends its connection, and so
  does one past its user's :data:`USER_UNFINISHED_BYTES`. A connection's
  buffers go with it.
- **A client that stops reading stops being answered**, past
  :data:`WRITE_HIGH_BYTES` of unread answers, and is dropped if it stays so
  for :data:`STUCK_AFTER_S`: its answers do not pile up in the service.
- **Connections are limited per user and in all**, both below the
  service's descriptor limit (:func:`connection_limits`), so that one user
  at their limit leaves room for everyone else, and the service never runs
  out of descriptors (which left new connections unanswered for seconds).
  Root, who runs the service, keeps a few past the limit in all, for
  ``machine status`` on a full machine. A refused connection is told why
  in one line.
- **Refusals are counted, and said every few seconds** (:class:`RefusalLog`):
  the log lives on ``/run``'s tmpfs, and a line per refusal grew it by
  gigabytes an hour under a flood.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any

from fluksio_nb.identity import user_name
from fluksio_nb.machine import protocol

if TYPE_CHECKING:
    from fluksio_nb.machine.service import BooksService

log = logging.getLogger("fluksio_nb.machine")

#: The most lines of one connection answered in its user's turn.
LINES_PER_TURN = 16
#: The most of the service's time one user's turn takes, whatever its lines cost.
USER_TURN_S = 0.001
#: How long the service answers before it reads its sockets again.
ROUND_S = 0.004
#: The longest request the protocol has is a hello with a long notebook path,
#: every character escaped: some 50 KB. A line longer than this is no request.
MAX_REQUEST_BYTES = 64 << 10
#: Whole lines a connection may leave unanswered before the service stops
#: reading it; its kernel's writes then wait, and nothing piles up here.
PAUSE_READING_AT = 32 << 10
#: What one user's unfinished lines, over all their connections, may hold.
USER_UNFINISHED_BYTES = 1 << 20
#: How much the service reads at once, into the one buffer it shares.
READ_CHUNK_BYTES = 64 << 10
#: Unread answers past which a connection's lines are no longer answered...
WRITE_HIGH_BYTES = 64 << 10
#: ...and how long it may stay so before it is taken to be stuck and dropped.
STUCK_AFTER_S = 5.0
#: Past any wait for a connection to read: a client stuck this far is dropped at once.
MAX_BACKLOG_BYTES = 4 << 20
#: The most connections one user may have: far above what a person's kernels
#: make (one each, and a moment's for a view), if the descriptors allow.
MAX_CONNECTIONS_PER_USER = 256
#: Descriptors kept for what is not a connection: the listening socket, the
#: log, usage records being written, the records read for a user.
RESERVED_DESCRIPTORS = 64
#: Of those, how many root may use for connections past the limit in all.
ROOT_PAST_THE_LIMIT = 16
#: At most one line of refusals this often.
REFUSALS_EVERY_S = 5.0
#: The most users one line of refusals names; the rest are counted.
REFUSALS_USERS_NAMED = 5
#: How long after connections left the service hands freed memory back to the OS.
GIVE_BACK_AFTER_S = 2.0


def connection_limits(descriptors: int | None = None) -> tuple[int, int]:
    """``(per user, in all)`` for a service that may open ``descriptors`` files.

    The default is the soft limit now: the service raises it to the hard
    limit as it starts, so this is asked after. Each user may have a quarter
    of the total at most: one user at their limit never fills the service.
    """
    if descriptors is None:
        descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if descriptors == resource.RLIM_INFINITY:
            descriptors = 1 << 20
    in_all = max(descriptors - RESERVED_DESCRIPTORS, 8)
    return max(min(MAX_CONNECTIONS_PER_USER, in_all // 4), 2), in_all


def give_memory_back() -> None:
    """Hand the pages that freed buffers leave in the C heap back to the OS.

    What a flood's connections held is freed as they go, but glibc keeps the
    pages for the process unless asked: the service would stay hundreds of
    megabytes larger after a flood than before it. Nothing elsewhere.
    """
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


class Admission:
    """Who may connect: a limit per user and one in all, counted as they come and go."""

    def __init__(self, connections: set[Connection]) -> None:
        self.connections = connections
        self.per_user, self.in_all = connection_limits()
        self._of: dict[int, int] = {}

    def admits(self, connection: Connection) -> bool:
        """Whether ``connection`` is let in; if not, it is told why in a line, and ended."""
        uid, theirs = connection.uid, self._of.get(connection.uid, 0)
        # Root's are the views of a server root runs, and its admin's terminal.
        if uid != 0 and theirs >= self.per_user:
            connection.turned_away = True
            connection.refuse(
                f"{connection.user} already has {theirs} connections to this machine's books "
                f"service, the most one user may have; each running kernel holds one, so shut "
                "down kernels you no longer use",
                "too many connections of one user",
            )
            return False
        if len(self.connections) >= self.in_all + (ROOT_PAST_THE_LIMIT if uid == 0 else 0):
            connection.turned_away = True
            connection.refuse(
                f"this machine's books service holds {len(self.connections)} connections, the "
                "most it can; ask again in a while, and tell the machine's admin if it lasts",
                "the service is full",
            )
            return False
        self._of[uid] = theirs + 1
        return True

    def left(self, connection: Connection) -> None:
        if (theirs := self._of.pop(connection.uid, 0) - 1) > 0:
            self._of[connection.uid] = theirs


class RefusalLog:
    """What the service refused, counted per user, said in one line every few seconds.

    The first refusal after a quiet spell is said at once; the rest wait for
    the next line, :data:`REFUSALS_EVERY_S` after the last. So the log grows
    by a few hundred bytes every few seconds however fast anyone is refused.
    """

    def __init__(self, every_s: float = REFUSALS_EVERY_S) -> None:
        self.every_s = every_s
        self._next_at = 0.0
        self._flush_pending = False
        #: Per user: how often, for which reason, and the first instance in full.
        self._counts: dict[str, Counter[str]] = {}
        self._first: dict[str, str] = {}
        self._connections: dict[str, set[int]] = {}

    def refused(self, connection: Connection, kind: str, why: str = "") -> None:
        who = f"{connection.user} (uid {connection.uid})"
        self._counts.setdefault(who, Counter())[kind] += 1
        self._connections.setdefault(who, set()).add(id(connection))
        if who not in self._first:
            detail = f": {' '.join(why[:300].split())}" if why else ""
            self._first[who] = f"pid {connection.pid}, {kind}{detail}"
        now = time.monotonic()
        if now >= self._next_at:
            self.flush()
        elif not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_later(self._next_at - now, self.flush)

    def flush(self) -> None:
        self._flush_pending = False
        if not self._counts:
            return
        self._next_at = time.monotonic() + self.every_s
        named = sorted(self._counts, key=lambda who: -sum(self._counts[who].values()))
        said = []
        for who in named[:REFUSALS_USERS_NAMED]:
            kinds = ", ".join(f"{kind} ×{n}" for kind, n in self._counts[who].most_common(4))
            connections = len(self._connections[who])
            said.append(
                f"{who} on {connections} connection{'s' * (connections != 1)}: {kinds} "
                f"(first: {self._first[who]})"
            )
        if rest := named[REFUSALS_USERS_NAMED:]:
            total = sum(sum(self._counts[who].values()) for who in rest)
            said.append(f"and {total} refusals of {len(rest)} more users")
        log.warning("refused: %s", "; ".join(said))
        self._counts.clear()
        self._first.clear()
        self._connections.clear()


class Turns:
    """Which connections have lines to answer, and whose turn it is."""

    def __init__(self) -> None:
        #: Users with lines to answer, in the order their turns come.
        self._users: deque[int] = deque()
        self._theirs: dict[int, deque[Connection]] = {}
        self._scheduled = False
        #: The one buffer this service's connections read into, in turn: it
        #: runs in one thread, and each read is copied out before the next.
        self.scratch = memoryview(bytearray(READ_CHUNK_BYTES))

    def wake(self, connection: Connection) -> None:
        """``connection`` has lines to answer: it takes its turns until it has none."""
        if connection.in_turns or connection.closed:
            return
        connection.in_turns = True
        theirs = self._theirs.get(connection.uid)
        if theirs is None:
            theirs = self._theirs[connection.uid] = deque()
            self._users.append(connection.uid)
        theirs.append(connection)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._round)

    def _round(self) -> None:
        self._scheduled = False
        clock = time.perf_counter
        until = clock() + ROUND_S
        while self._users:
            uid = self._users.popleft()
            theirs = self._theirs[uid]
            connection = theirs.popleft()
            connection.in_turns = False
            try:
                connection.answer(LINES_PER_TURN, clock() + USER_TURN_S)
            except Exception:
                # A bug, not a request: it ends this connection, never the turns.
                log.exception("answering pid %s (%s) failed", connection.pid, connection.user)
                connection.close()
            if connection.has_lines():
                connection.in_turns = True
                theirs.append(connection)
            if theirs:
                self._users.append(uid)
            else:
                del self._theirs[uid]
            if clock() >= until:
                break
        if self._users:
            # What is left waits for the sockets to be read: anyone's line
            # that came meanwhile takes its place behind these.
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._round)


class Connection(asyncio.BufferedProtocol):
    """One kernel (or server, or terminal) talking to the service.

    Lines are answered in turns (:class:`Turns`), not as they are read, and
    only what is not answered yet is kept.
    """

    def __init__(self, service: BooksService) -> None:
        self.service = service
        self.transport: asyncio.Transport | None = None
        self.pid = self.uid = -1
        self.user = ""
        self.hello: protocol.Hello | None = None
        #: Whether the hello's user was in the admin group when it came.
        self.admin = False
        self.entries: dict[int, Any] = {}
        self.closed = False
        #: Closed by the service, not by its kernel: the kernel lives on.
        self.dropped = False
        #: Refused before it was counted among the service's connections.
        self.turned_away = False
        self.in_turns = False
        #: What was read and not answered: whole lines up to ``_whole``, then
        #: the start of one that has not ended; answered up to ``_start``.
        self._pending = bytearray()
        self._start = self._whole = 0
        self._unfinished = 0
        self._reading_paused = False
        self._writing_paused_at: float | None = None
        self._view = service.turns.scratch

    # -- asyncio's side ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES)
        self.pid, self.uid, _ = protocol.peer_credentials(transport.get_extra_info("socket"))
        self.user = user_name(self.uid)
        self.service.arrived(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        before = len(self._pending)
        self._pending += self._view[:nbytes]
        end = self._pending.rfind(b"\n", before)
        if end >= 0:
            self._whole = end + 1
            self.service.turns.wake(self)
        self._count_unfinished()
        if self.closed:
            return
        if self._whole - self._start > PAUSE_READING_AT:
            self._pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._forget_pending()
        self.service.left(self)

    def pause_writing(self) -> None:
        # Its turns stop until it reads; if it never does, it is dropped.
        self._writing_paused_at = at = time.monotonic()
        asyncio.get_running_loop().call_later(STUCK_AFTER_S, self._stuck_since, at)

    def resume_writing(self) -> None:
        self._writing_paused_at = None
        if self.has_lines():
            self.service.turns.wake(self)

    # -- the service's side --------------------------------------------------------

    def has_lines(self) -> bool:
        return not self.closed and self._writing_paused_at is None and self._whole > self._start

    def answer(self, most: int, until: float) -> None:
        """Answer up to ``most`` whole lines, and none after ``until`` (``perf_counter``)."""
        pending, heard = self._pending, self.service.heard
        for _ in range(most):
            if not self.has_lines():
                break
            end = pending.index(b"\n", self._start, self._whole)
            line = bytes(pending[self._start : end])
            self._start = end + 1
            heard(self, line)
            if time.perf_counter() >= until:
                break
        if self.closed:
            return
        if self._start == len(pending):
            # All answered: the buffer goes, however large it grew.
            self._pending, self._start, self._whole = bytearray(), 0, 0
        elif self._start > len(pending) // 2:
            del pending[: self._start]
            self._whole -= self._start
            self._start = 0
        if self._reading_paused and self._whole - self._start <= PAUSE_READING_AT // 2:
            self._reading_paused = False
            assert self.transport is not None
            self.transport.resume_reading()

    def send(self, message: dict[str, Any]) -> None:
        self.send_line(protocol.line(message))

    def send_line(self, line: bytes) -> None:
        """A message already made into its line."""
        if self.closed or self.transport is None:
            return
        if self.transport.get_write_buffer_size() > MAX_BACKLOG_BYTES:
            self.service.refusals.refused(self, "dropped: it stopped reading")
            self.close()
            return
        self.transport.write(line)

    def refuse(self, why: str, kind: str | None = None, *, about: str | None = None) -> None:
        """Say why, and end this connection, and only this one.

        ``about`` names, for the client, what it is refused for, where it can
        tell its user more than the words.
        """
        self.service.refusals.refused(self, kind or why, why if kind else "")
        said = {"op": "refused", "message": why[:2000]}
        if about is not None:
            said["about"] = about
        self.send(said)
        if not self.closed and self.transport is not None:
            self.closed = self.dropped = True
            self._forget_pending()
            # close(), not abort(): the refusal is flushed before the end.
            self.transport.close()

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = self.dropped = True
            self._forget_pending()
            self.transport.abort()

    # -- bounds ----------------------------------------------------------------------

    def _count_unfinished(self) -> None:
        unfinished = len(self._pending) - self._whole
        users = self.service.unfinished
        users[self.uid] = users.get(self.uid, 0) + unfinished - self._unfinished
        self._unfinished = unfinished
        if unfinished > MAX_REQUEST_BYTES:
            self.refuse(
                f"a line of more than {MAX_REQUEST_BYTES} bytes, longer than any request of "
                "the protocol: each request is one JSON object on a line of its own",
                "a line longer than any request",
            )
        elif users[self.uid] > USER_UNFINISHED_BYTES:
            self.refuse(
                f"{self.user}'s connections hold more than {USER_UNFINISHED_BYTES} bytes of "
                "lines not ended yet; end each request with a newline",
                "too many unfinished lines",
            )

    def _forget_pending(self) -> None:
        if self._unfinished:
            users = self.service.unfinished
            left = users.get(self.uid, 0) - self._unfinished
            if left > 0:
                users[self.uid] = left
            else:
                users.pop(self.uid, None)
        self._pending, self._start, self._whole, self._unfinished = bytearray(), 0, 0, 0

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()

    def _stuck_since(self, at: float) -> None:
        if self._writing_paused_at == at and not self.closed:
            self.service.refusals.refused(self, "dropped: it stopped reading")
            self.close()
