"""A claim's life, whatever runs it: wait, show, run, end, give back.

A claim on this machine (:mod:`fluksio_nb.local_claim`) and a claim on a Ray
cluster (:mod:`fluksio_nb.ray.claim`) must read the same to the user: the same
status while they wait, the same live view once they run, the same record
left behind however they end, and the same ``with`` block, ``c.run`` and
``c.readings``. So that is written once, here, in :class:`ClaimLifecycle`,
and a place to run a claim says only how it acquires its share
(:meth:`~ClaimLifecycle.acquire`), how it runs code in it
(:meth:`~ClaimLifecycle.run_code`), how it gives it back
(:meth:`~ClaimLifecycle._give_back`) and how it is cancelled.

What this module decides:

- **How it ended is one word and one paragraph** (:func:`ending_of`,
  :func:`message_of`): the stop button is "interrupted", a memory halt
  "halted", and so on, whichever place ran the claim.
- **A claim leaves one record, as text**: its live view, if there was one,
  is replaced by it, never followed by it. It is what a saved notebook shows
  without its widgets, and what nbval compares. A claim that was over before
  its live view was due shows only the record (:data:`SHOW_AFTER_S`).
- **``c.run(fn, ...)`` is a one-line claimed cell** (:func:`call_through`):
  the function and its arguments travel as the cell's inputs and its result as
  the cell's one output, so it needs nothing a place to run does not already
  do for a cell.
- **A block left without its ``__exit__`` gives its share back as the cell
  ends** (:func:`_blocks_left_without_exit`). Python checks for the stop as
  a function starts, before its first line, where no hold can reach: landing
  as a block's ``__exit__`` starts, it leaves the block gone and its share
  held, whether the cell raises the stop or catches it. Once the cell is
  over, a block whose ``with`` statement is no longer running is over too,
  and is ended as the stop would have ended it. A block entered by hand
  (``c.__enter__()``) or in a generator may rightly outlive the cell, and
  is left to its holder.
"""

from __future__ import annotations

import dis
import inspect
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from fluksio_nb.books import Allocation
from fluksio_nb.budget import Budget
from fluksio_nb.errors import (
    ClaimCancelled,
    ClaimHalted,
    ClaimTimeout,
    Interrupted,
    RemoteError,
    UnsendableInput,
    WorkerDied,
)
from fluksio_nb.pickling import global_to_blame, why_it_cannot_travel
from fluksio_nb.relay import CellOutput, ForegroundOutput
from fluksio_nb.resources import Resources
from fluksio_nb.sampler import Readings
from fluksio_nb.status import ClaimStatus, Ending, StatusView, TextView
from fluksio_nb.stop_button import held_once_the_cell_is_over, stop_held_back
from fluksio_nb.worker.client import Outcome

#: How long a claim waits before it is shown waiting. A running claim is shown
#: at its first reading, one sampling interval in. A cell done sooner shows
#: only its record: a live view of a cell that is over before anyone could
#: read it costs more than the cell (measured: most of a trivial claimed
#: cell's time went to drawing it).
SHOW_AFTER_S = 0.25


