"""The widgets' Python side: what they send, when they stop, and the text they leave behind.

The failures guarded against: a fallback that nbval cannot compare (text that
is not exactly :func:`describe`), a label that reaches HTML unescaped, a
monitor thread that runs with nobody watching (or never stops, or stops while
someone is), a monitor that pushes the same machine over and over, a closed
widget that keeps sending, and a monitor that cannot say who holds which card
or how a running claim is doing.

The widgets are real; what stands in for the front end is the wire: the
``comm`` package's hook for making comms, recording every message a front
end would receive, and delivering the messages a front end would send.
"""

from __future__ import annotations

import gc
import html
import re
import sys
import threading
import time
from typing import Any

import comm
import ipykernel.ipkernel  # noqa: F401  (it replaces comm's hooks when first imported)
import pytest
from comm.base_comm import BaseComm, CommManager

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.budget import Budget
from fluksio_nb.overview import describe_snapshot
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.resources import ask
from fluksio_nb.sampler import Sample
from fluksio_nb.status import ClaimStatus, describe, ordinal, running_statuses, status_bundle
from fluksio_nb.widget import ClaimWidget, MonitorWidget, monitor
from fluksio_nb.widget.facts import doing_fact, machine_facts, monitor_html
from fluksio_nb.widget.saved import SAVED_VIEW
from fluksio_nb.widget.ticker import KernelActivity, MachineReader, MonitorWatch
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

HOSTILE = "<img src=x onerror=alert(1)>"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


# -----------------------------------------------------------------------------
# The wire
# -----------------------------------------------------------------------------


class WireComm(BaseComm):
    """A comm whose messages are kept, in order, instead of sent to a front end."""

    def __init__(self, wire: Wire, **kwargs: Any) -> None:
        self.wire = wire
        super().__init__(**kwargs)

    def publish_msg(self, msg_type: str, data: Any = None, metadata: Any = None, **keys: Any):
        self.wire.sent.append((self.comm_id, msg_type, data or {}))


class Wire:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str, dict[str, Any]]] = []

    def updates(self, widget: Any) -> list[dict[str, Any]]:
        """The state changes sent for ``widget``, in order."""
        return [
            data["state"]
            for comm_id, kind, data in list(self.sent)
            if comm_id == widget.model_id and kind == "comm_msg" and data.get("method") == "update"
        ]

    def say(self, widget: Any, content: dict[str, Any]) -> None:
        """Deliver a message from the front end's view, as the kernel would."""
        widget.comm.handle_msg(
            {"content": {"data": {"method": "custom", "content": content}}, "buffers": []}
        )


@pytest.fixture
def wire(monkeypatch) -> Wire:
    wire = Wire()
    manager = CommManager()
    monkeypatch.setattr(comm, "create_comm", lambda **kwargs: WireComm(wire, **kwargs))
    monkeypatch.setattr(comm, "get_comm_manager", lambda: manager)
    return wire


@pytest.fixture
def declared_machine(monkeypatch):
    monkeypatch.setenv("FLUKSIO_CPUS", "4")
    monkeypatch.setenv("FLUKSIO_GPUS", "2")
    monkeypatch.setenv("FLUKSIO_RAM", "8G")
    monkeypatch.setenv("FLUKSIO_RESERVE_CPUS", "0")


def sample(rss: int, cpu: float = 12.5) -> Sample:
    return Sample(
        rss_bytes=rss,
        cpu_percent=cpu,
        cpu_cores=0.5,
        processes=1,
        host_total_bytes=16_000_000_000,
        host_available_bytes=12_000_000_000,
        at=time.monotonic(),
    )


def waiting_status(label: str = "fit") -> ClaimStatus:
    status = ClaimStatus(label=label, asked=ask(cpus=2, gpus=1, ram="1G"), ticket=3)
    status.position, status.holders = 2, ["'prep' (cpus=2)"]
    return status


def running_status(label: str = "fit") -> ClaimStatus:
    status = waiting_status(label)
    status.phase, status.position, status.holders = "running", None, []
    status.allocation = Allocation(cpus=2, gpus=(1,), ram_bytes=1_000_000_000, cores=(4, 5))
    status.budget = Budget(1_000_000_000, 900_000_000)
    status.started_at = time.monotonic() - 3
    for rss in (100_000_000, 300_000_000, 200_000_000):
        status.readings.add(sample(rss))
    return status


def done_status(ending: str = "ok", message: str = "", label: str = "fit") -> ClaimStatus:
    status = running_status(label)
    status.phase, status.ending, status.message = "done", ending, message
    status.ended_at = time.monotonic()
    return status


# -----------------------------------------------------------------------------
# The claim widget
# -----------------------------------------------------------------------------


def test_a_claim_that_ended_in_the_queue_says_how_long_it_waited_and_nothing_of_a_share():
    status = waiting_status("impatient")
    status.asked_at = time.monotonic() - 17
    status.phase, status.ending, status.ended_at = "done", "cancelled", time.monotonic()
    said = describe(status)
    # Said in every view's words: the time waited, and the one phrase for no share.
    assert said == "impatient: cancelled · waited 17 s · never got its share", said
    assert "RSS" not in said and "CPU" not in said and "no share" not in said


