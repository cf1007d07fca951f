"""What a claimed cell shows about itself while it waits, runs and ends.

A claimed cell can sit in a queue for minutes, and a cell that shows nothing
for minutes looks hung. So the cell always says where it is: waiting (for
what, at which place, behind whom), running (on which share, with the
worker's memory and CPU, and the card memory it holds on each of its cards
and how busy they are, where the cards are read), or done (how it ended,
how long it waited, ran and took to send its results back, and its peaks).

The facts live in :class:`ClaimStatus`, which the code running the claim
updates. How they are drawn is a :class:`StatusView`: this module's
:class:`TextView` is a plain display that is replaced in place, and the live
widget takes the same facts. Keeping the two apart is what lets the widget
take over without the runner knowing.

Each claim is said in one display, its record: when the claim ends, the
view's display is replaced by a line of text and HTML (:func:`status_bundle`)
that says how it ended, and nothing else is appended. That is what a notebook
saved and opened without its kernel shows, and nbconvert, GitHub and nbval
read, since none of them has a live view to ask. Why a claim failed is the
cell's error, said once, below it.

The statuses of this kernel's running claims are also kept here, by ticket
(:func:`running_statuses`), which is where the monitor finds their readings.
"""

from __future__ import annotations

import functools
import html
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from fluksio_nb.books import Allocation
from fluksio_nb.budget import Budget, human
from fluksio_nb.enforcement import CPUSET, Enforcement
from fluksio_nb.inventory import format_cpu_list
from fluksio_nb.queue import cards_words
from fluksio_nb.relay import new_display_id
from fluksio_nb.resources import Resources
from fluksio_nb.sampler import Readings
from fluksio_nb.vocabulary import NEVER_RAN, UNKNOWN_CLOCK, clock, mark_of, seconds, times_words

Phase = Literal["waiting", "running", "done"]

#: How a claim ended, in the words the status uses. ``"time limit"`` and
#: ``"idle cards"`` are the admin's rules (:data:`~fluksio_nb.records.BOOKS_ENDINGS`);
#: ``"timed out"``, the claim's own.
Ending = Literal[
    "ok",
    "error",
    "interrupted",
    "halted",
    "timed out",
    "died",
    "cancelled",
    "time limit",
    "idle cards",
]