class ClaimLifecycle(ABC):
    """A share held from :meth:`acquire` until :meth:`release`, shown as it goes.

    Subclasses say how to acquire, run, give back and cancel; the status, the
    view, the record, the ``with`` block and :meth:`run` are the same for all.
    """

    def __init__(
        self,
        wanted: Resources,
        *,
        label: str,
        view: StatusView | None,
        show_after: float | None,
    ) -> None:
        self.wanted = wanted
        self.status = ClaimStatus(label=wanted.label or label, asked=wanted)
        #: What was granted, once it was.
        self.allocation: Allocation | None = None
        #: The variables the claim's work runs with, derived from the share.
        self.env: dict[str, str] = {}
        self.budget: Budget | None = None
        self._view = view
        #: ``None``: shown at once; else shown once it has waited this long,
        #: or at its first reading.
        self._show_after = show_after
        self._shown = False
        #: The view holds its place above the cell's output from the claim's start.
        self._placed = False
        #: The cell cleared its output after the view was drawn: the view is gone.
        self._view_cleared = False
        #: The cell showed output after the view was drawn: it is above that output.
        self._output_after_view = False
        #: Where the record goes when no view was drawn to hold it: the cell
        #: that asked (see :meth:`_remember_the_cell`).
        self._cell: CellOutput | None = None
        self._lock = threading.Lock()
        #: Why the claim was stopped from outside its work, if it was:
        #: how it ended, the paragraph that says so, and the halt behind it.
        self._stop_reason: tuple[Ending, str, Any] | None = None
        #: What ended the block or call that released the claim, once it is released.
        self._released_with: BaseException | None = None

    # -- what a place to run says -------------------------------------------------

    #: How the "cannot send" message names where the inputs were going.
    reached_as = "the worker"

    #: Held by a ``with claim()`` block rather than a ``%%claim`` cell: what
    #: its messages tell the user to change (``timeout=`` or ``--timeout``),
    #: and what a worker's death leaves (the block still holds the share).
    held_by_a_block = False

    @property
    def timeout_option(self) -> str:
        """How the user gave this claim its timeout: ``timeout=`` or ``--timeout``."""
        return "timeout=" if self.held_by_a_block else "--timeout"

    def asking_more_time(self) -> str:
        """The end of a timeout's message: what to raise, and what to make do less."""
        doing = "each c.run" if self.held_by_a_block else "the cell"
        return f"Raise {self.timeout_option}, or make {doing} do less."

    def after_a_death(self) -> str:
        """The end of a dead worker's message: where that leaves the share."""
        if self.held_by_a_block:
            return "The block still holds its share, and its next c.run starts a fresh worker."
        return "Its share was given back; run the cell again."

    @classmethod
    @abstractmethod
    def for_block(cls, wanted: Resources, on: str | None, *, view: StatusView | None) -> Any:
        """The claim a ``with claim(...)`` block holds from entry to exit."""

    @classmethod
    @abstractmethod
    def for_cell(
        cls, wanted: Resources, on: str | None, *, view: StatusView, show_after: float | None
    ) -> Any:
        """The claim a ``%%claim`` cell runs under; ``show_after=None`` shows it at once."""

    @staticmethod
    @abstractmethod
    def pack_inputs(values: Mapping[str, object]) -> Any:
        """A cell's inputs packed to travel, with ``.failures`` by name and ``.discard()``."""

    @abstractmethod
    def take_place(self) -> None:
        """What is settled before a background cell's handle returns; :meth:`acquire` does it too.

        A place to run refuses here what it can never hold, as a
        :class:`~fluksio_nb.errors.BadClaim`, and a local claim joins its
        queue, so that background cells started in order are granted in order.
        """

    @abstractmethod
    def acquire(self) -> ClaimLifecycle:
        """Wait for the share, showing where the claim stands while it waits."""

    @abstractmethod
    def run_code(
        self,
        code: str,
        inputs: Any,
        outputs: Sequence[str] | None,
        sink: Any,
        *,
        if_changed: Sequence[str] = (),
        random_state: dict[str, Any] | None = None,
    ) -> Outcome:
        """Run notebook code holding this share; raise how it failed.

        ``if_changed`` names inputs to bring back too if the code changed them in
        place; ``random_state`` is the global random streams the code draws from
        (:mod:`fluksio_nb.random_streams`).
        """

    @abstractmethod
    def cancel(self, reason: str) -> bool:
        """Leave the queue, or stop the work if it is running. False if there is nothing to stop."""

    @abstractmethod
    def popen(self, args: Any, **kwargs: Any) -> Any:
        """A subprocess holding this share, where the place to run can start one here."""

    @abstractmethod
    def _give_back(self) -> None:
        """End what the claim started and hand its share back; :meth:`release` calls it."""

    @property
    @abstractmethod
    def granted_at(self) -> float | None:
        """When the share was granted (``time.time()``), if it has been."""

    # -- the same for every place -------------------------------------------------

    @property
    def readings(self) -> Readings:
        """The latest, peak and mean readings of everything this claim ran."""
        return self.status.readings

    def release(self, error: BaseException | None = None) -> None:
        """Give the share back and end everything this claim started; say how it went.

        A stop pressed meanwhile lands once all that is done: pressed twice, the
        second stop came while the first one's cleanup gave the claim's processes
        their half second to end, and left the share held for the rest of the
        kernel's life, and the processes running.
        """
        with stop_held_back():
            # Read by _give_back, which tells the books how the claim ended.
            self._released_with = error
            # Given back before its record is written: a kernel killed in between
            # leaves its claim out of the books, so nobody records it for the dead
            # kernel too. Once, or (in that instant) not at all; never twice.
            self._give_back()
            if self.status.phase == "done":
                return
            if self._stop_reason is not None:
                ending, message, _ = self._stop_reason
                self._end(ending, message)
            elif error is None:
                self._end("ok", "")
            else:
                self._end(ending_of(error), message_of(error))

    def ending_now(self) -> Ending:
        """How the claim ends, as far as is known now: its stop, or what its release was given."""
        if self._stop_reason is not None:
            return self._stop_reason[0]
        error = self._released_with
        return "ok" if error is None else ending_of(error)

    def __enter__(self) -> ClaimLifecycle:
        self._refuse_once_ended()
        if self.held_by_a_block:
            # Before the share is taken: a stop landing after it, as a call
            # returns here, would leave the share held by a block never entered.
            _note_the_block(self, sys._getframe(1))
        try:
            return self.acquire()
        except BaseException:
            _open_blocks.pop(id(self), None)
            raise

    def __exit__(self, kind, error, traceback) -> None:
        try:
            self.release(error)
        except KeyboardInterrupt as stop:
            if self.status.phase != "done":
                # It landed before the release could hold it back (as the
                # release started): the share is still held, and no `with`
                # is left to give it back. A stop landing as this __exit__
                # itself starts, before any line of it runs, is caught up
                # with as the cell ends (_blocks_left_without_exit).
                self.release(stop)
            raise
        finally:
            _open_blocks.pop(id(self), None)

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` holding this share; return its result."""
        self._refuse_once_ended()
        # Its error is raised here, to be caught or shown as any call's is:
        # sent to the cell as well, a caught one would still show in red.
        # A stop that lands once the call is over lands as it returns, after
        # its worker is back in the pool and its arguments' memory given back:
        # the result is lost then, as any call's is to a stop as it returns.
        with held_once_the_cell_is_over():
            return call_through(
                self.run_code, ForegroundOutput(), fn, args, kwargs, self.reached_as
            )

    def _refuse_once_ended(self) -> None:
        """Refuse work for a claim that has ended: its share is back in the books."""
        if self.status.phase == "done":
            raise RuntimeError(
                f"{self.status.label} has ended, and its share went back to the books when "
                "its `with` block did: a claim is held once. Make a new claim(...) for more work"
            )

    # -- showing --------------------------------------------------------------------

    def _remember_the_cell(self) -> None:
        """Aim the record at the cell that asked: called from that cell, as the claim starts.

        A background claim's record belongs there, not in whichever cell is
        running when it ends.
        """
        self._cell = CellOutput()
        hold = getattr(self._view, "hold_the_place", None)
        if hold is not None:
            # The status, then the record, above all the cell's output, in
            # every cell: one drawn later went below what the cell printed first.
            hold(self._cell)
            self._placed = True

    def _show(self) -> None:
        with self._lock:
            if self._shown or self._view is None:
                return
            self._shown = True
        self._view.show(self.status)

    def _update_view(self) -> None:
        if self._view is not None and self._shown:
            self._view.update(self.status)

    def _end(self, ending: Ending, message: str) -> None:
        self.status.phase, self.status.ending, self.status.message = "done", ending, message
        self.status.ended_at = time.monotonic()
        if self.status.started_at is None:
            self.status.started_at = self.status.ended_at
        self._ended(ending)
        if self._view is None or self._cell is None:
            return
        with self._lock:
            # A live view due now is not drawn: the record takes its place.
            self._shown = True
        end = getattr(self._view, "end", None)
        # In the view's place, above all the cell's output, where the view
        # held it from the claim's start (or was drawn at once, as a
        # --background cell's is): the one place that a notebook saved by
        # nbclient, which reads no output sent after the cell ended, can show.
        # A view that held no place and came after output goes below it all.
        in_place = self._placed or self._show_after is None or not self._output_after_view
        if end is not None and not self._view_cleared and end(self.status, in_place=in_place):
            return
        if end is None:
            self._view.update(self.status)
        # Over before anything was drawn, drawn above output that came after,
        # or cleared by the cell: the record is the cell's one display.
        TextView(self._cell).show(self.status)

    def telling_of_clears(self, sink: Any) -> Any:
        """``sink``, which also tells this claim of output after its view and of clears."""
        return _ClearsTold(sink, self._cleared, self._output_came)

    def _cleared(self) -> None:
        with self._lock:
            if self._shown or self._placed:
                self._view_cleared = True

    def _output_came(self) -> None:
        if self._shown and not self._output_after_view:
            with self._lock:
                self._output_after_view = True

    def _ended(self, ending: Ending) -> None:  # noqa: B027 (a hook; most places need none)
        """What a place to run does as the claim ends, before its record: by default nothing."""


class _ClearsTold:
    """A cell's sink, passed on whole; its claim hears of new output and of clears."""

    #: The sink's calls that add an output to the cell, rather than redraw one.
    ADDING = frozenset({"stdout", "stderr", "display", "result", "error"})

    def __init__(
        self, sink: Any, told: Callable[[], None], output_came: Callable[[], None]
    ) -> None:
        self._sink, self._told, self._output_came = sink, told, output_came

    def __getattr__(self, name: str) -> Any:
        passed = getattr(self._sink, name)
        if name not in self.ADDING:
            return passed

        def adding(*args: Any, **kwargs: Any) -> Any:
            self._output_came()
            return passed(*args, **kwargs)

        return adding

    def clear_output(self, wait: bool = False) -> None:
        clear_output = getattr(self._sink, "clear_output", None)
        if clear_output is not None:
            clear_output(wait)
        self._told()


def ending_of(error: BaseException) -> Ending:
    """The one word for how a claim that raised ``error`` ended."""
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, ClaimHalted):
        return "halted"
    if isinstance(error, ClaimTimeout):
        return "timed out"
    if isinstance(error, ClaimCancelled):
        return "cancelled"
    if isinstance(error, WorkerDied):
        return "died"
    return "error"


def message_of(error: BaseException) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted by the user"
    return str(error)


def cell_raised(
    ename: str, evalue: str, traceback: list[str], outcome: Outcome
) -> RemoteError | Interrupted:
    """What the kernel raises for a claimed cell that raised, wherever it ran.

    The stop button is an interrupt, as in a normal cell; anything else is the
    cell's own error. Either carries what the cell had bound.
    """
    if ename == "KeyboardInterrupt":
        return Interrupted(outcome)
    return RemoteError(ename, evalue, traceback, outcome)


def call_through(
    run_code: Callable[..., Outcome],
    sink: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    to: str = "the worker",
) -> Any:
    """``fn(*args, **kwargs)`` as a one-line claimed cell run by ``run_code``; its result.

    ``to`` names where the call goes, for the refusal of one that cannot.
    """
    try:
        outcome = run_code(
            "__fluksio_result__ = __fluksio_fn__(*__fluksio_args__, **__fluksio_kwargs__)",
            {"__fluksio_fn__": fn, "__fluksio_args__": args, "__fluksio_kwargs__": dict(kwargs)},
            ["__fluksio_result__"],
            sink,
        )
    except UnsendableInput as refused:
        raise UnsendableInput(_call_refused(refused, to, fn, args, kwargs)) from None
    if "__fluksio_result__" in outcome.failed:
        raise RemoteError(
            "TransferError",
            f"the result could not be sent back: {outcome.failed['__fluksio_result__']}",
            [],
        )
    return outcome.outputs["__fluksio_result__"]


def _call_refused(
    refused: UnsendableInput,
    to: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> str:
    """What ``c.run`` could not send, named as the caller wrote it: never by our own names."""
    if refused.name == "__fluksio_fn__":
        what = f"the function {getattr(fn, '__qualname__', None) or repr(fn)}"
        if (blamed := global_to_blame(fn)) is not None:
            name, why = blamed
            return (
                f"c.run cannot send {what} to {to}: it reads the global '{name}', which cannot "
                f"travel ({why}). Make '{name}' inside the function, or pass what it needs."
            )
        return f"c.run cannot send {what} to {to} ({refused.reason})."
    named = [(f"argument {i + 1}", value) for i, value in enumerate(args)]
    named += [(f"argument {key}=", value) for key, value in kwargs.items()]
    for which, value in named:
        if (why := why_it_cannot_travel(value)) is not None:
            return (
                f"c.run cannot send its {which}, a {type(value).__name__}, to {to} ({why}). "
                "Make it inside the function instead."
            )
    return f"c.run cannot send its arguments to {to} ({refused.reason})."


#: The opcode of a ``with`` statement entering its block: a block entered by
#: a call to ``__enter__`` is its caller's to end. Python 3.14 enters a block
#: by a plain call, so there no block is noted, and one cut short keeps its
#: share as before.
_BEFORE_WITH = dis.opmap.get("BEFORE_WITH")

#: A generator's or a coroutine's frame can be suspended with its block open.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

#: Blocks a ``with`` statement on the main thread entered and no ``__exit__``
#: has left yet, by the claim's id: the claim, and the statement's frame.
_open_blocks: dict[int, tuple[ClaimLifecycle, FrameType]] = {}

#: The IPython shells already told to look for blocks left without ``__exit__``.
_looking: set[int] = set()


def _note_the_block(claim: ClaimLifecycle, frame: FrameType) -> None:
    """Keep a block entered by a ``with`` statement on the main thread, until its ``__exit__``."""
    if (
        frame.f_code.co_code[frame.f_lasti] != _BEFORE_WITH
        or frame.f_code.co_flags & _SUSPENDABLE
        or threading.current_thread() is not threading.main_thread()
        or not _looked_at_as_each_cell_ends()
    ):
        return
    # Last, and no call after it: noted means the caller's `try` is next.
    _open_blocks[id(claim)] = (claim, frame)


def _looked_at_as_each_cell_ends() -> bool:
    """Have IPython call :func:`_blocks_left_without_exit` after every cell; False outside IPython.

    Only IPython knows when a cell is over. Outside it, a stop landing as an
    ``__exit__`` starts usually ends the program, and the books reclaim a
    share whose holder is gone.
    """
    shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    if shell is None:
        return False
    if id(shell) not in _looking:
        _looking.add(id(shell))
        shell.events.register("post_run_cell", _blocks_left_without_exit)
    return True


def _blocks_left_without_exit(result: Any) -> None:
    """End each block whose ``with`` statement ended before ``__exit__`` gave its share back."""
    if not _open_blocks:
        return
    # A cell run from inside a block, by `get_ipython().run_cell`, ends
    # with the block's statement still running below it.
    running, below = set(), sys._getframe()
    while below is not None:
        running.add(id(below))
        below = below.f_back
    # The cell's own error, if it raised; if it caught what cut the block
    # short, that was all but surely the stop, the one thing that lands there.
    error = getattr(result, "error_in_exec", None) or KeyboardInterrupt()
    for key, (claim, statement) in list(_open_blocks.items()):
        if id(statement) in running:
            continue
        if claim.status.phase != "done":
            claim.release(error)
        # Only once it is back: a stop landing as the release starts leaves
        # the block to the next cell's end.
        del _open_blocks[key]