def test_a_record_says_the_time_waited_starting_running_and_sending_back_apart():
    """A claim that queued 17 s must not say it "took 0.3 s": each part, said once."""
    status = done_status()
    now = time.monotonic()
    status.asked_at, status.started_at, status.ended_at = now - 35.0, now - 18.0, now
    status.starting_s, status.sent_s, status.sent_bytes = 0.5, 3.6, 1_600_000_000
    said = describe(status)
    assert said.startswith(
        "fit: ok · waited 17 s, started a worker in 0.5 s, ran 14 s, "
        "sent 1.6GB back in 3.6 s · cpus=2 gpus=1 (card 1) ram=1.0GB · peak RSS 300.0MB"
    ), said
    assert said.count("·") == 3, said
    # Small results come back in no time worth a word, and warm workers start in none.
    status.starting_s, status.sent_s, status.sent_bytes = 0.0, 0.01, 2_000
    assert "waited 17 s, ran 18 s · " in describe(status)


def test_results_on_their_way_back_are_said_with_their_size_and_how_far_they_got():
    """A cell that built 1.6 GB must not say only "sending results back" for seconds."""
    status = running_status()
    status.sending_since = time.monotonic() - 1.2
    # Seconds as they pass: a loaded machine may add a few tenths between the lines.
    said = describe(status)
    assert re.match(r"fit: sending results back, 1\.\d s so far · ", said), said
    status.sending_written, status.sending_total = 640_000_000, 1_600_000_000
    said = describe(status)
    assert re.match(r"fit: sending 1\.6GB back, 40% after 1\.\d s · ", said), said
    assert re.fullmatch(r"sending 1\.6GB back, 40% after 1\.\d s", doing_fact(status))


def test_a_record_of_a_claim_never_read_says_so_rather_than_zero():
    status = done_status("timed out")
    status.readings = type(status.readings)()
    said = describe(status)
    assert said.endswith(" · no reading taken"), said
    assert "0B" not in said and "0%" not in said


def test_a_record_does_not_read_as_success_when_a_name_did_not_come_back():
    status = done_status()
    status.not_back = ["lk"]
    assert describe(status).startswith("fit: ok, but not every name came back · waited ")
    assert "fluksio-failed" in status_bundle(status)["text/html"]


def test_a_record_holds_no_paragraph_of_why_which_the_cells_error_says():
    status = done_status("halted", "the claim's processes reached 1.0GB. Ask for more.")
    said = describe(status)
    assert "\n" not in said and "Ask for more" not in said, said