@dataclass
class ClaimStatus:
    """Everything a view may show about one claim."""

    label: str
    asked: Resources
    phase: Phase = "waiting"
    ticket: int | None = None
    position: int | None = None
    #: Who holds what this claim waits for, as short descriptions.
    holders: list[str] = field(default_factory=list)
    allocation: Allocation | None = None
    budget: Budget | None = None
    readings: Readings = field(default_factory=Readings)
    asked_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    ended_at: float | None = None
    ending: Ending | None = None
    #: What the user should read about how it ended; empty when it just worked.
    message: str = ""
    #: What holds the claim to its memory budget: ``str()`` of it is
    #: ``"enforced (cgroup v1)"``, ``"enforced (cgroup v2)"`` or
    #: ``"watched every 0.5 s"``, and ``.why`` says why the kernel does not
    #: enforce it, when it does not. ``None`` until the claim runs.
    memory_enforcement: Enforcement | None = None
    #: What holds it to its cores: ``"own cores (cpuset)"``, ``"own cores
    #: (affinity)"`` (``.why`` says why no cpuset), or ``"thread variables"``
    #: with ``.why``. ``None`` until the claim runs.
    cores_enforcement: Enforcement | None = None
    #: What holds it to its cards: ``"devices cgroup v1"``, or
    #: ``"CUDA_VISIBLE_DEVICES only"`` with ``.why``. ``None``
    #: until the claim runs, and on a machine without cards.
    cards_enforcement: Enforcement | None = None
    #: How a slice of a card shares its compute, in the words of
    #: :mod:`fluksio_nb.card_compute`; ``""`` for whole cards, or none.
    card_compute: str = ""
    #: Amber: the claim reached its budget's warning stage (``memory_warn_at``)
    #: and the cell was told, once. It stays amber until the claim ends.
    memory_warning: bool = False
    #: What the books warn of while it runs, in their words (its time limit
    #: near); ``""`` when nothing.
    warning: str = ""
    #: When the work's process was found stopped by a signal (``SIGSTOP``, a
    #: debugger), as ``time.time()``; ``None`` while it runs.
    stopped_since: float | None = None
    #: How long the claim waited for new workers to start, all told.
    starting_s: float = 0.0
    #: While results are on their way back: since when (monotonic), and the
    #: bytes of their big buffers written so far and in all (0 until known).
    sending_since: float | None = None
    sending_written: int = 0
    sending_total: int = 0
    #: How long results took to come back, and the bytes copied to bring
    #: them, all told; and the bytes copied to send the inputs.
    sent_s: float | None = None
    sent_bytes: int = 0
    sent_in_bytes: int = 0
    #: Names the cell bound that could not come back to the kernel.
    not_back: list[str] = field(default_factory=list)
    #: While waiting: when it may start, in words, or why nobody can tell
    #: (:func:`fluksio_nb.expected_wait.describe_wait`); ``""`` until guessed.
    expected_wait: str = ""

    @property
    def elapsed_s(self) -> float:
        """From the share's grant to the end: running, then sending the results back."""
        if self.started_at is None:
            return 0.0
        return (self.ended_at or time.monotonic()) - self.started_at

    @property
    def ran_s(self) -> float:
        """The part of :attr:`elapsed_s` not spent starting workers or sending results back."""
        sending = 0.0 if self.sending_since is None else time.monotonic() - self.sending_since
        return max(0.0, self.elapsed_s - self.starting_s - (self.sent_s or 0.0) - sending)

    @property
    def waited_s(self) -> float:
        return (self.started_at or self.ended_at or time.monotonic()) - self.asked_at


#: Values smaller than this move in no time worth a word of their own.
SENT_BACK_SAID_FROM_BYTES = 1_000_000


def describe(status: ClaimStatus) -> str:
    """The status as one line of plain text.

    A claim that has ended is said in one line of facts: how it ended, the
    time waited, run and spent sending results back, the share and the peaks.
    Why it ended as it did is the cell's error, shown once, below it.
    """
    name = status.label
    if status.phase == "waiting":
        place = f"{ordinal(status.position)} in the queue" if status.position else "in the queue"
        behind = f", behind {', '.join(status.holders)}" if status.holders else ""
        guess = f"; {status.expected_wait}" if status.expected_wait else ""
        return (
            f"{name}: waiting for {status.asked.describe()}, {place}{behind} "
            f"({status.waited_s:.0f} s so far{guess})"
        )
    if status.phase == "done" and status.allocation is None:
        # Cancelled, timed out or stopped in the queue: it held no share and
        # ran nothing, so no share, memory or CPU is said of it.
        return f"{name}: {status.ending or 'done'} · " + " · ".join(
            times_words(status.waited_s, None)
        )
    share = _share(status)
    if status.phase == "running":
        warned = f" · {status.warning}" if status.warning else ""
        return f"{name}: {doing(status)} · {share}{_reading(status)}{warned}"
    ending = status.ending or "done"
    if status.not_back:
        ending += ", but not every name came back"
    # The same figures the claim's usage record keeps, for every other view of it.
    waited, ran = times_words(status.waited_s, status.ran_s)
    times = waited
    if status.sent_in_bytes >= SENT_BACK_SAID_FROM_BYTES:
        times += f", sent {human(status.sent_in_bytes)} in"
    if status.starting_s:
        times += f", started a worker in {seconds(status.starting_s)}"
    times += f", {ran}"
    if status.sent_s is not None and status.sent_bytes >= SENT_BACK_SAID_FROM_BYTES:
        times += f", sent {human(status.sent_bytes)} back in {seconds(status.sent_s)}"
    if not status.readings.count and not status.readings.peak_rss_bytes:
        # Over before its first reading: nothing was measured, which is not zero.
        return f"{name}: {ending} · {times} · {share} · no reading taken"
    peaks = (
        f"peak RSS {human(status.readings.peak_rss_bytes)}{_of_budget(status.budget)}, "
        f"mean CPU {status.readings.mean_cpu_percent:.0f}%"
    )
    if status.readings.peak_gpu_bytes is not None:
        # Only a claim whose cards were read has a peak: unknown is not zero.
        peaks += f", peak GPU {human(status.readings.peak_gpu_bytes)}"
    return f"{name}: {ending} · {times} · {share} · {peaks}"


