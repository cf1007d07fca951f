"""The live widgets: a claimed cell's status, and the machine's monitor (``%claims``).

A claimed cell can wait minutes and run for hours; a line of text redrawn in
place says where it is, but not whether its memory is creeping up on its
budget, nor who else holds the machine. These widgets show that, live.

What is decided here:

- **The front end is one committed ES module and one stylesheet**
  (``widget.js``, ``widget.css``) loaded by anywidget. No build step and no
  dependency, nothing fetched from a CDN, and it runs wherever anywidget
  does: JupyterLab 4, Notebook 7, VS Code.
- **The claim widget is a status view** (:class:`WidgetView` implements
  :class:`~fluksio_nb.status.StatusView`): the code running the claim tells it
  what changed, exactly as it tells the plain :class:`~fluksio_nb.status.TextView`.
  It runs no thread of its own: waiting claims are refreshed by their own wait
  loop, running ones by the kernel's one sampling thread
  (:mod:`fluksio_nb.watch`). It pushes at most once a second, only when a
  reading moved by more than drift (:func:`~fluksio_nb.sampler.is_news`)
  or the phase or place changed, or else every few seconds; and always the
  last state.
- **A claim's widget is replaced by its record when the claim ends**
  (:meth:`WidgetView.end`): the display it was drawn in becomes the text and
  HTML of :func:`~fluksio_nb.status.status_bundle`, and the widget is
  closed. A saved notebook then holds no widget view to fail on ("model not
  found") when it is opened without its kernel, and nbconvert and GitHub
  show how the claim went. What only a live view needs (its module, its
  stylesheet, its sparklines) is dropped first: nbclient keeps every
  widget's last state in the notebooks it executes, closed ones too. The
  text fallback beside a live view never changes: it is read only where the
  claim never ended.
- **A live view opened again without its kernel reads as saved, not as an
  error** (:mod:`fluksio_nb.widget.saved`): the monitor's display, and a
  claim's that never ended, say which widget they are in a mime type of
  ours, which JupyterLab's extension draws as the saved HTML, marked stale,
  once the kernel that held the widget is gone.
- **The monitor is refreshed by one thread for all monitors**
  (:mod:`fluksio_nb.widget.ticker`), only while one is watched, and pushes
  only what changed (:mod:`fluksio_nb.widget.facts`).
- **Closed means closed.** ``widget.close()`` stops a widget's updates at
  once; a front end that goes away stops a monitor's within its lease.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import anywidget
import traitlets as t

from fluksio_nb.relay import new_display_id
from fluksio_nb.sampler import Sample, is_news
from fluksio_nb.status import NOTHING_SHOWN, ClaimStatus, marked_html, status_bundle
from fluksio_nb.vocabulary import clock
from fluksio_nb.widget.facts import SPARK_POINTS, claim_facts, doing_fact, monitor_html
from fluksio_nb.widget.saved import add_saved_view
from fluksio_nb.widget.ticker import MonitorWatch, kernel_monitor_watch

__all__ = ["ClaimWidget", "MonitorWidget", "WidgetView", "monitor"]

_HERE = Path(__file__).parent


class _Widget(anywidget.AnyWidget):
    _esm = _HERE / "widget.js"
    _css = _HERE / "widget.css"

    @property
    def closed(self) -> bool:
        return self.comm is None


class ClaimWidget(_Widget):
    """One claim's status: waiting, running with its readings, or how it ended.

    A push while running carries the new reading and little else, because
    eight claims pushing is the kernel's largest cost of being watched (see
    ``bench/widget_sampling.py``), and a reading that did not move is not
    pushed at all (:attr:`QUIET_EVERY_S`). The sparklines are the readings that were
    pushed: the front end appends each one as it comes, and the whole series
    is sent only when the phase changes and every :attr:`HISTORY_EVERY_S`, so
    that a page reloaded mid-claim, which starts from the kernel's state, is
    whole again within seconds, and the final state holds all of it.
    """

    #: How often, at most, the whole series goes with a push while running.
    HISTORY_EVERY_S = 10.0

    #: How long a claim whose only news is its clock goes without a push. A
    #: ``sleep``, a cell waiting on the network, a claim waiting its turn: the
    #: front end counts their seconds itself, from the last push, and one
    #: push in this long keeps their sparklines moving. Pushing them every
    #: second was most of what eight claims' widgets cost the kernel.
    QUIET_EVERY_S = 5.0

    #: What an ended claim's widget is left as: a module that draws nothing.
    ENDED_ESM = "export default {};"

    kind = t.Unicode("claim").tag(sync=True)
    label = t.Unicode("").tag(sync=True)
    phase = t.Unicode("waiting").tag(sync=True)
    asked = t.Unicode("").tag(sync=True)
    #: Place in the queue, 1 being next; 0 when not waiting or not known.
    position = t.Int(0).tag(sync=True)
    # Lists without element traits: validating every point of two series
    # was most of a push's cost (measured: 415 µs a push, then ~60 µs).
    holders = t.List().tag(sync=True)
    waited_s = t.Float(0.0).tag(sync=True)
    #: cpus, gpus, ram_bytes, budget_bytes, granted_bytes; None until granted.
    share = t.Dict(allow_none=True, default_value=None).tag(sync=True)
    #: The latest reading: rss_bytes, cpu_percent, cpu_cores, processes,
    #: host_total_bytes, and n, how many readings there have been.
    reading = t.Dict(allow_none=True, default_value=None).tag(sync=True)
    #: The RSS and CPU of each reading pushed, oldest first, for the sparklines.
    rss_history = t.List().tag(sync=True)
    cpu_history = t.List().tag(sync=True)
    elapsed_s = t.Float(0.0).tag(sync=True)
    peak_rss_bytes = t.Int(0).tag(sync=True)
    mean_cpu_percent = t.Float(0.0).tag(sync=True)
    #: The card memory held on each card and how busy each is, in words; ``""``
    #: for a claim without cards, or whose cards nothing reads.
    gpu = t.Unicode("").tag(sync=True)
    #: The most card memory the claim held; ``None`` until a card is read.
    peak_gpu_bytes = t.Int(None, allow_none=True).tag(sync=True)
    ending = t.Unicode("").tag(sync=True)
    #: The ending's mark, its colour in every view: good, bad or stopped (vocabulary.MARKS).
    mark = t.Unicode("").tag(sync=True)
    message = t.Unicode("").tag(sync=True)
    #: What holds the claim to its cores and its memory: label, by, why each.
    enforcement = t.Dict().tag(sync=True)
    #: The claim reached its memory's warning stage: the widget turns amber.
    memory_warning = t.Bool(False).tag(sync=True)
    #: What the books warn of while it runs (its time limit near); ``""`` when nothing.
    warning = t.Unicode("").tag(sync=True)
    #: What the claim does beyond its phase, in words (``facts.doing_fact``).
    doing = t.Unicode("").tag(sync=True)

    def __init__(self, status: ClaimStatus | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._follow_lock = threading.Lock()
        self._points: deque[tuple[int, float]] = deque(maxlen=SPARK_POINTS)
        self._history_at = 0.0
        self._pushed_at = -self.QUIET_EVERY_S
        self._told: Sample | None = None
        if status is not None:
            self.follow(status)

    def let_go(self) -> None:
        """Close, once its record is in its place, keeping only what says how the claim went.

        nbconvert, papermill and nbval (nbclient) save the last state of every
        widget a notebook made, closed ones too: each ended claim's module and
        stylesheet was 45 KB of an executed notebook, for a view nothing draws.
        """
        with self.hold_sync():
            self._esm, self._css = self.ENDED_ESM, ""
            self.rss_history, self.cpu_history = [], []
        self.close()

    def follow(self, status: ClaimStatus) -> bool:
        """Show ``status``, sending only what changed. False once the widget is closed."""
        now = time.monotonic()
        latest = status.readings.latest
        with self._follow_lock:
            if self.closed:
                return False
            quiet = (
                status.phase == self.phase
                and now - self._pushed_at < self.QUIET_EVERY_S
                and (latest is None or not is_news(self._told, latest))
                and (status.position or 0) == self.position
                and status.holders == self.holders
                and status.label == self.label
                and status.memory_warning == self.memory_warning
                and status.warning == self.warning
                and doing_fact(status) == self.doing
            )
            if quiet:
                return True
            facts = claim_facts(status)
            self._pushed_at, self._told = now, latest
            reading = facts["reading"]
            if reading is not None and reading["n"] != (self.reading or {}).get("n"):
                self._points.append((reading["rss_bytes"], reading["cpu_percent"]))
            if facts["phase"] != self.phase or now - self._history_at >= self.HISTORY_EVERY_S:
                self._history_at = now
                facts["rss_history"] = [rss for rss, _ in self._points]
                facts["cpu_history"] = [cpu for _, cpu in self._points]
            with self.hold_sync():
                for name, value in facts.items():
                    # Compared here: a trait set to what it holds sends nothing
                    # anyway, but validating it first was a third of a push.
                    if getattr(self, name) != value:
                        setattr(self, name, value)
        return True

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        # The fallback never changes: nbval reads a display as it was first
        # drawn. The whole display is replaced when the claim ends
        # (WidgetView.end), so this is read only where it never was: a copy
        # saved while the claim ran, read long after, untrusted or converted.
        # It says what is still true then, and where the ending is.
        data, metadata = super()._repr_mimebundle_(**kwargs)
        text = f"{self.label}: running when this was saved; `fluksio-nb usage` says how it ended"
        data["text/plain"] = text
        data["text/html"] = marked_html(text, "running")
        add_saved_view(data, "claim")
        return data, metadata


class WidgetView:
    """A claimed cell's status drawn by a :class:`ClaimWidget`, in that cell's output.

    Throttled like :class:`~fluksio_nb.status.TextView` and for the same
    reason: the sampler reads every half second and a waiting claim is told
    every time the queue moves. Once a second, not twice: pushes are most of
    what watching eight claims costs the kernel (measured: 0.85% of a core for
    eight claims at two a second), and a bar that moves every second reads as
    live. A change of phase always goes through at once.

    The display is sent straight to the cell that was executing when the view
    was shown (:class:`~fluksio_nb.relay.CellOutput`), as the text view's is,
    because ``show`` may be called from the sampling thread.
    """

    #: A little under a second: readings come every half second, with jitter,
    #: and a reading a millisecond early must not wait for the next one.
    MIN_INTERVAL_S = 0.9

    def __init__(self) -> None:
        self.widget: ClaimWidget | None = None
        self._output: Any = None
        self._display_id = new_display_id()
        self._phase: str | None = None
        #: The books' warning last pushed: a new one goes at once, as a phase does.
        self._warning = ""
        self._last = 0.0
        self._ended = False
        self._lock = threading.Lock()

    def show(self, status: ClaimStatus) -> None:
        """Draw the status in the cell executing now; once, later calls update it."""
        from fluksio_nb.relay import CellOutput

        with self._lock:
            if self._ended:
                return
            if self.widget is None:
                self.widget = ClaimWidget(status)
                self._phase, self._last = status.phase, time.monotonic()
                data, metadata = self.widget._repr_mimebundle_()
                if self._output is not None:
                    # In the place held for it, above the cell's output.
                    self._output.update_display(data, self._display_id, metadata)
                else:
                    self._output = CellOutput()
                    self._output.display(data, metadata, display_id=self._display_id)
                return
        self.update(status)

    def hold_the_place(self, output: Any) -> None:
        """Take the cell's first place now, blank, for the widget (see :class:`TextView`)."""
        with self._lock:
            if self.widget is not None or self._ended or self._output is not None:
                return
            self._output = output
            output.display(NOTHING_SHOWN, display_id=self._display_id)

    def update(self, status: ClaimStatus) -> None:
        now = time.monotonic()
        with self._lock:
            widget = self.widget
            if widget is None or widget.closed:
                return
            news = status.phase != self._phase or status.warning != self._warning
            if not news and now - self._last < self.MIN_INTERVAL_S:
                return
            self._last = now
            if not widget.follow(status):
                return
            self._phase, self._warning = status.phase, status.warning

    def end(self, status: ClaimStatus, in_place: bool = True) -> bool:
        """Replace the widget with the claim's record and close it; False if it is not there."""
        with self._lock:
            self._ended = True
            widget = self.widget
            if widget is None and self._output is None:
                return False
            shown = status_bundle(status) if in_place else NOTHING_SHOWN
            self._output.leave_display(shown, self._display_id)
            if widget is not None:
                widget.let_go()
            return in_place


