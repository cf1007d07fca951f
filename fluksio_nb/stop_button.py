"""When the stop button lands: never halfway through what must be whole.

The stop button is a ``KeyboardInterrupt`` raised in the kernel's main
thread at the next moment Python checks for signals: as any function starts,
and as any call into C returns. So it can land halfway through a change to
the books (cores taken and no ticket holding them, or a ticket granted that
its caller never received), or after a claimed cell is over and before the
kernel has bound what it made. This module holds it back over such a stretch;
one that arrives meanwhile is raised as the stretch ends.

What it decides:

- **A change to the books is whole** (:func:`stop_held_back`): the stop
  lands after it, where the caller's cleanup can see what it has to give
  back. So is a claim's end, a worker's return to its pool, and a frame
  read from a worker. Waiting is never held back: a claim in the queue
  stops at once.
- **What is made is owned as it is made.** A descriptor, a shared-memory
  file or a worker's process is made under a hold that ends inside the
  ``try`` whose cleanup closes it: landing as the call that made it
  returned, the stop would leave it open with nothing holding its number.
  A bare descriptor is opened by :func:`open_whole`, which is that hold.
- **A claimed cell that is over keeps what it bound**
  (:func:`held_once_the_cell_is_over`, :func:`the_cell_is_over`). Once the
  cell's end reaches the kernel, its names are bound in the worker, as a
  normal cell's are in the kernel by its last line. What follows (the
  worker back to its pool, the share given back, the record, the names
  bound in the kernel) has nothing left to stop, and a stop landing in it
  lost the names. It lands once they are bound, as the magic ends. Unpacking
  the outputs is held too: it is the kernel's own work, at memory speed,
  and can be done once. A class whose unpickling never ends would hold the
  stop with it: a cell can make the kernel run such code, and the kernel
  then has to be restarted, as after a C call that never returns.

Only the main thread takes Python's signals, so only it holds them. The
handlers are swapped for one that writes the signal down, rather than the
signals masked: a mask holds back only the main thread's share of them. A
kernel has other threads, the signal goes to one of those, and Python runs
the handler in the main thread at its next bytecode, inside the stretch. For
the same reason a stop held back arrives again as Python's own arrival, not
as a signal: a mask would hold that back too, in a cell that blocks SIGINT or
in a Ray task's process, whose every thread blocks it.
"""

from __future__ import annotations

import _signal
import _thread
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

#: The signals that raise in the main thread while it is held: the stop
#: button's, and what a test or a timer uses in its place.
_HELD_BACK = (int(signal.SIGINT), int(signal.SIGALRM), int(signal.SIGTERM))

#: How deep the main thread is in a hold: a hold inside a claim's own
#: change holds the signals once, not twice.
_holding_depth = 0

#: The handlers a hold swapped out, and the signals that arrived since.
_Held = tuple[dict[int, Any], list[int]]

#: Where :func:`the_cell_is_over` leaves its hold, for the
#: :func:`held_once_the_cell_is_over` around it to end; None outside one.
_CELL_END: ContextVar[list[_Held] | None] = ContextVar("fluksio_nb_cell_end", default=None)


@contextmanager
def stop_held_back() -> Iterator[None]:
    """Hold the stop button back over what must be whole; it lands as that ends.

    A change to the books takes microseconds, or a line to their service; a
    claim's end gives the claim's processes half a second to go. The stop is
    late by that much at most. Never hold it over a wait with no end.
    """
    if not _may_hold():
        yield
        return
    held = _hold()
    try:
        yield
    finally:
        _land(held)


def open_whole(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
    """``os.open``, whole: the descriptor reaches the caller, or the stop lands with none open.

    A stop landing as ``os.open`` returned would leave the descriptor open
    with nothing holding its number. Held back over the open, it lands after
    it, once the descriptor is closed. Python checks for the stop as a call
    into C returns, never as a Python function returns, so the caller's
    ``fd = open_whole(...)`` is whole too: the ``try`` that closes it goes next.
    """
    fd = None
    try:
        with stop_held_back():
            fd = os.open(path, flags, mode, dir_fd=dir_fd)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return fd


@contextmanager
def held_once_the_cell_is_over() -> Iterator[None]:
    """Around a claimed cell: a stop from :func:`the_cell_is_over` on lands as this ends.

    Put where the cell's names are bound inside it, and nothing after.
    """
    slot: list[_Held] = []
    token = _CELL_END.set(slot)
    try:
        yield
    finally:
        _CELL_END.reset(token)
        if slot:
            _land(slot[0])


def the_cell_is_over() -> None:
    """The claimed cell's end has reached the kernel: hold the stop back from here on.

    Said as the end arrives, before its outputs are unpacked. Outside
    :func:`held_once_the_cell_is_over`, or off the main thread, it does
    nothing; inside :func:`stop_held_back` too, whose end would put back the
    handlers under this hold's feet.
    """
    slot = _CELL_END.get()
    if slot is None or slot or not _may_hold():
        return
    slot.append(_hold())


def _may_hold() -> bool:
    return not _holding_depth and threading.current_thread() is threading.main_thread()


def _hold() -> _Held:
    global _holding_depth
    # Every claim and give-back holds a few times, so the swap goes through
    # ``_signal``, the C functions under :mod:`signal`: the module's wrappers
    # turn every number into an enum and back, which cost more than the rest
    # of a claim's round trip to its books service together.
    arrived: list[int] = []

    def write_down(signum: int, _frame: Any) -> None:
        arrived.append(signum)

    before = {}
    for signum in _HELD_BACK:
        # A handler not set from Python cannot be put back from Python: leave it.
        if _signal.getsignal(signum) is not None:
            before[signum] = _signal.signal(signum, write_down)
    _holding_depth += 1
    return before, arrived


def _land(held: _Held) -> None:
    global _holding_depth
    _holding_depth -= 1
    before, arrived = held
    try:
        # The stop's own handler goes back last: a stop landing as it does
        # is raised there, with every other handler back in place.
        for signum in sorted(before, key=lambda signum: signum == signal.SIGINT):
            _signal.signal(signum, before[signum])
    finally:
        for signum in dict.fromkeys(arrived):
            _arrive_again(signum)


def _arrive_again(signum: int) -> None:
    """Have a signal that arrived during a hold arrive now, to the handler put back."""
    handler = _signal.getsignal(signum)
    if callable(handler):
        # As Python's own arrival, which no mask holds back: the process had
        # taken the signal already. Sent again as a signal, it would wait for
        # good in a main thread that blocks it, or in a Ray task's process,
        # whose every thread does; Ray's cancel was never a signal at all.
        _thread.interrupt_main(signum)
    elif handler == signal.SIG_DFL:
        # Only the OS can carry out the default action, such as ending the process.
        os.kill(os.getpid(), signum)