def doing(status: ClaimStatus) -> str:
    """What a running claim is doing now, and for how long."""
    if status.stopped_since is not None:
        return (
            f"{stopped_text(status.stopped_since)} (SIGSTOP or a debugger: SIGCONT resumes it, "
            "the stop button ends it)"
        )
    if status.sending_since is not None:
        took = time.monotonic() - status.sending_since
        if status.sending_total:
            share = min(100, 100 * status.sending_written // status.sending_total)
            return f"sending {human(status.sending_total)} back, {share}% after {seconds(took)}"
        return f"sending results back, {seconds(took)} so far"
    return f"running for {seconds(status.elapsed_s)}"


def stopped_text(since: float | None) -> str:
    """``stopped by a signal since 14:02:11`` for a worker stopped (SIGSTOP) then; else ``""``."""
    if since is None:
        return ""
    at = clock(since)
    # Another user's kernel said when; a time no clock can show is not the view's end.
    return "stopped by a signal" if at == UNKNOWN_CLOCK else f"stopped by a signal since {at}"


def _reading(status: ClaimStatus) -> str:
    latest = status.readings.latest
    if latest is None:
        return ""
    reading = (
        f" · RSS {human(latest.rss_bytes)}{_of_budget(status.budget)}, "
        f"CPU {latest.cpu_percent:.0f}% of the machine"
    )
    if latest.cards:
        reading += f", {claim_gpu_text(status)}"
    return reading


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``11th``: a place in the queue as people say it."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def claim_gpu_text(status: ClaimStatus) -> str:
    """What the claim's own latest reading says of its cards; ``""`` where none was read."""
    latest = status.readings.latest
    if latest is None or not latest.cards:
        return ""
    cards = [(c.index, c.held_bytes, c.utilisation_percent) for c in latest.cards]
    return describe_gpu(cards, None if status.budget is None else status.budget.gpu_bytes)


def describe_gpu(
    cards: Iterable[tuple[int, int | None, float | None]], of_bytes: int | None = None
) -> str:
    """What a claim holds of each of its cards, and how busy each card is, in words.

    ``cards`` is ``(index, held bytes, utilisation percent)`` per card, as
    read; a figure that was not read is left out, never said as zero. For
    ``GPU 1.2GB of 4.0GB on card 0 (38% busy), 0B on card 1 (0% busy)``.
    """
    of = "" if of_bytes is None else f" of {human(of_bytes)}"
    words = []
    for index, held, busy in cards:
        said = "memory" if held is None else human(held)
        word = f"{said}{of} on card {index}"
        if busy is not None:
            word += f" ({busy:.0f}% busy)"
        words.append(word)
    return "GPU " + ", ".join(words)


def _share(status: ClaimStatus) -> str:
    """The share and, beside each resource, what holds the claim to it."""
    allocation = status.allocation
    if allocation is None:
        return NEVER_RAN
    words = [f"cpus={allocation.cpus}"]
    cores = status.cores_enforcement
    if cores is not None and cores.capped and allocation.cores:
        # Named only where a cell cannot re-pin itself off them: affinity it can.
        held = f", {CPUSET}" if cores.by == CPUSET else ""
        words[0] += f" (cores {format_cpu_list(allocation.cores)}{held})"
    elif cores is not None:
        words[0] += f" ({cores.label})" if cores.capped else f" ({cores.label} only)"
    held_to = status.cards_enforcement
    # Inside the cards' parentheses, as a cpuset is beside the cores.
    held = f", {held_to.label}" if held_to is not None and allocation.gpus else ""
    if allocation.gpus and allocation.gpu_bytes:
        compute = f", {status.card_compute}" if status.card_compute else ""
        words.append(
            f"a slice of card {allocation.gpus[0]} "
            f"(gpu_ram={human(allocation.gpu_bytes)}{compute}{held})"
        )
    elif allocation.gpus:
        words.append(f"{cards_words(allocation.gpus)[:-1]}{held})")
    # No cards, nothing said of them: as in every view of a claim.
    if allocation.ram_bytes:
        memory = status.memory_enforcement
        held = ""
        if memory is not None:
            held = f" (capped, {memory.by})" if memory.capped else f" ({memory.label})"
        words.append(f"ram={human(allocation.ram_bytes)}{held}")
    return " ".join(words)


def _of_budget(budget: Budget | None) -> str:
    if budget is None or budget.applied_bytes is None:
        return ""
    return f" of {human(budget.applied_bytes)}"


class StatusView(Protocol):
    """Something that draws a claim's status and is told when it changes.

    A view may also have ``end(status, in_place=True) -> bool``: put the
    record of how the claim ended (:func:`status_bundle`) in place of what it
    drew, and say whether it had drawn anything to put it in place of; with
    ``in_place`` false, blank what it drew and say False, for the record to be
    shown after the cell's output. A view without ``end`` is updated one last
    time, and the record is shown after it. A view may also have
    ``hold_the_place(output)``: draw a blank display in the cell at once, for
    the status and then the record to take, above all the cell's output.
    """

    def show(self, status: ClaimStatus) -> None: ...

    def update(self, status: ClaimStatus) -> None: ...


#: Each phase's mark beside the text. The text keeps the theme's own colour,
#: which JupyterLab's light and dark themes both hold above 4.5:1 against
#: their background; a coloured bar needs only 3:1 (WCAG 1.4.11), and the
#: fallbacks are for pages with no JupyterLab theme (nbconvert's HTML).
_MARKS = {
    "waiting": "var(--jp-warn-color1, #b26b00)",
    "running": "var(--jp-brand-color1, #1565c0)",
    "ok": "var(--jp-success-color1, #2e7d32)",
    "failed": "var(--jp-error-color1, #c62828)",
    "stopped": "var(--jp-warn-color1, #b26b00)",
}


#: The live widget's type (widget.css's ``.fluksio``), kept by the record that
#: replaces it: the same line does not grow from 12 px to 14 px as the claim ends.
RECORD_FONT = "font-family: var(--jp-ui-font-family, system-ui, sans-serif); font-size: 12px"


#: What a live view leaves where it was drawn when the record goes below the
#: cell's output instead: a display can be redrawn, not taken back.
NOTHING_SHOWN = {"text/plain": ""}


def status_bundle(status: ClaimStatus) -> dict[str, str]:
    """The status as a display's plain text and HTML; once ended, the claim's record."""
    text = describe(status)
    tone: str = status.phase
    if status.phase == "done":
        # One mark per ending in every view (vocabulary.MARKS): interrupted is amber everywhere.
        mark = "bad" if status.not_back else mark_of(status.ending)
        tone = {"good": "ok", "bad": "failed", "stopped": "stopped"}[mark]
    return {"text/plain": text, "text/html": marked_html(text, tone)}


def marked_html(text: str, tone: str) -> str:
    """``text`` as HTML with its tone's mark beside it: waiting, running, ok, failed, stopped."""
    # Labels and messages come from users and from cells: escaped, always.
    return (
        f'<div class="fluksio-status fluksio-{tone}" '
        f'style="border-left: 3px solid {_MARKS[tone]}; padding-left: 0.5em; {RECORD_FONT}">'
        f"{html.escape(text)}</div>"
    )


class TextView:
    """The status as a display that is redrawn in place, at most twice a second.

    Drawing is throttled because the sampler reads every half second and a
    waiting claim is told every time the queue moves; a notebook front end
    asked to redraw a hundred times a second stops answering the user.
    When the claim ends its display becomes the record (:meth:`end`).
    """

    MIN_INTERVAL_S = 0.5

    def __init__(self, output=None) -> None:
        #: Where to draw (a :class:`~fluksio_nb.relay.CellOutput`); by default
        #: the cell executing when :meth:`show` is first called.
        self._output = output
        self._shown = False
        #: A blank display holds the status's place (:meth:`hold_the_place`).
        self._placed = False
        self._ended = False
        self._display_id = new_display_id()
        self._last = 0.0
        #: The books' warning last drawn: a new one is drawn at once.
        self._warning = ""
        self._lock = threading.Lock()

    def show(self, status: ClaimStatus) -> None:
        """Draw the status in the cell executing now; once, later calls update it.

        Sent straight to that cell (see :mod:`fluksio_nb.relay`): IPython's own
        ``display`` first waits for the kernel to flush its streams, which cost
        a trivial claimed cell a third of its time.
        """
        from fluksio_nb.relay import CellOutput

        with self._lock:
            if self._ended:
                return
            if not self._shown:
                self._shown = True
                if self._placed:
                    self._output.update_display(status_bundle(status), self._display_id)
                else:
                    if self._output is None:
                        self._output = CellOutput()
                    self._output.display(status_bundle(status), display_id=self._display_id)
                self._last = time.monotonic()
                return
        self.update(status)

    def hold_the_place(self, output) -> None:
        """Take the cell's first place now, blank, for the status to be drawn in later.

        A claimed cell's status is drawn only once it has waited or run a
        moment; its output meanwhile went above it, and the rest below. Held
        from the claim's start, the status and then its record are above all
        the cell's output, as a background cell's are.
        """
        with self._lock:
            if self._shown or self._ended or self._placed:
                return
            self._output, self._placed = output, True
            output.display(NOTHING_SHOWN, display_id=self._display_id)

    def update(self, status: ClaimStatus) -> None:
        now = time.monotonic()
        with self._lock:
            if not self._shown or self._ended:
                return
            news = status.phase == "done" or status.warning != self._warning
            if not news and now - self._last < self.MIN_INTERVAL_S:
                return
            self._last, self._warning = now, status.warning
            self._output.update_display(status_bundle(status), self._display_id)

    def end(self, status: ClaimStatus, in_place: bool = True) -> bool:
        """Redraw as the record of how the claim ended; False if nothing was drawn there."""
        with self._lock:
            self._ended = True
            drawn = self._shown or self._placed
            if drawn:
                shown = status_bundle(status) if in_place else NOTHING_SHOWN
                self._output.leave_display(shown, self._display_id)
            return drawn and in_place


@functools.cache
def _anywidget_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("anywidget") is not None


def can_show_widgets() -> bool:
    """Whether live widgets can be drawn here: anywidget installed, and a kernel to talk to.

    A terminal IPython or a plain script has no front end for a widget to live
    in, and gets the text instead.
    """
    if not _anywidget_installed():
        return False
    from IPython.core.getipython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


# -----------------------------------------------------------------------------
# This kernel's running claims
# -----------------------------------------------------------------------------

# The monitor shows each running claim's readings. The queue knows who holds
# what, but only the claim knows how its worker is doing, so each claim's
# status is kept here, by ticket number, from when it is granted to its end.
_running: dict[int, ClaimStatus] = {}
_running_lock = threading.Lock()


def note_running(status: ClaimStatus) -> None:
    """Make a granted claim's status findable by its ticket number."""
    if status.ticket is not None:
        with _running_lock:
            _running[status.ticket] = status


def note_ended(status: ClaimStatus) -> None:
    """Forget a claim's status; safe for one never noted, and twice."""
    with _running_lock:
        if status.ticket is not None and _running.get(status.ticket) is status:
            del _running[status.ticket]


def running_statuses() -> dict[int, ClaimStatus]:
    """This kernel's running claims' statuses, by ticket number."""
    with _running_lock:
        return dict(_running)