def test_a_waiting_claim_says_its_place_in_words_not_a_number_like_a_cells():
    assert ", 2nd in the queue, behind 'prep' (cpus=2) " in describe(waiting_status())
    assert [ordinal(n) for n in (1, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "status",
    [waiting_status(), running_status(), done_status()],
    ids=["waiting", "running", "ok"],
)
def test_the_text_fallback_never_changes_with_the_phase(wire, status):
    """nbval reads a display as first drawn, a saved notebook as last redrawn: they must agree."""
    data, _ = ClaimWidget(status)._repr_mimebundle_()
    assert data["text/plain"] == (
        f"{status.label}: running when this was saved; `fluksio-nb usage` says how it ended"
    )
    assert WIDGET_VIEW in data
    assert data == ClaimWidget(waiting_status(label=status.label))._repr_mimebundle_()[0] | {
        WIDGET_VIEW: data[WIDGET_VIEW],
        SAVED_VIEW: data[SAVED_VIEW],
    }


def test_a_live_widgets_display_says_which_of_ours_it_is_and_when_its_text_was_true(
    wire, declared_machine
):
    """Guards against a saved ``%claims`` or running claim that JupyterLab, opened again
    without its kernel, can only draw as "model not found": the display must name the
    widget in our own mime type (which the lab extension draws), keep the widget view
    and fallbacks other front ends pick, and the monitor's text must say when it was true."""
    claim = ClaimWidget(running_status())
    data, _ = claim._repr_mimebundle_()
    assert data[SAVED_VIEW] == {"model_id": claim.model_id, "kind": "claim"}
    assert data[WIDGET_VIEW]["model_id"] == claim.model_id
    assert {"text/plain", "text/html"} <= data.keys()
    widget = monitor()
    data, _ = widget._repr_mimebundle_()
    assert data[SAVED_VIEW] == {"model_id": widget.model_id, "kind": "monitor"}
    assert data[WIDGET_VIEW]["model_id"] == widget.model_id
    first = data["text/plain"].splitlines()[0]
    assert re.fullmatch(r"machine as of \d\d:\d\d:\d\d, when %claims drew it", first), first
    assert html.escape(first) in data["text/html"]
    widget.close()


def test_labels_and_messages_are_escaped_in_every_html_fallback(wire, declared_machine):
    """A label is user text: as HTML it would run in every page that shows the notebook."""
    status = done_status("error", f"ValueError: {HOSTILE}", label=HOSTILE)
    data, _ = ClaimWidget(status)._repr_mimebundle_()
    assert "<img" not in data["text/html"]
    assert "&lt;img src=x onerror=alert(1)&gt;" in data["text/html"]
    assert "<img" not in status_bundle(status)["text/html"]
    assert "&lt;img src=x onerror=alert(1)&gt;: error · " in status_bundle(status)["text/html"]
    assert "<script" not in monitor_html("<script>alert(1)</script> waiting")


def test_the_claim_widget_follows_a_claim_from_waiting_to_how_it_ended(wire):
    """Each phase must reach the front end with what that phase shows, nothing stale."""
    widget = ClaimWidget(waiting_status())
    assert (widget.phase, widget.position, widget.holders) == ("waiting", 2, ["'prep' (cpus=2)"])
    assert widget.asked == "cpus=2 gpus=1 ram=1.0GB" and widget.share is None

    running = running_status()
    widget.follow(running)
    assert widget.phase == "running"
    assert widget.share == {
        "cpus": 2,
        "cores": [4, 5],
        "gpus": [1],
        "ram_bytes": 1_000_000_000,
        "budget_bytes": 900_000_000,
        "granted_bytes": 1_000_000_000,
        "warn_at": 0.8,
    }
    assert widget.reading["rss_bytes"] == 200_000_000
    assert widget.elapsed_s >= 3
    running.readings.add(sample(400_000_000, cpu=50.0))
    widget.follow(running)
    assert widget.reading["rss_bytes"] == 400_000_000

    widget.follow(done_status("halted", "over its memory budget"))
    assert (widget.phase, widget.ending) == ("done", "halted")
    assert widget.peak_rss_bytes == 300_000_000 and widget.mean_cpu_percent == 12.5
    assert widget.message == "over its memory budget"


def test_the_claim_widget_says_what_holds_the_claim_and_turns_amber_once_warned(wire):
    """Guards against a share shown without saying whether the OS holds it to it."""
    from fluksio_nb.enforcement import cores_enforcement
    from fluksio_nb.memory_cap import sampled

    status = running_status()
    status.cores_enforcement = cores_enforcement((4, 5), pin_cores=True)
    status.memory_enforcement = sampled("no cgroup may be made here")
    widget = ClaimWidget(status)
    assert widget.enforcement == {
        "cores": {"label": "own cores (affinity)", "by": "affinity", "why": ""},
        "memory": {
            "label": "watched every 0.5 s",
            "by": "sampler",
            "why": "no cgroup may be made here",
        },
    }
    assert "cpus=2 (cores 4-5)" in describe(status)
    assert "ram=1.0GB (watched every 0.5 s)" in describe(status)
    assert widget.memory_warning is False
    status.memory_warning = True
    widget.follow(status)
    assert widget.memory_warning is True, "the warning is news, not for the quiet push"


def test_a_new_reading_sends_the_reading_and_little_else(wire):
    """Eight claims pushing twice a second: every byte of a push is paid 16 times a second."""
    status = running_status()
    widget = ClaimWidget(status)
    before = len(wire.updates(widget))
    status.readings.add(sample(250_000_000))
    widget.follow(status)
    sent = wire.updates(widget)[before:]
    assert len(sent) == 1, "one reading should be one message"
    assert sent[0]["reading"]["rss_bytes"] == 250_000_000
    assert set(sent[0]) <= {"reading", "elapsed_s", "peak_rss_bytes", "mean_cpu_percent"}


def test_a_reading_that_did_not_move_waits_for_the_quiet_push(wire):
    """A steady claim is news only now and then; its clock is counted by the front end."""
    status = running_status()
    widget = ClaimWidget(status)
    before = len(wire.updates(widget))
    status.readings.add(sample(200_000_000 + 4096))  # a page more: drift, not news
    widget.follow(status)
    assert len(wire.updates(widget)) == before, "a reading that did not move was pushed"

    widget.QUIET_EVERY_S = 0.0
    widget.follow(status)
    (sent,) = wire.updates(widget)[before:]
    assert sent["reading"]["rss_bytes"] == 200_000_000 + 4096

    widget.QUIET_EVERY_S = 3600.0
    status.readings.add(sample(200_000_000 + 4096, cpu=40.0))
    widget.follow(status)
    assert wire.updates(widget)[-1]["reading"]["cpu_percent"] == 40.0, "a CPU jump is news"


def test_a_waiting_claim_is_pushed_when_its_place_changes_not_its_clock(wire):
    status = waiting_status()
    widget = ClaimWidget(status)
    before = len(wire.updates(widget))
    status.asked_at -= 5
    widget.follow(status)
    assert len(wire.updates(widget)) == before
    status.position, status.holders = 1, []
    widget.follow(status)
    assert wire.updates(widget)[-1]["position"] == 1


def test_the_sparklines_are_the_readings_pushed_sent_whole_now_and_then(wire):
    """A page reloaded mid-claim starts from the kernel's state: its sparklines must heal,
    and the final state must hold the whole series."""
    widget = ClaimWidget(waiting_status())
    running = running_status()
    widget.follow(running)
    assert wire.updates(widget)[-1]["rss_history"] == [200_000_000]

    running.readings.add(sample(400_000_000))
    widget.follow(running)
    assert "rss_history" not in wire.updates(widget)[-1], "the series went with a reading"

    widget.HISTORY_EVERY_S = 0.0
    running.readings.add(sample(500_000_000, cpu=50.0))
    widget.follow(running)
    widget.follow(running)  # the same reading again is not a new point
    last = wire.updates(widget)[-1]
    assert last["rss_history"] == [200_000_000, 400_000_000, 500_000_000]
    assert last["cpu_history"] == [12.5, 12.5, 50.0]

    widget.HISTORY_EVERY_S = 3600.0
    running.readings.add(sample(600_000_000))
    running.phase, running.ending, running.ended_at = "done", "ok", time.monotonic()
    widget.follow(running)
    last = wire.updates(widget)[-1]
    assert last["phase"] == "done" and last["rss_history"][-1] == 600_000_000


def test_a_closed_claim_widget_sends_nothing_more(wire):
    """After close() the front end has no model; messages to it are errors in the browser."""
    status = running_status()
    widget = ClaimWidget(status)
    widget.close()
    sent = len(wire.sent)
    status.readings.add(sample(500_000_000))
    assert widget.follow(status) is False
    assert len(wire.sent) == sent


# -----------------------------------------------------------------------------
# The monitor's thread
# -----------------------------------------------------------------------------


class FixedMachine:
    """A machine whose facts change only when a test says so."""

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {"cpus": {"total": 4, "free": 4}, "running": [], "n": 0}
        self.reads = 0
        self.closed = 0

    def __call__(self) -> dict[str, Any]:
        self.reads += 1
        return dict(self.facts)

    def close(self) -> None:
        self.closed += 1


def monitor_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "fluksio-monitor" and t.is_alive())


