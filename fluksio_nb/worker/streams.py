"""Python's own output in the worker: sent as messages, in order, and batched when it pours.

``print`` in a claimed cell goes to the kernel as a
:class:`~fluksio_nb.worker.messages.Stream` message on the same channel as
``display``, so the two arrive in the order the cell made them. The
process's real stdout and stderr are pipes the kernel relays, which is how
``!cmd``, ``os.system`` and C code writing to fd 1 are heard at all; those
arrive live, but not ordered against the messages.

It decides:

- **One line alone goes at once; a flood goes in batches.** A line ending
  after a quiet spell is sent as it is written, so a cell that prints and
  then works, or prints and then crashes, shows it. Lines that follow within
  :data:`BATCH_S` of a send wait, and go together at the end of that
  interval, as a notebook's own kernel sends its output: a loop printing
  20,000 lines sent 20,000 messages, each one a wake of the kernel and of
  the browser, and took 50 times as long as in a normal cell.
- **stdout and stderr keep their order.** Both streams share one outbox, and
  what was written first is sent first.
- **Nothing waits behind a message that is not output.** Before any other
  message (a display, an error, the cell's end) what is pending goes first
  (:func:`flush_streams`), and an explicit ``flush()`` sends at once.
- **An idle worker is not woken.** The thread that sends the batches sleeps
  without a timeout while nothing is pending.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from collections.abc import Callable

from fluksio_nb.worker.messages import Stream

#: How long lines written soon after a send wait to go together.
BATCH_S = 0.05


def flush_streams() -> None:
    """Send what ``sys.stdout`` and ``sys.stderr`` hold, ahead of a message that is not output."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class Outbox:
    """What the cell wrote to either stream and has not been sent, in the order written."""

    def __init__(self, send: Callable[[Stream], None]) -> None:
        self._send = send
        #: ``[name, [text, ...]]`` runs, oldest first; a run is one message.
        self._runs: list[tuple[str, list[str]]] = []
        self._start_afresh()
        self._batching = True
        threading.Thread(target=self._send_batches, name="fluksio-output", daemon=True).start()
        os.register_at_fork(after_in_child=self._in_a_forked_child)

    def _start_afresh(self) -> None:
        """New locks, and nothing sent or due yet."""
        self._lock = threading.Lock()
        # Held from taking the runs to the last one sent, so that a message
        # sent after a flush never overtakes text the flush took.
        self._sending = threading.Lock()
        self._sent_at = float("-inf")
        # Taken as ``with self._lock``, not ``with self._due``: a stop landing
        # as ``Condition.__enter__`` (Python) returns would leave the lock held
        # by no ``with``, and the cell's next print would wait for it for ever.
        self._due = threading.Condition(self._lock)
        self._batch_due = False

    def _in_a_forked_child(self) -> None:
        # A child forked by a cell (multiprocessing) has no thread to send its
        # batches, and may have been forked while that thread held a lock:
        # it sends each line as it ends, on locks of its own.
        self._start_afresh()
        self._batching = False

    def write(self, name: str, text: str) -> None:
        with self._lock:
            if self._runs and self._runs[-1][0] == name:
                self._runs[-1][1].append(text)
            else:
                self._runs.append((name, [text]))
        # "\r" too: a progress bar redraws its line without ever ending it.
        if "\n" not in text and "\r" not in text:
            return
        if not self._batching or time.monotonic() - self._sent_at >= BATCH_S:
            self.flush()
            return
        with self._lock:
            if not self._batch_due:
                self._batch_due = True
                self._due.notify()

    def flush(self) -> None:
        with self._sending:
            # Taken out before sending, so an interrupt raised once a frame is
            # out cannot leave the same text behind to be sent a second time.
            with self._lock:
                runs, self._runs = self._runs, []
            for name, texts in runs:
                self._send(Stream(name, "".join(texts)))  # type: ignore[arg-type]
            if runs:
                self._sent_at = time.monotonic()

    def _send_batches(self) -> None:
        while True:
            with self._lock:
                while not self._batch_due:
                    self._due.wait()
                self._batch_due = False
                wait_s = self._sent_at + BATCH_S - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)
            with contextlib.suppress(Exception):
                self.flush()


class FrameStream(io.TextIOBase):
    """``sys.stdout`` or ``sys.stderr`` in the worker: Python's own writes, sent as frames.

    :meth:`fileno` is the real descriptor — the pipe the kernel relays — so code
    that hands ``sys.stdout`` to a subprocess, or writes to it from C, is still
    heard, just without that ordering guarantee.
    """

    def __init__(self, name: str, fd: int, outbox: Outbox) -> None:
        super().__init__()
        self.name = name
        self._fd = fd
        self._outbox = outbox

    @property
    def encoding(self) -> str:
        return "utf-8"

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._outbox.write(self.name, text)
        return len(text)

    def flush(self) -> None:
        self._outbox.flush()
