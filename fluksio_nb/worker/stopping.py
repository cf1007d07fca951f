"""How a running cell is stopped: asked, then told, then killed, each after its grace.

The worker lives in a session of its own (:mod:`fluksio_nb.worker.process`),
so the SIGINT Jupyter's stop button sends the kernel does not reach it behind
the kernel's back: stopping a cell is the kernel's decision
(:meth:`~fluksio_nb.worker.client.Worker.interrupt`), and how is decided here:

- **SIGINT first, to the worker's whole process group.** A cell that stops
  at it leaves the worker usable.
- **SIGINT's grace is counted in the worker's chances to act, not by the
  clock** (:data:`GRACE_AFTER_SIGINT`): on a crowded machine a slow answer is
  still an answer. The clock bounds it all the same
  (:data:`GRACE_AFTER_SIGINT_AT_MOST`).
- **Then SIGTERM, then SIGKILL.** A cell that ignored being asked costs its
  worker, because it has left it in a state nobody can vouch for.

A Ray task is given as long to stop as this ladder can take
(:mod:`fluksio_nb.ray.claim`). A process a claim started (``c.popen``) is
ended with its group, SIGTERM then SIGKILL (:func:`end_process_group`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable

import psutil

from fluksio_nb.sampler import Chances
from fluksio_nb.worker.cell import CellInFlight
from fluksio_nb.worker.process import WorkerProcess

#: How long a cell gets to end by itself after SIGINT before SIGTERM follows,
#: counted in the worker's chances to act (:class:`~fluksio_nb.sampler.Chances`),
#: not by the clock. A Python cell in ``time.sleep`` or a numpy loop raises
#: KeyboardInterrupt within a millisecond, but a worker's first traceback took
#: 180-200 ms to format on an idle machine (IPython's traceback code is
#: imported then): at 0.3 s, a worker that had stopped was killed as deaf, and
#: what its cell had bound was lost with it. The rest is room for a
#: ``finally`` block to tidy up.
GRACE_AFTER_SIGINT = 1.5
#: The longest that grace lasts by the clock, however crowded the machine.
GRACE_AFTER_SIGINT_AT_MOST = 15.0
#: How often the worker's chances are read while it has its grace.
_CHANCES_EVERY_S = 0.1
#: And after SIGTERM, before SIGKILL.
GRACE_AFTER_SIGTERM = 0.3
#: SIGKILL cannot be refused, but a process stuck in the kernel (a hung NFS
#: read, a GPU driver call) only dies when that returns.
GRACE_AFTER_SIGKILL = 2.0


def stop_the_cell(
    process: WorkerProcess, cell: CellInFlight, cell_ended_within: Callable[[float], bool]
) -> None:
    """SIGINT to the worker's group, then SIGTERM, then SIGKILL, each if the cell outlived a grace.

    The signal past SIGINT is noted on the cell before it is sent, so that a
    death it causes is told as the ladder's doing.
    """
    cell.interrupted = True
    process.signal_group(signal.SIGINT)
    if _ended_given_its_chances(process, cell_ended_within):
        return
    cell.escalated_to = "SIGTERM"
    process.signal_group(signal.SIGTERM)
    if cell_ended_within(GRACE_AFTER_SIGTERM):
        return
    cell.escalated_to = "SIGKILL"
    process.signal_group(signal.SIGKILL)
    cell_ended_within(GRACE_AFTER_SIGKILL)


def _ended_given_its_chances(
    process: WorkerProcess, cell_ended_within: Callable[[float], bool]
) -> bool:
    """Whether the cell ended before the worker had had :data:`GRACE_AFTER_SIGINT` to end it."""
    chances = Chances(process.pid)
    latest = time.monotonic() + GRACE_AFTER_SIGINT_AT_MOST
    try:
        while True:
            left = GRACE_AFTER_SIGINT - chances.taken()
            if left <= 0 or time.monotonic() >= latest:
                return False
            if cell_ended_within(min(left, _CHANCES_EVERY_S)):
                return True
    finally:
        chances.close()


def end_process_group(process: subprocess.Popen, leads: bool) -> None:
    """SIGTERM the group the process leads, then SIGKILL whatever is left of it a moment later.

    The group goes whole: the leader, what it left running, and what it
    started as it ended. A process that shares a group (the kernel's own,
    with ``start_new_session=False``) goes alone: the group is not the
    claim's, and signalling it ended the kernel.
    """

    def send(sig: int) -> None:
        if not leads:
            process.send_signal(sig)  # nothing, once it has been waited for
        elif process.returncode is None or not psutil.pid_exists(process.pid):
            # Waited for, the leader's pid is free again only once its group is
            # empty: whoever has it since leads no group of ours.
            os.killpg(process.pid, sig)

    try:
        send(signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=0.5)
    with contextlib.suppress(ProcessLookupError):
        send(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