@pytest.fixture
def fixed():
    return FixedMachine()


@pytest.fixture
def ticker(fixed):
    watch = MonitorWatch(interval_s=0.02, idle_interval_s=0.02, reader=fixed)
    yield watch
    for monitor_widget in list(watch._monitors):
        watch.unwatch(monitor_widget)
    wait_until(lambda: not watch.running)


def test_the_monitor_thread_starts_when_shown_and_stops_when_closed(wire, ticker, fixed):
    """A monitor must cost nothing until it is drawn, and nothing once it is closed."""
    widget = MonitorWidget(watch=ticker)
    time.sleep(0.1)
    assert not ticker.running, "made but not shown, and already refreshing"
    widget._repr_mimebundle_()
    assert wait_until(lambda: ticker.running)
    reads = fixed.reads
    assert wait_until(lambda: fixed.reads > reads + 3), "shown, and not refreshed"
    widget.close()
    assert wait_until(lambda: not ticker.running), "closed, and still refreshing"
    assert fixed.closed >= 1, "the reader (and NVML with it) was not let go"
    sent = len(wire.sent)
    fixed.facts["n"] = 1
    time.sleep(0.1)
    assert len(wire.sent) == sent


def test_a_monitor_whose_books_cannot_be_read_fails_once_and_leaves_nothing_behind(
    wire, monkeypatch
):
    """Guards against `%claims` over unusable books raising a second time, later, from the
    half-made widget's __del__ in whichever cell ran then."""

    def unreadable() -> dict:
        raise PermissionError("the books cannot be read")

    watch = MonitorWatch(interval_s=0.02, idle_interval_s=0.02, reader=unreadable)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(PermissionError):
        MonitorWidget(watch=watch)
    gc.collect()
    assert [hook.exc_value for hook in unraisable] == []


def test_a_monitor_nobody_answers_for_is_let_go(wire, fixed):
    """A monitor in a closed tab says no goodbye; its lease must run out."""
    watch = MonitorWatch(interval_s=0.02, idle_interval_s=0.02, reader=fixed)
    widget = MonitorWidget(watch=watch, lease_s=0.3)
    widget._repr_mimebundle_()
    assert wait_until(lambda: watch.running)
    assert wait_until(lambda: not watch.running, timeout=2), "nobody is looking, and it goes on"


def test_a_front_end_that_pings_keeps_it_going_and_goodbye_stops_it(wire, ticker):
    """A view that is still there must keep getting updates; one that left must not."""
    widget = MonitorWidget(watch=ticker, lease_s=0.3)
    widget._repr_mimebundle_()
    wire.say(widget, {"type": "hello", "view": "a"})
    for _ in range(8):
        time.sleep(0.1)
        wire.say(widget, {"type": "ping", "view": "a"})
    assert ticker.running, "a view pinging every 0.1 s was taken for gone"
    wire.say(widget, {"type": "gone", "view": "a"})
    assert wait_until(lambda: not ticker.running, timeout=1)


