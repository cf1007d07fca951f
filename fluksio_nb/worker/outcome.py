"""What came of a claimed cell, in terms the notebook can act on and show.

A claimed cell can end in more ways than a normal one: besides finishing or
raising, its worker can die under it, and its outputs can fail to come back.
:meth:`fluksio_nb.worker.client.Worker.run` says which in one
:class:`Outcome`, and what is decided here is:

- **A dead worker is a status, not an exception**, so that whoever ran the
  cell decides what to raise.
- **Every ending is a sentence a notebook can show** (:func:`how_it_ended`,
  :func:`how_it_died`): an interrupted cell is not reported as one that
  raised, and a SIGKILL nobody here sent is named for what it most often is.
- **What did not come back is told apart**: values that could not travel
  (``failed``) from names the cell ended without (``absent``), which are only
  worth a warning when the user named them by hand.
- **The stop button is** :class:`~fluksio_nb.errors.Interrupted`, a ``KeyboardInterrupt`` that
  carries whatever the cell had bound when it stopped.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class CellError:
    """The exception a cell raised, as IPython formatted it in the worker."""

    ename: str
    evalue: str
    #: Lines with IPython's ANSI colours, as a notebook shows them.
    traceback: list[str]


@dataclass(frozen=True)
class Outcome:
    """How one cell ended, and what it handed back."""

    status: Literal["ok", "error", "died"]
    #: A sentence for the notebook: "the cell was interrupted", "the worker
    #: died from SIGSEGV (signal 11) while running the cell".
    description: str
    outputs: dict[str, Any] = field(default_factory=dict)
    #: Output names that did not come back, with the reason for each.
    failed: dict[str, str] = field(default_factory=dict)
    #: Output names the cell ended without, such as a name it deleted or only
    #: binds on a branch it did not take. Whether that is a failure is the
    #: caller's to say: it is if the user asked for the name by hand.
    absent: tuple[str, ...] = ()
    #: The first exception the cell raised, when it raised one.
    error: CellError | None = None
    #: How the worker died, as a sentence, when it did; None while it lives.
    died: str | None = None
    #: For a worker that died: its exit code, or minus the signal that ended it.
    returncode: int | None = None
    #: Whether :meth:`~fluksio_nb.worker.client.Worker.interrupt` (or a
    #: KeyboardInterrupt in ``run``) was
    #: applied to this cell.
    interrupted: bool = False
    #: The worker's global random streams after the cell, those the cell drew
    #: from (:mod:`fluksio_nb.random_streams`); None if it drew from none.
    random_state: dict[str, Any] | None = None
    #: The outputs as the worker packed them, for a caller that asked to
    #: forward them (``outputs`` is empty then); whoever ends up with it
    #: unpacks it or discards it.
    parcel: Any = None
    #: How long the results took from the end of the cell's code to being
    #: rebuilt here, and the bytes copied to bring them, which is less than
    #: their size where one went back on the file it came on; None with no results.
    sent_s: float | None = None
    sent_bytes: int = 0
    #: The bytes copied to send the cell its inputs.
    sent_in_bytes: int = 0
    #: The most the worker itself held in memory while the cell ran, exact
    #: however short the cell (:mod:`fluksio_nb.worker.peak`); 0 if unknown.
    peak_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def not_brought_back(self, by_hand: bool) -> dict[str, str]:
        """The names worth a warning, with why: those that could not travel,
        and those the cell ended without if the user named them by hand."""
        failed = dict(self.failed)
        if by_hand:
            failed.update({name: "the cell did not define it" for name in self.absent})
        return failed

    def warning(self, by_hand: bool) -> str:
        """What to tell the user of :meth:`not_brought_back`; ``""`` when all came back."""
        failed = self.not_brought_back(by_hand)
        if not failed:
            return ""
        lines = "".join(f"  {name}: {reason}\n" for name, reason in sorted(failed.items()))
        return f"fluksio_nb: these names could not be brought back:\n{lines}"

    @property
    def signal_name(self) -> str | None:
        """``"SIGSEGV"`` for a worker a signal ended, else None."""
        if self.returncode is None or self.returncode >= 0:
            return None
        return signal_name(-self.returncode)


def how_it_ended(error: CellError | None, failed: bool, interrupted: bool) -> str:
    """The sentence for a cell its worker saw to the end."""
    if not failed:
        return "the cell finished"
    if error is None:
        return "the cell failed without saying why"
    if interrupted and error.ename == "KeyboardInterrupt":
        return "the cell was interrupted"
    return f"the cell raised {error.ename}: {error.evalue}"


def how_it_died(
    returncode: int | None, when: str, ending: str | None, escalated_to: str | None
) -> str:
    """The sentence for a worker that died ``when`` ("while running the cell").

    ``ending`` is why the kernel ended it, if it did; ``escalated_to`` the
    signal the stop button's ladder had to reach, if it went past SIGINT.
    """
    if ending:
        return f"the worker was ended {when}, because {ending}"
    if escalated_to:
        return (
            f"the cell did not stop when interrupted, so the worker was ended with {escalated_to}"
        )
    if returncode is None:
        return f"the worker closed its channel {when}"
    if returncode >= 0:
        return f"the worker exited with code {returncode} {when}"
    number = -returncode
    how = f"the worker died from {signal_name(number)} (signal {number}) {when}"
    if number == signal.SIGKILL:
        how += (
            " — a SIGKILL nobody here sent is most often the out-of-memory "
            "killer; claim more ram= or make the cell use less"
        )
    return how


def signal_name(number: int) -> str:
    """``"SIGSEGV"`` for 11; a number Python has no name for, as a number."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
