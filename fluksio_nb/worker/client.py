"""The kernel's side of a worker: start it, run cells in it, stop it, say how it ended.

A claimed cell runs in a subprocess (:mod:`fluksio_nb.worker.main`) started with
the environment its share implies. This module is everything the kernel does
with that process, and it decides:

- **One thread does all the listening.** :meth:`Worker.run` waits on the
  channel and on the worker's stdout and stderr pipes with one selector, in the
  thread that called it, and hands the :class:`Sink` each output message
  (:mod:`fluksio_nb.worker.messages`) from that thread as it arrives. No
  reader threads means nothing to join, nothing racing the end of a cell, and
  a ``KeyboardInterrupt`` from the stop button lands exactly where the waiting
  happens. Python's own output arrives as messages, in order with everything
  else the cell shows. The pipes carry what child processes and C code write,
  passed on as :class:`~fluksio_nb.worker.messages.Stream` messages too; they
  are drained before each message is handled, which keeps that output close to
  where it was written. A message the stop lands on before it was acted on
  is read again by the stop ladder's listening, not lost: lost, the cell's
  end was never heard.
- **Stopping a cell is a decision taken here**, by :meth:`Worker.interrupt`
  or the stop button, with the ladder of :mod:`~fluksio_nb.worker.stopping`.
  A cell that stops at SIGINT leaves the worker usable; one that does not
  costs the worker.
- **A worker dying is an outcome, not an exception.** Segfault, ``os._exit``,
  the out-of-memory killer: :meth:`Worker.run` returns an :class:`Outcome` that
  says which, in a sentence a notebook can show. Only ``KeyboardInterrupt``
  (re-raised once the worker has been stopped) and :class:`UnsendableInput`
  (raised before anything starts) leave ``run`` as exceptions.
- **Nothing the worker started outlives it.** Killing or closing a worker
  ends everything it started and reaps it; how, safely, is
  :mod:`fluksio_nb.worker.process`'s to decide.

It is long because running a cell, relaying what it shows and stopping it
are one conversation over one cell's state, held by the thread that waits:
the stop ladder listens for the cell's end with the same loop that relays its
output. What could stand apart has, each in a module of its own in
:mod:`fluksio_nb.worker`: how values are packed, the messages, the process,
its pipes, the cell in flight, the stop ladder and what came of the cell.

POSIX only: process groups, ``killpg`` and ``select`` on pipes.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fluksio_nb.env import EnvironMark, differs_only_in_threads, worker_environ
from fluksio_nb.errors import Interrupted
from fluksio_nb.inventory import confine
from fluksio_nb.random_streams import SAME
from fluksio_nb.relay import kernels_cell_number, kernels_colors
from fluksio_nb.stop_button import stop_held_back, the_cell_is_over
from fluksio_nb.worker.cell import CellInFlight
from fluksio_nb.worker.messages import (
    ClearOutput,
    Display,
    Done,
    Error,
    Exit,
    InputReply,
    InputRequest,
    Message,
    Output,
    Ready,
    Reshape,
    Reshaped,
    Result,
    Run,
    Sending,
    SendingBack,
    Sink,
    Stream,
    Unpacked,
)
from fluksio_nb.worker.outcome import CellError, Outcome, how_it_died, how_it_ended
from fluksio_nb.worker.pipes import OutputPipe
from fluksio_nb.worker.process import WorkerProcess
from fluksio_nb.worker.protocol import Channel, ChannelClosed
from fluksio_nb.worker.stopping import stop_the_cell
from fluksio_nb.worker.values import lends_files, pack_inputs, unpack_outputs

#: How long :meth:`Worker.close` lets the worker exit by itself.
GRACE_TO_EXIT = 1.0
#: How long a worker whose channel closed has to exit, before it is taken to
#: have closed its end and lived on. One on its way out closes its channel
#: just before it exits, and is found exited at once.
CHANNEL_CLOSED_GRACE_S = 1.0
#: Why the kernel ended a worker that closed its channel and lived on.
CLOSED_ITS_CHANNEL = (
    "it closed its channel to the kernel and lived on: the cell closed file "
    "descriptors it had not opened (such as os.closerange), and the worker talks "
    "to the kernel through them"
)
#: When a worker died that ran the cell: the words a claim held by a block rewords.
RUNNING_THE_CELL = "while running the cell"

#: The longest the main thread blocks without looking for a pending SIGINT.
#: Any thread may take a signal sent to the process; Python then only flags
#: it for the main thread, which would sleep through the stop button until the
#: cell next printed something.
_SIGNAL_CHECK_SECONDS = 0.1


class WorkerMisuse(RuntimeError):
    """The worker was asked for something that cannot work the way it was asked."""


class Worker:
    """One worker process: a fresh Python with ``env``, running claimed cells one at a time.

    Construction starts the process and returns at once; the first
    :meth:`run` waits for it to be ready (about a quarter of a second, most of
    it importing IPython). ``env`` is what the share implies, laid over the
    kernel's own environment as it is at each cell (:meth:`_whole_environ`).
    ``cores``, when given, are the only cores it and everything it starts may
    run on. Between cells, :meth:`reshape` may give it another share's thread
    variables, which it takes only where every thread pool in it will hold them.

    :meth:`run` is for one thread at a time; :meth:`interrupt`, :meth:`kill`
    and :attr:`alive` are for any thread.
    """

    def __init__(
        self,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str] | None = None,
        cores: frozenset[int] | None = None,
    ):
        for name, value in env.items():
            if not isinstance(value, str):
                raise TypeError(
                    f"env[{name!r}] is {value!r}; a process environment holds only "
                    f"strings — pass str({value!r})"
                )
        self._derived = dict(env)
        #: The whole environment the worker was started with, or last reshaped to.
        self.env = self._whole_environ()
        self._run_lock = threading.Lock()
        self._cell: CellInFlight | None = None
        self._ready = False
        #: When the worker said it was ready (monotonic), once it has.
        self.ready_at: float | None = None
        #: What it held in memory then, before any cell: 0 until it is ready.
        self.held_when_ready = 0
        self._released = False
        #: The environment the worker holds for every cell, as last sent: only
        #: a change is sent again.
        self._environ_there: dict[str, str] = dict(self.env)
        #: The kernel's own environment when it was last compared.
        self._kernels_environ = EnvironMark()
        #: The random streams the worker holds as the kernel had them, by name.
        self._streams_there: dict[str, Any] = {}
        #: Whether the worker said it ends after its cell (``exit()`` in the cell).
        self._leaving = False
        #: Why this side is ending the worker, when it is, so its death is not
        #: reported as a crash.
        self._ending: str | None = None
        self._death: Outcome | None = None
        kernel_end, worker_end = socket.socketpair()
        try:
            self._process = WorkerProcess(self.env, cwd, worker_end)
        except BaseException:
            kernel_end.close()
            worker_end.close()
            raise
        try:
            worker_end.close()
            self.pid: int = self._process.pid
            # Before the worker has started a thread of its own: threads inherit
            # the mask of the thread that starts them, and this sets the main one's.
            confine(self.pid, cores)
            self._channel = Channel(kernel_end)
            self._streams = [
                OutputPipe("stdout", self._process.stdout),
                OutputPipe("stderr", self._process.stderr),
            ]
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._channel.sock, selectors.EVENT_READ, self._channel)
            for stream in self._streams:
                self._selector.register(stream.fd, selectors.EVENT_READ, stream)
        except BaseException:
            # Stopped, or failed, half made: nobody would end its process.
            with stop_held_back():
                self._process.end()
                self._process.close()
                self._process.stdout.close()
                self._process.stderr.close()
                kernel_end.close()
                if hasattr(self, "_selector"):
                    self._selector.close()
            raise

    def __repr__(self) -> str:
        return f"<Worker pid={self.pid} {'alive' if self.alive else 'ended'}>"

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        """Whether the worker can still run a cell."""
        return (
            not self._released
            and not self._leaving
            and not self._channel.broken
            and not self._process.has_exited()
        )

    # -- running cells ---------------------------------------------------------

    def run(
        self,
        code: str,
        inputs: Mapping[str, Any] | None = None,
        outputs: list[str] | None = None,
        sink: Sink | None = None,
        *,
        keep_outputs: bool = False,
        forward_outputs: bool = False,
        if_changed: Sequence[str] = (),
        random_state: dict[str, Any] | None = None,
        on_sending_back: Callable[[int, int, SendingBack], None] | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> Outcome:
        """Run ``code`` in the worker with ``inputs`` bound, and say how it went.

        ``outputs`` names the values to bring back; None brings back every
        name the cell bound. Output is relayed to ``sink`` as it arrives.
        Returns once the cell has ended, however it ended; a dead worker is an
        :class:`Outcome` with ``status="died"``. A ``KeyboardInterrupt`` in the
        calling thread stops the cell with :meth:`interrupt`'s ladder and is
        then re-raised. An exception raised by ``sink`` kills the worker — the
        cell's output has nowhere to go — and is re-raised. ``if_changed``
        names inputs to bring back too if the cell changed them in place
        (:func:`fluksio_nb.variables.choose_if_changed`). ``keep_outputs``
        lets the worker write big outputs into files it keeps for the next
        cell's, for a caller done with them before it runs another cell.
        ``forward_outputs`` leaves them packed, in the outcome's ``parcel``,
        for a caller that hands them to another process on this machine.
        ``random_state`` is put in place of the worker's global random streams
        before the cell (only where the worker's differ), and those the cell
        drew from are in the outcome. A variable the kernel set or dropped
        since the worker started is set or dropped in the worker too, as a
        normal cell would see it. ``on_sending_back(written, total, announced)``
        is called as the cell's code ends and its results start back, if it
        has any, with ``0, 0``; then, for results with big buffers, with their
        size in bytes and how much of it is written, as the writing goes;
        ``announced`` is the worker's :class:`SendingBack`: what is being
        sent and how big.
        ``on_sent()`` is called once the worker has the cell, from this thread,
        while the worker runs it.
        """
        sink = sink if sink is not None else Sink()
        parcel = pack_inputs(inputs or {})
        try:
            with self._run_lock:
                cell = CellInFlight(sink, forward=forward_outputs, on_sending_back=on_sending_back)
                cell.sent_in_bytes = parcel.moved_bytes
                self._cell = cell
                try:
                    request = Run(
                        code,
                        inputs=parcel,
                        outputs=outputs,
                        keep_outputs=keep_outputs,
                        # Mapped here in a moment, and held as long as the arrays are.
                        lend_outputs=not keep_outputs and not forward_outputs,
                        if_changed=list(if_changed),
                        random_state=self._streams_to_send(cell, random_state),
                        environ=self._environ_to_send(),
                        path=list(sys.path),
                        cwd=os.getcwd(),
                        execution_count=kernels_cell_number(),
                        colors=kernels_colors(),
                    )
                    return self._run(cell, request, on_sent)
                except KeyboardInterrupt:
                    self._stop_after_keyboard_interrupt(cell)
                    raise Interrupted(cell.outcome) from None
                except BaseException:
                    self.kill()
                    raise
                finally:
                    self._cell = None
                    cell.ended.set()
        finally:
            # From the moment it is packed, stopped even as the lock is taken:
            # unpacking removed the files if the worker got that far; if it
            # died first, or never had the cell, nobody else will.
            parcel.discard()

    def wait_until_ready(self, timeout: float = 30.0, sink: Sink | None = None) -> bool:
        """Block until the worker has started; False if it died or took longer than ``timeout``.

        Only needed to warm a worker up ahead of its first cell: :meth:`run`
        waits by itself.
        """
        with self._run_lock:
            if self._ready:
                return True
            if self._released:
                return False
            cell = CellInFlight(sink if sink is not None else Sink())
            outcome = self._follow(
                cell, deadline=time.monotonic() + timeout, until=lambda: self._ready
            )
            return self._ready and outcome is None

    def reshape(self, derived: Mapping[str, str], timeout: float = 30.0) -> str | None:
        """Give the worker another share's thread variables; None if it took them, else why not.

        ``derived`` may differ from the worker's own in its thread variables
        only. Between cells, and once the worker is ready (waited for, up to
        ``timeout``). A worker that refuses is as it was and stays usable; one
        that does not answer within ``timeout`` is killed.
        """
        wanted = dict(derived)
        if not differs_only_in_threads(wanted, self._derived):
            held = self._derived
            changed = sorted(n for n in {*wanted, *held} if wanted.get(n) != held.get(n))
            raise WorkerMisuse(
                f"a worker only takes another share's thread variables, not {changed}: "
                "start a worker with that environment instead"
            )
        deadline = time.monotonic() + timeout
        if not self.wait_until_ready(timeout):
            return "it did not start" if self._released else "it did not start in time"
        with self._run_lock:
            if not self.alive:
                return "it has ended"
            environ = self._whole_environ(wanted)
            cell = CellInFlight(Sink())
            try:
                self._channel.send(Reshape(environ))
                outcome = self._follow(
                    cell, deadline=deadline, until=lambda: cell.reshaped is not None
                )
            except ChannelClosed:
                outcome = self._died(cell)
            except BaseException:
                self.kill()
                raise
            if outcome is not None:
                return f"it ended: {outcome.died}"
            if cell.reshaped is None:
                self.kill()
                return f"it did not answer within {timeout:g} s"
            if cell.reshaped.refused is not None:
                return cell.reshaped.refused
            self._derived = wanted
            self.env, self._environ_there = dict(environ), environ
            self._kernels_environ.forget()
            return None

    def _whole_environ(self, derived: Mapping[str, str] | None = None) -> dict[str, str]:
        """The kernel's environment as it is now, the share's on top, and output unbuffered.

        Unbuffered, so that a ``print`` reaches the notebook while the cell is
        still running.
        """
        share = self._derived if derived is None else derived
        return {**worker_environ(share), "PYTHONUNBUFFERED": "1"}

    def _environ_to_send(self) -> dict[str, str] | None:
        """The whole environment for the worker to keep, if it differs from what it has."""
        # Building the whole environment was 2 % of a warm trivial claim.
        if self._kernels_environ.unmoved():
            return None
        wanted = self._whole_environ()
        self._kernels_environ.mark()
        if wanted == self._environ_there:
            return None
        self._environ_there = wanted
        return wanted

    def _streams_to_send(
        self, cell: CellInFlight, random_state: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """Each random stream, or :data:`SAME` where the worker holds it as it is here."""
        if random_state is None:
            # A cell not told of the streams may draw from them: nothing is known after it.
            self._streams_there = {}
            return None
        cell.streams_sent = random_state
        there = self._streams_there
        return {
            name: SAME if there.get(name) == state else state
            for name, state in random_state.items()
        }

    def _run(self, cell: CellInFlight, request: Run, on_sent: Callable[[], None] | None) -> Outcome:
        if self._death is not None:
            how = f"the worker had already ended: {self._death.died}"
            return Outcome("died", how, died=how, returncode=self._death.returncode)
        self._drain_streams(cell.show)
        frames_before = self._channel.frames_sent
        try:
            self._channel.send(request)
        except ChannelClosed:
            return self._died(cell)
        except KeyboardInterrupt:
            # Landed as the last of the cell went: the worker has it, and it
            # is stopped as a running cell is, its names kept.
            cell.sent = self._channel.frames_sent > frames_before
            raise
        cell.sent = True
        if on_sent is not None:
            on_sent()
        outcome = self._follow(cell)
        assert outcome is not None, "with no deadline, following a cell ends with an outcome"
        return outcome

    def _follow(
        self,
        cell: CellInFlight,
        deadline: float | None = None,
        until: Callable[[], bool] | None = None,
    ) -> Outcome | None:
        """Relay the cell's output until it ends; None if ``deadline`` came first.

        None too as soon as ``until()`` holds after a message (the worker is
        ready, say).
        """
        longest_wait = (
            _SIGNAL_CHECK_SECONDS if threading.current_thread() is threading.main_thread() else None
        )
        while True:
            timeout = longest_wait
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    return None
                if longest_wait is not None:
                    timeout = min(timeout, longest_wait)
            # One read before a stop that landed ahead of acting on it is first.
            frame_waiting = self._channel.has_next
            for key, _ in self._selector.select(0 if frame_waiting else timeout):
                if key.data is self._channel:
                    frame_waiting = True
                elif not key.data.drain(cell.show):
                    self._forget_stream(key.data)
            if not frame_waiting:
                continue
            # Whatever the worker wrote before sending this frame is in the
            # pipes by now, and belongs before it.
            self._drain_streams(cell.show)
            try:
                message = self._channel.next_message()
            except ChannelClosed:
                return self._died(cell)
            except Exception as error:
                # Whole, but not something this kernel can read: a worker of
                # another fluksio_nb. Skipped, its cell's end could be what
                # was lost, and the kernel would wait for it forever.
                self._ending = (
                    f"it sent a message this kernel cannot read ({error}): is it "
                    "running another version of fluksio_nb?"
                )
                return self._died(cell)
            outcome = self._take(message, cell)
            self._channel.taken()
            if outcome is not None:
                return outcome
            if until is not None and until():
                return None

    def _take(self, message: Message, cell: CellInFlight) -> Outcome | None:
        """Act on one message from the worker; the outcome if it was the cell's last."""
        match message:
            case Stream() | Display() | Result() | ClearOutput():
                cell.show(message)
            case Error():
                if cell.error is None:
                    cell.error = CellError(message.ename, message.evalue, message.traceback)
                cell.show(message)
            case InputRequest():
                # Asked once: the stop may land while the user is asked, and
                # the cell is then stopped, not asked again.
                self._channel.taken()
                self._answer(message, cell.sink)
            case Ready(resident_bytes=held):
                self._ready = True
                self.ready_at = time.monotonic()
                self.held_when_ready = held
            case Reshaped():
                cell.reshaped = message
            case SendingBack():
                cell.sending_since = time.monotonic()
                cell.sending_back = message
                if cell.on_sending_back is not None:
                    cell.on_sending_back(0, 0, message)
            case Sending(written=written, total=total):
                if cell.on_sending_back is not None and cell.sending_back is not None:
                    cell.on_sending_back(written, total, cell.sending_back)
            case Done():
                # The cell's names are the kernel's now: in a claimed cell, a
                # stop from here on lands once they are bound.
                the_cell_is_over()
                # Whole or not at all: its outputs can be unpacked once, and a
                # stop landing halfway would leave the message to be read again,
                # its files gone. Kept on the cell, the outcome outlives a stop
                # that lands after.
                with stop_held_back():
                    cell.over = True
                    self._drain_streams(cell.show)
                    self._channel.taken()
                    cell.outcome = self._finished(message, cell)
                return cell.outcome
        return None

    def _answer(self, request: InputRequest, sink: Sink) -> None:
        """Ask the sink what the cell's ``input()`` asks, and send the answer, or why none."""
        ask = getattr(sink, "input", None) or Sink().input
        try:
            reply = InputReply(value=ask(request.prompt, request.password))
        except Exception as error:
            # ipykernel's own refusal (a front end that takes no input) included.
            reply = InputReply(refused=str(error) or type(error).__name__)
        with contextlib.suppress(ChannelClosed):
            self._channel.send(reply)

    def _finished(self, done: Done, cell: CellInFlight) -> Outcome:
        self._leaving = done.exiting
        streams = done.random_state or None
        if cell.streams_sent is not None:
            # Known from now on: what was sent, as the cell left it, for each
            # stream the worker holds; one it never took up is sent again.
            held = {**cell.streams_sent, **(streams or {})}
            self._streams_there = {name: held[name] for name in done.streams_held}
        parcel = done.outputs
        values, unreadable = ({}, {}) if cell.forward else unpack_outputs(parcel)
        if parcel is not None and not cell.forward and not done.exiting and lends_files(parcel):
            # Mapped, and locked where lent: the worker may take its files back.
            # Values small enough to come inline lend none, and the worker is
            # not woken to hear so.
            with contextlib.suppress(ChannelClosed):
                self._channel.send(Unpacked())
        sent_s = None if cell.sending_since is None else time.monotonic() - cell.sending_since
        ok = done.ok
        error = None if ok else cell.error
        return Outcome(
            "ok" if ok else "error",
            how_it_ended(error, failed=not ok, interrupted=cell.interrupted),
            values,
            {**done.failed, **unreadable},
            tuple(done.absent),
            error=error,
            interrupted=cell.interrupted,
            random_state=streams,
            parcel=parcel if cell.forward else None,
            sent_s=sent_s,
            sent_bytes=0 if parcel is None else parcel.moved_bytes,
            sent_in_bytes=cell.sent_in_bytes,
            peak_bytes=done.peak_bytes,
        )

    def _died(self, cell: CellInFlight) -> Outcome:
        cell.over = True
        self._drain_streams(cell.show)
        if self._ending is None:
            try:
                self._process.wait_without_reaping(CHANNEL_CLOSED_GRACE_S)
            except subprocess.TimeoutExpired:
                # Ended here, not by the OOM killer, whose SIGKILL it would read as.
                self._ending = CLOSED_ITS_CHANNEL
        self._process.end()
        returncode = self._process.returncode
        if not self._ready:
            when = "while starting"
        elif not cell.sent:
            when = "between cells"
        else:
            when = RUNNING_THE_CELL
        how = how_it_died(returncode, when, self._ending, cell.escalated_to)
        self._death = Outcome(
            "died", how, died=how, returncode=returncode, interrupted=cell.interrupted
        )
        self._release()
        return self._death

    # -- stopping ------------------------------------------------------------------

    def interrupt(self) -> None:
        """Stop the running cell: SIGINT, then SIGTERM, then SIGKILL, as the stop ladder says.

        Returns once the cell has ended. If it ended at SIGINT the worker is
        still usable; otherwise it is dead and :attr:`alive` is False. The
        :meth:`run` in progress returns the matching :class:`Outcome`. Does
        nothing when no cell is running. From inside a sink callback, raise
        ``KeyboardInterrupt`` instead: the thread that would notice the cell
        ending is the one calling this.
        """
        cell = self._cell
        if cell is None or cell.ended.is_set():
            return
        if cell.thread == threading.get_ident():
            raise WorkerMisuse(
                "interrupt() was called from the thread running the cell, which "
                "would wait on itself — raise KeyboardInterrupt there instead"
            )
        stop_the_cell(self._process, cell, cell.ended.wait)

    def kill(self) -> None:
        """End the worker and every process it started, now, and reap it."""
        self._ending = self._ending or "kill() was called"
        self._process.end()
        if self._run_lock.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._run_lock.release()

    def close(self) -> None:
        """Ask the worker to exit, then end whatever it started, and reap it.

        A cell still running in another thread is not waited for: the worker
        is killed and that :meth:`run` returns ``status="died"``.
        """
        self._ending = self._ending or "close() was called"
        if not self._run_lock.acquire(blocking=False):
            self.kill()
            return
        try:
            # Found now: once the worker has exited, what it started under a
            # session of its own is nobody's descendant any more.
            strays = self._process.strays()
            if not self._released and not self._process.has_exited():
                with contextlib.suppress(ChannelClosed):
                    self._channel.send(Exit())
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait_without_reaping(GRACE_TO_EXIT)
            self._process.end(strays)
            self._release()
        finally:
            self._run_lock.release()

    def _stop_after_keyboard_interrupt(self, cell: CellInFlight) -> None:
        if not cell.sent or cell.over:
            if self._channel.broken:
                self.kill()
            return
        try:
            if self._released or self._channel.broken:
                # Interrupted halfway through a frame: the channel cannot be
                # read any more, so there is no hearing whether SIGINT worked.
                self.kill()
                return

            def cell_ended_within(seconds: float) -> bool:
                cell.outcome = self._follow(cell, deadline=time.monotonic() + seconds)
                return cell.outcome is not None

            stop_the_cell(self._process, cell, cell_ended_within)
            if cell.escalated_to:
                self.kill()
        except BaseException:
            self.kill()
            raise

    # -- the pipes and the end -------------------------------------------------------

    def _drain_streams(self, show: Callable[[Output], None]) -> None:
        for stream in list(self._streams):
            if not stream.drain(show):
                self._forget_stream(stream)

    def _forget_stream(self, stream: OutputPipe) -> None:
        self._selector.unregister(stream.fd)
        self._streams.remove(stream)
        stream.pipe.close()

    def _release(self) -> None:
        """Close this side's ends of everything; the worker must already be reaped."""
        if self._released:
            return
        self._released = True
        for stream in list(self._streams):
            self._forget_stream(stream)
        self._selector.close()
        self._channel.close()
        self._process.close()