def test_a_front_end_that_comes_back_gets_updates_again(wire, ticker, fixed):
    """A tab shown again after its lease ran out must not stay frozen."""
    widget = MonitorWidget(watch=ticker, lease_s=0.2)
    widget._repr_mimebundle_()
    assert wait_until(lambda: not ticker.running, timeout=2)
    wire.say(widget, {"type": "ping", "view": "b"})
    assert wait_until(lambda: ticker.running)
    before = len(wire.updates(widget))
    fixed.facts["n"] = 2
    assert wait_until(lambda: len(wire.updates(widget)) > before)
    assert wire.updates(widget)[-1]["machine"]["n"] == 2


def test_silence_while_a_cell_runs_is_not_taken_for_a_closed_tab(wire, fixed):
    """Front-end pings are only heard between cells: a long cell must not stop the monitor."""
    activity = KernelActivity()
    watch = MonitorWatch(interval_s=0.02, idle_interval_s=0.02, reader=fixed, activity=activity)
    widget = MonitorWidget(watch=watch, lease_s=0.2)
    widget._repr_mimebundle_()
    activity.cell_started()
    time.sleep(0.6)
    assert watch.running, "stopped during a cell, when no ping could have been heard"
    activity.cell_finished()
    assert wait_until(lambda: not watch.running, timeout=2)


def test_every_open_monitor_shares_one_thread(wire, ticker):
    """Ten %claims outputs must not mean ten threads reading the machine."""
    widgets = [MonitorWidget(watch=ticker) for _ in range(5)]
    for widget in widgets:
        widget._repr_mimebundle_()
    assert wait_until(lambda: ticker.running)
    assert monitor_threads() == 1
    for widget in widgets:
        widget.close()
    assert wait_until(lambda: monitor_threads() == 0)


def test_an_unchanged_machine_is_not_pushed_again(wire, ticker, fixed):
    """An idle machine must cost next to nothing: no message unless something changed."""
    widget = MonitorWidget(watch=ticker)
    widget._repr_mimebundle_()
    reads = fixed.reads
    assert wait_until(lambda: fixed.reads > reads + 10)
    assert wire.updates(widget) == [], "the same facts were pushed again"
    fixed.facts["n"] = 3
    assert wait_until(lambda: len(wire.updates(widget)) == 1)
    time.sleep(0.1)
    assert len(wire.updates(widget)) == 1
    widget.close()


class WaitsSeen(threading.Event):
    """The watch's wake-up event, keeping how long the watch asked to sleep each time."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def test_an_idle_machine_is_read_less_often(wire, fixed):
    """Nothing waiting or running: reading twice a second would be cost for nothing.

    Judged by how long the watch sleeps after each read, not by reads counted
    in a second of wall time, which a loaded machine makes fewer.
    """
    watch = MonitorWatch(interval_s=0.02, idle_interval_s=0.2, reader=fixed)
    watch._wake = waits = WaitsSeen()
    widget = MonitorWidget(watch=watch)
    widget._repr_mimebundle_()
    assert wait_until(lambda: len(waits.timeouts) >= 3)
    assert set(waits.timeouts) == {0.2}, waits.timeouts
    fixed.facts["running"] = [{"ticket": 1}]
    idle = len(waits.timeouts)
    # The read after the running claim shows up sleeps the short interval, and keeps to it.
    assert wait_until(lambda: waits.timeouts[idle:].count(0.02) >= 3)
    busy = waits.timeouts[idle:]
    assert set(busy[busy.index(0.02) :]) == {0.02}, busy
    widget.close()


def test_host_memory_that_drifts_a_little_is_not_news(declared_machine, monkeypatch):
    """Free memory moves by a few kB all the time; each move must not be a push."""
    import fluksio_nb.inventory as inventory

    readings = iter([(10_000_000_000, 6_000_000_000), (10_000_000_000, 6_010_000_000)])
    readings = iter([*readings, (10_000_000_000, 6_100_000_000)])
    monkeypatch.setattr(inventory, "host_memory", lambda *a: next(readings))
    read = MachineReader()
    first, drifted, moved = read(), read(), read()
    # The history's newest point travels on its own, whenever one is due,
    # whatever the host's memory did: the machine's facts are what must hold.
    del first["history_point"], drifted["history_point"]
    assert first == drifted
    assert moved["host"]["available"] == 6_100_000_000


# -----------------------------------------------------------------------------
# What the monitor says
# -----------------------------------------------------------------------------


def test_the_monitor_says_who_holds_each_card_and_who_waits():
    """Who holds what, and who is next, is the monitor's whole point."""
    queue = ClaimQueue(ResourceAccountant(cpus=4, gpus=2, ram_bytes=8_000_000_000))
    holder = queue.enqueue(ask(cpus=2, gpus=1, ram="2G", label=HOSTILE))
    queue.wait(holder, 1)
    queue.enqueue(ask(cpus=4, label="big"))
    queue.enqueue(ask(cpus=1, gpus=2, label="cards"))
    facts = machine_facts(queue.snapshot(), {}, (16_000_000_000, 9_000_000_000))

    assert facts["cpus"] == {"total": 4, "free": 2}
    assert facts["ram"] == {"total": 8_000_000_000, "free": 6_000_000_000}
    assert facts["gpus"] == [
        {
            "id": 0,
            "holder": {"ticket": holder.number, "label": HOSTILE},
            "card": None,
            "slices": None,
        },
        {"id": 1, "holder": None, "card": None, "slices": None},
    ]
    assert [(w["position"], w["label"], w["asked"]) for w in facts["waiting"]] == [
        (1, "big", "cpus=4"),
        (2, "cards", "cpus=1 gpus=2"),
    ]
    assert [r["allocation"] for r in facts["running"]] == [
        {"cpus": 2, "cores": [], "gpus": [0], "ram_bytes": 2_000_000_000}
    ]
    assert facts["host"] == {
        "total": 16_000_000_000,
        "available": 9_000_000_000,
        "headroom": 1_600_000_000,
    }