class MonitorWidget(_Widget):
    """The machine: what each resource holds and for whom, the queue, the running claims.

    While this kernel is connected to Ray, also the cluster's total and
    available resources and this kernel's claims on it (``machine["ray"]``).
    """

    kind = t.Unicode("monitor").tag(sync=True)
    #: What :func:`~fluksio_nb.widget.facts.machine_facts` says, plus ``clock``:
    #: the kernel's time (epoch seconds) when it was pushed.
    machine = t.Dict().tag(sync=True)
    #: The machine's last ten minutes (:mod:`fluksio_nb.machine_history`), oldest
    #: first: sent whole when shown and every :attr:`HISTORY_EVERY_S`, so a page
    #: reloaded has it again within that long.
    history = t.List().tag(sync=True)
    #: The newest point, sent alone as it is taken: the front end appends it.
    history_point = t.Dict(allow_none=True, default_value=None).tag(sync=True)

    #: How often the whole history goes with a point.
    HISTORY_EVERY_S = 30.0

    #: How long every view may stay silent, counting only time the kernel was
    #: free to hear it, before the monitor is taken for abandoned. Views ping
    #: every 30 s (each ping costs the kernel's main thread a few ms, measured
    #: as 0.5% of a core at one ping every 3 s), and at once when their tab is
    #: shown again after a browser stopped its timers.
    LEASE_S = 90.0

    def __init__(self, watch: MonitorWatch | None = None, lease_s: float | None = None) -> None:
        watch = watch or kernel_monitor_watch()
        facts = _without_point(watch.read())
        # Sent with the widget itself, so the first view draws the machine at once.
        super().__init__(machine=_stamped(facts), history=_history_points())
        self._history_at = time.monotonic()
        self._watch = watch
        self.lease_s = self.LEASE_S if lease_s is None else lease_s
        self._views: dict[str, float] = {}
        self._shown_at: float | None = None
        self._left_at: float | None = None
        self._shown_facts: dict[str, Any] | None = facts
        self._push_lock = threading.Lock()
        self.on_msg(self._heard)

    # -- what the ticker asks ---------------------------------------------------

    def watched(self, now: float, quiet_since: float) -> bool:
        """Whether anyone may still be looking: shown, not closed, not abandoned."""
        if self.closed:
            return False
        views = list(self._views.values())
        if views:
            last = max(views)
        elif self._shown_at is None:
            return False
        elif self._left_at is not None and self._left_at >= self._shown_at:
            return False  # every view said goodbye since it was last shown
        else:
            last = self._shown_at  # shown, and no front end has had its say yet
        return now - max(last, quiet_since) < self.lease_s

    def show_facts(self, facts: dict[str, Any]) -> None:
        """Push ``facts`` if they differ from what was last pushed, and a new history point."""
        point = facts.get("history_point")
        facts = _without_point(facts)
        with self._push_lock:
            if self.closed:
                return
            if point is not None and point != self.history_point:
                now = time.monotonic()
                with self.hold_sync():
                    if now - self._history_at >= self.HISTORY_EVERY_S:
                        self._history_at = now
                        self.history = _history_points()
                    self.history_point = point
            if facts == self._shown_facts:
                return
            self._shown_facts = facts
            self.machine = _stamped(facts)

    # -- the front end ----------------------------------------------------------

    def _heard(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict) or self.closed:
            return
        kind, view = content.get("type"), str(content.get("view", ""))
        now = time.monotonic()
        if kind in ("hello", "ping"):
            self._views[view] = now
            self._watch.watch(self)
        elif kind == "gone":
            self._views.pop(view, None)
            if not self._views:
                self._left_at = now
                self._watch.unwatch(self)

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        from fluksio_nb.overview import describe_monitor, kernel_snapshot, ray_now
        from fluksio_nb.widget.ticker import finished_claims, kernel_rss_bytes

        data, metadata = super()._repr_mimebundle_(**kwargs)
        # Read only once the live view is gone, maybe days later: it says when it was true.
        text = f"machine as of {clock(time.time())}, when %claims drew it\n" + describe_monitor(
            kernel_snapshot(),
            ray_now(),
            history=_history_points(),
            kernel_rss_bytes=kernel_rss_bytes(),
            finished=finished_claims(),
        )
        data["text/plain"] = text
        data["text/html"] = monitor_html(text)
        add_saved_view(data, "monitor")
        # Being drawn is what starts the refreshing.
        self._shown_at = time.monotonic()
        self._watch.watch(self)
        return data, metadata

    def close(self) -> None:
        # Also called by the widget's __del__ after an __init__ that failed
        # before it had a watch: the books could not be read.
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.unwatch(self)
        super().close()


def _history_points() -> list[dict[str, Any]]:
    """The kernel's history of the machine, caught up on its server's: views open on ten minutes."""
    from fluksio_nb.machine_history import process_history
    from fluksio_nb.server_history import catch_up

    history = process_history()
    catch_up(history)
    return history.points()


def _without_point(facts: dict[str, Any]) -> dict[str, Any]:
    """The facts without the history's newest point, which travels on its own."""
    return {key: value for key, value in facts.items() if key != "history_point"}


def _stamped(facts: dict[str, Any]) -> dict[str, Any]:
    """The facts with the kernel's clock, which the front end counts waiting time from."""
    return {**facts, "clock": round(time.time(), 3)}


def monitor() -> MonitorWidget:
    """The live monitor that ``%claims`` shows: the machine, the queue, the running claims."""
    return MonitorWidget()
