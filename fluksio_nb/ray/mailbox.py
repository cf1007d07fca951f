"""The cell's output on its way from the Ray task to the kernel, while the task runs.

A cell on the cluster should print into its notebook cell as it goes, not
all at the end. This module decides how the task's output reaches the
kernel, and how often.

What this module decides:

- **Output goes through a mailbox actor**, one per kernel
  (:class:`Mailboxes`), which the task writes to and the kernel reads from
  while it waits for the task. Ray's streaming generators would be lighter,
  but Ray Client (``ray://``) does not support them, and a mailbox works the
  same both ways.
- **The worker's messages go as they are** (:mod:`fluksio_nb.worker.messages`),
  with the task's own two (:class:`Sampled`, :class:`Started`) beside them:
  the kernel shows them with the same :func:`~fluksio_nb.worker.messages.relay`
  as a local claim's.
- **The task sends in batches** (:class:`_Outbox`), at most every
  :data:`SEND_EVERY_S`, from one thread per Ray worker process
  (:class:`_Sender`). What the task has not sent when the cell ends comes
  back with its result, with the count of what it did send, so a short cell
  costs no actor call for its output.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from fluksio_nb.sampler import Sample
from fluksio_nb.watch import ensure_running
from fluksio_nb.worker.messages import Output, Sink

#: The least time between two sends of the task's output: a loop printing
#: thousands of lines costs fifty actor calls a second, not thousands.
SEND_EVERY_S = 0.02

#: How long the task holds its first output before sending it. A cell over
#: by then sends everything with its result: no actor call at all.
FIRST_SEND_AFTER_S = 0.05


class Mailboxes:
    """A Ray actor holding each running claim's output until the kernel takes it.

    Async, so a kernel waiting on one claim's box does not hold up another
    claim's writes. Writes from one task arrive in the order it made them:
    Ray runs one caller's actor calls in order, and :meth:`put` never awaits.
    """

    def __init__(self) -> None:
        import asyncio

        self._asyncio = asyncio
        self._boxes: dict[str, list[Any]] = {}
        self._arrived: dict[str, Any] = {}
        #: Boxes whose claim was given up on: a late write must not recreate them.
        self._forgotten: deque[str] = deque(maxlen=1024)

    def _event(self, box: str) -> Any:
        if box not in self._arrived:
            self._arrived[box] = self._asyncio.Event()
        return self._arrived[box]

    async def put(self, box: str, items: list[Any]) -> None:
        if box in self._forgotten:
            return
        self._boxes.setdefault(box, []).extend(items)
        self._event(box).set()

    async def take(self, box: str, wait_s: float) -> list[Any]:
        arrived = self._event(box)
        if not self._boxes.get(box) and wait_s > 0:
            with contextlib.suppress(self._asyncio.TimeoutError):
                await self._asyncio.wait_for(arrived.wait(), wait_s)
        arrived.clear()
        return self._boxes.pop(box, [])

    async def forget(self, box: str) -> list[Any]:
        """Drop the box and wake whoever waits on it; what was still in it."""
        self._forgotten.append(box)
        left = self._boxes.pop(box, [])
        arrived = self._arrived.pop(box, None)
        if arrived is not None:
            arrived.set()
        return left


class _Outbox:
    """Sends the task's output to its mailbox in batches, from the process's sending thread.

    What is still unsent when the cell ends goes back with the task's result
    instead (:meth:`close`), with the count of what was sent, so that the
    kernel knows when it has shown everything without another round trip.
    A cell that is over within :data:`FIRST_SEND_AFTER_S` sends nothing at all.
    """

    def __init__(self, mailboxes: Any, box: str, sender: _Sender) -> None:
        self._mailboxes, self._box = mailboxes, box
        self._sender = sender
        self._pending: list[Any] = []
        self._closed = False
        #: A batch taken from ``_pending`` whose actor call is not made yet.
        self._sending = False
        self._last: Any = None
        # The first send waits a little: the output of a cell that is over
        # by then goes back with its result, and costs no actor call.
        self._sent_at = time.monotonic() - SEND_EVERY_S + FIRST_SEND_AFTER_S
        #: How many items have gone to the mailbox.
        self.sent = 0
        sender.open(self)

    def put(self, item: Any) -> None:
        with self._sender.lock:
            self._pending.append(item)
            self._sender.changed.notify_all()

    def close(self) -> list[Any]:
        """Stop sending; what was never sent, for the task's result."""
        with self._sender.lock:
            self._closed = True
            self._sender.shut(self)
            # A batch already taken is sent before the count is read.
            while self._sending:
                self._sender.changed.wait()
            unsent, self._pending = self._pending, []
        return unsent

    def flush(self) -> None:
        """Send what is left and wait until the mailbox has it: for a task about to fail."""
        unsent = self.close()
        if unsent:
            self._last = self._mailboxes.put.remote(self._box, unsent)
            self.sent += len(unsent)
        if self._last is not None:
            import ray

            ray.get(self._last)

    def _due_in(self, now: float) -> float | None:
        """Seconds until this outbox's next batch may go; ``None`` with nothing to send."""
        if self._closed or self._sending or not self._pending:
            return None
        # A lone line goes at once; a burst waits out the interval since the
        # last send and goes as one batch.
        return self._sent_at + SEND_EVERY_S - now

    def _send(self, items: list[Any]) -> None:
        try:
            self._last = self._mailboxes.put.remote(self._box, items)
        finally:
            with self._sender.lock:
                self._sent_at = time.monotonic()
                self._sending = False
                self._sender.changed.notify_all()