def test_the_monitor_names_notebooks_places_expected_waits_and_a_stopped_worker():
    """Guards against ticket numbers where people read places, and a stopped worker's silence."""
    from fluksio_nb.expected_wait import with_expected_waits

    queue = ClaimQueue(ResourceAccountant(cpus=2, gpus=0, ram_bytes=8_000_000_000))
    holder = queue.enqueue(ask(cpus=2, label="fit"))
    queue.wait(holder, 1)
    queue.enqueue(ask(cpus=2, label="fit"))
    queue.enqueue(ask(cpus=1, label="new work"))
    snapshot = queue.snapshot()
    stopped_at = time.time() - 30
    snapshot["running"][0].update(
        notebook="work/train.ipynb",
        readings={"rss_bytes": 1000, "cpu_percent": 0.0, "stopped_since": stopped_at},
    )
    snapshot["waiting"][0]["notebook"] = "work/next.ipynb"
    with_expected_waits(snapshot, {"fit": [600.0]})

    facts = machine_facts(snapshot, {}, (16_000_000_000, 9_000_000_000), pid=-1)

    (running,) = facts["running"]
    assert running["notebook"] == "work/train.ipynb"
    assert running["stopped_since"] == stopped_at
    fit, new = facts["waiting"]
    assert fit["notebook"] == "work/next.ipynb" and new["notebook"] is None
    # A start time, so the facts do not change every second as the wait counts down.
    assert fit["expected"]["at"] % 10 == 0
    assert 590 <= fit["expected"]["at"] - time.time() <= 610
    assert fit["expected"]["why"] == "from 1 past run of 'fit' and the running claims' ages"
    # Never run here before, it still learns when it starts: after the queued fit's 600 s.
    assert 1190 <= new["expected"]["at"] - time.time() <= 1210
    assert new["expected"]["why"] == "from 1 past run of 'fit' and the running claims' ages"

    text = describe_snapshot(snapshot)
    clock = time.strftime("%H:%M:%S", time.localtime(stopped_at))
    assert f"stopped by a signal since {clock}" in text
    assert "running  fit in work/train.ipynb: cpus=2" in text
    # What each asks, as its claim line said it: no card asked for is no `gpus=0`.
    assert "waiting  1st in the queue: fit in work/next.ipynb: asks cpus=2; expected" in text
    assert "waiting  2nd in the queue: new work: asks cpus=1; expected" in text
    assert "expected to start in about 10 min (from 1 past run of 'fit'" in text
    assert "#" not in text, "a ticket number where a person reads"


def test_the_monitor_counts_the_waiting_claims_the_machines_books_did_not_list():
    """Guards against a monitor that shows another user's queue of thousands as the 100
    the machine's books list: the books' count of the rest must reach the facts."""
    from fluksio_nb.machine.books import OTHERS_WAITING_LISTED, Entry, MachineBooks

    me, them = 1001, 1002
    books = MachineBooks(2, [0], 8_000_000_000)
    for _ in range(OTHERS_WAITING_LISTED + 50):
        number = books.next_number()
        books.add(Entry(number=number, uid=them, user="bob", pid=them, need=(1, 1, 0), label=""))
        books.dispatch()
    snapshot = books.snapshot(me)

    facts = machine_facts(snapshot, {}, (16_000_000_000, 9_000_000_000), pid=-1)

    # The first holds the one card; of the rest, the books list the head of the queue.
    assert len(facts["waiting"]) == OTHERS_WAITING_LISTED
    assert facts["waiting_unlisted"] == 49
    # The monitor's text fallback says so as well, as the terminal does.
    assert "waiting  and 49 more of other users' claims, not listed" in describe_snapshot(snapshot)


