"""The longest one claim may run, as a machine's admin set it: warned near it, ended at it.

A shared machine's admin may cap how long one claim runs (``max_hours`` in
a user's cap, or ``"*"``'s, in ``machine.json``), as Slurm's partitions cap
a job's wall time: so that a card someone forgot in a running notebook comes
back to the queue on its own. Nothing but the books service can hold a claim
to that, since a kernel can be stopped, hung or changed by its user.

What it decides:

- **Counted from the grant**, as Slurm counts a job's time from its start:
  waiting in the queue costs a claim none of its time. A claim put back after
  the service restarted keeps the grant it had, so a restart gives nobody
  more time.
- **Warned once, at :data:`WARN_AT` of the limit**, in the owner's cell and
  in every view of the claim (:meth:`~fluksio_nb.machine.revoke.Stopping.warn_claim`),
  with the time it will be stopped at; **ended at the limit**
  (:meth:`~fluksio_nb.machine.revoke.Stopping.end_claim`), its record
  ending :data:`~fluksio_nb.records.TIME_LIMIT`. Each message names the limit
  and who set it, so nobody takes it for a crash or for the machine's doing.
- **Nothing fires for a claim that already ended**: its timers are cancelled
  as it leaves the books, and each checks that the claim is still the one it
  was set for, still running, and not already being stopped for another
  reason (an admin's cancel says why of its own).
- **The limit in force is the service's**, read from ``machine.json`` as it
  starts: an admin who changes it and restarts the service (``init``) holds
  every claim to the new one, those put back too, from their own grants. A
  claim already past a shortened limit is warned and stopped at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from fluksio_nb.records import TIME_LIMIT

if TYPE_CHECKING:
    from fluksio_nb.machine.books import Entry
    from fluksio_nb.machine.service import BooksService

#: The part of its limit a claim runs before its owner is warned: as a
#: JupyterHub culler's or Slurm's warning signal, enough to save work.
WARN_AT = 0.9


def hours_words(hours: float) -> str:
    """``1 h``, ``90 min``, ``5 s``: a limit as its admin would say it."""
    seconds = hours * 3600
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:.3g} s"


def run_words(seconds: float) -> str:
    """How long a claim has run, to the precision a person reads it."""
    if seconds < 60:
        return f"{seconds:.3g} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def time_limit_words(max_hours: float) -> str:
    """The limit and who set it, as every message about it says them."""
    return (
        f"the {hours_words(max_hours)} its user may hold a claim on this machine "
        f"(max_hours={max_hours:g} in the admin's machine.json)"
    )


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def warning_message(number: int, ran_s: float, max_hours: float, ends_at: float) -> str:
    return (
        f"claim {number} has run {run_words(ran_s)} of {time_limit_words(max_hours)}; "
        f"it is stopped at {_clock(ends_at)}"
    )


def stop_message(number: int, max_hours: float, ended_at: float) -> str:
    return (
        f"claim {number} reached {time_limit_words(max_hours)}, and was stopped at "
        f"{_clock(ended_at)}; ask for less work per claim, or the admin for a longer limit"
    )


class TimeLimits:
    """Each running claim's warning and end, due on the service's loop."""

    def __init__(self, service: BooksService) -> None:
        self.service = service
        #: Each timed claim's timers, by number: cancelled as it leaves the books.
        self._due: dict[int, tuple[asyncio.TimerHandle, ...]] = {}

    def granted(self, entry: Entry) -> None:
        """A claim began running (or was put back): its warning and its end are due."""
        cap = self.service.books.caps.get(entry.uid)
        if cap is None or cap.max_hours is None or entry.granted_at is None:
            return
        self.forget(entry.number)
        loop = asyncio.get_running_loop()
        limit_s = cap.max_hours * 3600
        # On the loop's clock, from the wall clock's grant: a put-back claim's
        # grant was made by the service before this one.
        in_s = entry.granted_at - time.time()
        self._due[entry.number] = (
            loop.call_later(max(0.0, in_s + WARN_AT * limit_s), self._warn, entry, cap.max_hours),
            loop.call_later(max(0.0, in_s + limit_s), self._end, entry, cap.max_hours),
        )

    def forget(self, number: int) -> None:
        """The claim left the books: nothing is due for it any more."""
        for handle in self._due.pop(number, ()):
            handle.cancel()

    def _still_running(self, entry: Entry) -> bool:
        return (
            self.service.books.entries.get(entry.number) is entry
            and entry.state == "running"
            and entry.cancel is None
        )

    def _warn(self, entry: Entry, max_hours: float) -> None:
        if not self._still_running(entry) or entry.granted_at is None:
            return
        ends_at = entry.granted_at + max_hours * 3600
        self.service.warn_claim(
            entry,
            warning_message(entry.number, time.time() - entry.granted_at, max_hours, ends_at),
        )

    def _end(self, entry: Entry, max_hours: float) -> None:
        self._due.pop(entry.number, None)
        if not self._still_running(entry):
            return
        self.service.end_claim(
            entry, stop_message(entry.number, max_hours, time.time()), TIME_LIMIT
        )