class _Sender:
    """The one thread of a Ray worker process that sends its tasks' output.

    Started with the first task and kept for the next ones, as the cell's
    worker is: starting and joining a thread per task cost about a tenth of
    a millisecond of every claimed cell, and a thread asleep costs nothing.
    The process keeps it with the rest of what it keeps between tasks
    (:mod:`.task_side`).
    """

    def __init__(self) -> None:
        #: Taken as ``with lock``, not ``with changed``: a stop (``ray.cancel``)
        #: landing as ``Condition.__enter__`` (Python) returns would leave the
        #: lock held by no ``with``, and every later send waiting on it.
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._open: set[_Outbox] = set()
        self._thread: threading.Thread | None = None

    def open(self, outbox: _Outbox) -> None:
        with self.lock:
            self._open.add(outbox)
            self._thread = ensure_running(self._thread, self._loop, "fluksio-outbox")

    def shut(self, outbox: _Outbox) -> None:
        """Called with :attr:`changed` held."""
        self._open.discard(outbox)
        self.changed.notify_all()

    def _loop(self) -> None:
        while True:
            with self.lock:
                batch = None
                while batch is None:
                    now = time.monotonic()
                    soonest: float | None = None
                    for outbox in self._open:
                        due_in = outbox._due_in(now)
                        if due_in is None:
                            continue
                        if due_in <= 0:
                            batch = outbox
                            break
                        soonest = due_in if soonest is None else min(soonest, due_in)
                    if batch is None:
                        self.changed.wait(soonest)
                items, batch._pending = batch._pending, []
                # Counted before it goes: close() waits for the call to be
                # made before it reads the count.
                batch.sent += len(items)
                batch._sending = True
            batch._send(items)


@dataclass(frozen=True, slots=True)
class Sampled:
    """A reading of the task's worker, as its sampler took it."""

    reading: Sample


@dataclass(frozen=True, slots=True)
class Started:
    """The task's worker is running the cell: where, on which cards, with what."""

    facts: dict[str, Any]


#: What goes through the mailbox: the worker's output messages as the worker
#: sent them, and the task's own word on its worker.
Mail = Output | Sampled | Started


class _OutboxSink(Sink):
    """The worker's output, put in the outbox unchanged, in the order it was shown."""

    def __init__(self, outbox: _Outbox) -> None:
        self._outbox = outbox

    def forward(self, message: Output) -> None:
        self._outbox.put(message)