def test_a_claim_of_this_kernel_stopped_by_a_signal_says_so_in_the_monitor():
    """Guards against a SIGSTOPped worker's claim looking merely idle in %claims."""
    stopped_at = time.time() - 5
    status = running_status()
    status.stopped_since = stopped_at
    queue = ClaimQueue(ResourceAccountant(cpus=2, gpus=0, ram_bytes=8_000_000_000))
    mine = queue.enqueue(ask(cpus=1, label="fit"))
    queue.wait(mine, 1)
    facts = machine_facts(queue.snapshot(), {mine.number: status}, (16_000_000_000, 9_000_000_000))
    assert facts["running"][0]["stopped_since"] == stopped_at


class PointEachRead:
    """Facts that never change, and a new history point at every read, as the ticker gives."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> dict[str, Any]:
        self.reads += 1
        return {
            "cpus": {"total": 2, "free": 2},
            "running": [],
            "history_point": {"at": float(self.reads), "cpu_percent": 5.0},
        }

    def close(self) -> None:
        pass


def test_a_new_history_point_is_pushed_alone_and_the_unchanged_machine_is_not(wire):
    """Guards against a plot that moves only with the facts, or facts pushed with every point."""
    reader = PointEachRead()
    watch = MonitorWatch(interval_s=0.02, idle_interval_s=0.02, reader=reader)
    widget = MonitorWidget(watch=watch)
    assert "history_point" not in widget.machine
    widget._repr_mimebundle_()
    assert wait_until(lambda: len(wire.updates(widget)) >= 3)
    updates = wire.updates(widget)
    widget.close()
    assert all(set(update) <= {"history_point", "history"} for update in updates), updates
    ats = [update["history_point"]["at"] for update in updates]
    assert ats == sorted(ats) and len(set(ats)) == len(ats)


def test_the_monitors_text_plots_the_last_minutes_against_their_scales():
    """Guards against a history without a scale, which says nothing of how busy."""
    from fluksio_nb.overview import describe_history

    points = [
        {
            "at": 1000.0 + 2 * n,
            "cpu_percent": float(n),
            "cpu_outside_claims_percent": 10.0,
            "memory_used_bytes": 4_000_000_000,
            "memory_total_bytes": 16_000_000_000,
            "cards": [],
        }
        for n in range(101)
    ]
    head, cpu, ram = describe_history(points)
    assert head == "history  the last 3 min, oldest left"
    assert cpu.startswith("  cpu  |") and cpu.endswith(
        "| 0-100% · now 100% used, 10% outside claims"
    )
    assert "█" in cpu and " " in cpu.split("|")[1], "from idle to every core busy"
    assert ram.endswith("| 0-16.0GB · now 4.0GB/16.0GB used")


def test_a_running_claims_readings_reach_the_monitor(declared_machine, wire):
    """The monitor must show how each running claim is doing, not just that it runs."""
    from fluksio_nb import claim

    with claim(cpus=1, ram="500M", label="sleeper") as c:
        c.popen(["sleep", "5"])
        assert wait_until(lambda: c.readings.count >= 2)
        facts = MachineReader()()
        (entry,) = facts["running"]
        assert entry["label"] == "sleeper" and entry["mine"]
        assert entry["reading"]["rss_bytes"] > 0
        assert entry["budget_bytes"] and entry["budget_bytes"] <= 500_000_000
        assert entry["peak_rss_bytes"] >= entry["reading"]["rss_bytes"]
        assert abs(entry["started"] - time.time()) < 60
    assert running_statuses() == {}, "an ended claim stayed registered"
    assert MachineReader()()["running"] == []


def test_monitor_is_public_and_its_text_is_the_snapshot(wire, declared_machine):
    """`from fluksio_nb import monitor` is the documented way in; its text is what the CLI says."""
    import fluksio_nb
    from fluksio_nb.overview import kernel_snapshot

    assert fluksio_nb.monitor is monitor
    widget = monitor()
    data, _ = widget._repr_mimebundle_()
    said = data["text/plain"]
    assert said.split("\n", 1)[1].startswith(describe_snapshot(kernel_snapshot()) + "\n"), said
    assert re.search(r"^this kernel  RSS \d+\.\dMB$", said, re.M), said
    assert WIDGET_VIEW in data
    assert widget.machine["cpus"] == {"total": 4, "free": 4}
    widget.close()


# -----------------------------------------------------------------------------
# In a kernel
# -----------------------------------------------------------------------------


IN_A_KERNEL = {
    "FLUKSIO_CPUS": "2",
    "FLUKSIO_GPUS": "0",
    "FLUKSIO_RAM": "4G",
    "FLUKSIO_RESERVE_CPUS": "0",
}


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from tests.kernels import started_kernel

    with started_kernel(tmp_path_factory.mktemp("kernel"), **IN_A_KERNEL) as k:
        yield k


def test_a_claimed_cell_shows_the_widget_and_its_record_takes_the_widgets_place(kernel):
    """The cell must get the live widget, updated at most twice a second, then one record.

    The record replaces the widget's display, so that a saved notebook holds
    no widget to fail on, and says how long the claim waited and ran.
    """
    started = time.monotonic()
    ran = kernel.run("%%claim cpus=1 --label slow\nimport time\ntime.sleep(3)", check=True)
    took = time.monotonic() - started
    # Its place is held, blank, from the claim's start: above anything the cell prints.
    (held,) = ran.of("display_data")
    assert held["content"]["data"] == {"text/plain": ""}
    shown, record = ran.of("update_display_data")
    assert shown["content"]["transient"] == held["content"]["transient"]
    assert WIDGET_VIEW in shown["content"]["data"]
    model = shown["content"]["data"][WIDGET_VIEW]["model_id"]
    assert shown["content"]["data"]["text/plain"] == (
        "slow: running when this was saved; `fluksio-nb usage` says how it ended"
    )
    assert record["content"]["transient"] == shown["content"]["transient"]
    assert WIDGET_VIEW not in record["content"]["data"]
    said = record["content"]["data"]["text/plain"]
    # Three seconds asleep, and whatever a loaded machine added to starting it.
    times = re.match(
        r"slow: ok · waited ([\d.]+) s(?:, started a worker in ([\d.]+) s)?, ran ([\d.]+) s · ",
        said,
    )
    assert times, said
    assert 3.0 <= float(times[3]) <= took, said
    assert float(times[1]) + float(times[2] or 0) + float(times[3]) <= took + 0.3, said
    updates = [
        m for m in kernel.seen if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == model
    ]
    assert len(updates) <= 2 * took + 2, f"{len(updates)} updates in {took:.1f} s"
    closed = [
        m for m in kernel.seen if m["msg_type"] == "comm_close" and m["content"]["comm_id"] == model
    ]
    assert closed, "the widget whose display the record took is closed"


def test_claims_shows_the_live_monitor(kernel):
    """%claims must show the widget, with the machine as text beside it."""
    ran = kernel.run("%claims", check=True)
    (result,) = ran.of("execute_result")
    data = result["content"]["data"]
    assert WIDGET_VIEW in data
    assert data["text/plain"].splitlines()[1] == "cpus  0/2 used"


def test_the_monitor_in_a_kernel_keeps_history_and_shows_the_kernels_memory(kernel):
    """Guards against a plot that never fills in a real kernel, or a kernel's RSS never shown."""
    ran = kernel.run("%claims", check=True)
    (result,) = ran.of("execute_result")
    assert re.search(r"^this kernel  RSS \d+\.\dMB$", result["content"]["data"]["text/plain"], re.M)
    # Shown, so watched: the monitor's ticker feeds the kernel's history.
    kernel.run(
        "import time\nfrom fluksio_nb.machine_history import process_history\n"
        "deadline = time.monotonic() + 30\n"
        "while len(process_history().points()) < 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.1)",
        check=True,
    )
    points = kernel.facts("process_history().points()")
    assert len(points) >= 2, "the monitor was shown and its history did not fill"
    assert points[-1]["memory_total_bytes"] > 0
    ran = kernel.run("%claims", check=True)
    text = ran.of("execute_result")[0]["content"]["data"]["text/plain"]
    assert "history  the last " in text and "| 0-100% · now " in text


def test_a_claim_names_the_notebook_its_kernel_serves(tmp_path):
    """Guards against a monitor that names the user but not which of their notebooks."""
    from tests.kernels import started_kernel

    with started_kernel(
        tmp_path, JPY_SESSION_NAME="/home/ada/work/train.ipynb", **IN_A_KERNEL
    ) as k:
        k.run("%load_ext fluksio_nb", check=True)
        k.run("%%claim cpus=1 --background --label named\nimport time\ntime.sleep(30)", check=True)
        k.run(
            "import time\nfrom fluksio_nb.overview import kernel_snapshot\n"
            "deadline = time.monotonic() + 30\n"
            "while not kernel_snapshot()['running'] and time.monotonic() < deadline:\n"
            "    time.sleep(0.1)",
            check=True,
        )
        (claim,) = k.facts("kernel_snapshot()['running']")
        assert claim["notebook"] == "/home/ada/work/train.ipynb"
        text = k.run("%claims", check=True).of("execute_result")[0]["content"]["data"]
        (line,) = [s for s in text["text/plain"].splitlines() if s.startswith("running")]
        assert re.match(r"running  named( \(yours\))? in /home/ada/work/train\.ipynb: cpus=1", line)


def test_without_ray_the_monitor_has_no_ray_section_and_imports_no_ray(kernel):
    """A kernel that never used Ray must see nothing of it, and pay nothing for it."""
    ran = kernel.run("%claims", check=True)
    (result,) = ran.of("execute_result")
    data = result["content"]["data"]
    model_id = data[WIDGET_VIEW]["model_id"]
    (opened,) = [m for m in ran.of("comm_open") if m["content"]["comm_id"] == model_id]
    assert "ray" not in opened["content"]["data"]["state"]["machine"]
    assert not any(line.startswith("ray") for line in data["text/plain"].splitlines())
    assert kernel.facts("'ray' in __import__('sys').modules") is False
