"""The worker a claimed cell runs in: what reaches it, what comes back, how it ends.

Everything here runs real worker processes. The failures that matter are the
ones a notebook user cannot see through: output that only appears when the
cell ends, a stop button that does nothing, a worker that dies and leaves the
cell waiting forever, and processes that outlive the kernel holding a GPU.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import fluksio_nb
from fluksio_nb import segments
from fluksio_nb.errors import UnsendableInput
from fluksio_nb.worker.client import Sink, Worker
from fluksio_nb.worker.protocol import Channel, ChannelClosed
from tests.kernels import LEAVES_THREE_RUNNING
from tests.stops import said_by
from tests.waiting import has_ended, living_in_group, wait_until

pytestmark = pytest.mark.timeout(30)


class Recorder(Sink):
    """Every call the worker made, in order, with when it arrived."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object, float]] = []
        self.stdout_seen = threading.Event()

    def stdout(self, text: str) -> None:
        self.events.append(("stdout", text, time.monotonic()))
        self.stdout_seen.set()

    def stderr(self, text: str) -> None:
        self.events.append(("stderr", text, time.monotonic()))

    def display(self, data, metadata) -> None:
        self.events.append(("display", data, time.monotonic()))

    def result(self, data, metadata) -> None:
        self.events.append(("result", data, time.monotonic()))

    def error(self, ename, evalue, traceback) -> None:
        self.events.append(("error", (ename, evalue, traceback), time.monotonic()))

    def text(self, stream: str = "stdout") -> str:
        return "".join(payload for kind, payload, _ in self.events if kind == stream)

    def of(self, kind: str) -> list:
        return [payload for seen, payload, _ in self.events if seen == kind]


def cell(source: str) -> str:
    return textwrap.dedent(source).strip()


def interrupt_once_it_prints(worker: Worker, recorder: Recorder, stop=None) -> None:
    """Interrupt from another thread, the way the kernel's stop button would arrive.

    Every cell this stops prints, then sleeps; the stop comes the instant it
    prints, so now and then it lands as the cell goes to sleep, in CPython's
    own race (see ``test_a_stop_the_sleeping_main_thread_never_saw_still_stops_the_cell``).
    """

    def wait_then_stop() -> None:
        recorder.stdout_seen.wait(10)
        (stop or worker.interrupt)()

    threading.Thread(target=wait_then_stop, daemon=True).start()


def assert_stopped_and_still_usable(outcome, worker: Worker) -> None:
    """The cell ended in the user's ``KeyboardInterrupt``, and the worker runs the next one."""
    assert outcome.status == "error", outcome.description
    assert outcome.error.ename == "KeyboardInterrupt"
    assert outcome.interrupted
    assert worker.alive
    assert worker.run("1 + 1").ok


@pytest.fixture(scope="module")
def worker():
    """One worker for the tests that leave it usable, which is also what they check."""
    with Worker(dict(os.environ)) as shared:
        yield shared


@pytest.fixture
def own_worker():
    """A worker of its own, for a test that may kill it."""
    with Worker(dict(os.environ)) as fresh:
        yield fresh


# -----------------------------------------------------------------------------
# What reaches the worker
# -----------------------------------------------------------------------------


def test_the_cell_sees_the_environment_the_worker_was_started_with():
    """The whole point: a share is only honoured if the env reaches the import."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "1"}
    with Worker(env) as started:
        outcome = started.run(
            "import os\nseen = {k: os.environ.get(k) for k in ('OMP_NUM_THREADS', "
            "'CUDA_VISIBLE_DEVICES')}",
            outputs=["seen"],
        )
    assert outcome.outputs["seen"] == {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "1"}


def test_a_fluksio_nb_folder_where_the_kernel_works_does_not_replace_the_workers_package(
    tmp_path,
):
    """A checkout of this project opened in JupyterLab must not become the worker's code."""
    decoy = tmp_path / "fluksio_nb"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy was imported')\n")
    with Worker(dict(os.environ), cwd=tmp_path) as worker:
        outcome = worker.run("import fluksio_nb\nwhere = fluksio_nb.__file__", outputs=["where"])
    assert outcome.ok, outcome.description
    assert outcome.outputs["where"] == fluksio_nb.__file__


def test_a_worker_starts_and_runs_a_cell_without_the_kernels_books(own_worker):
    """Guards against a worker paying for the kernel's side as it starts: the settings,
    the books and pydantic under them were half of a fresh worker's start, paid by
    every claimed cell that waited for one, and the worker uses none of them."""
    outcome = own_worker.run(
        "import sys\n"
        "loaded = sorted(name for name in sys.modules if name == 'pydantic' or name in ("
        "'fluksio_nb.settings', 'fluksio_nb.books', 'fluksio_nb.budget', "
        "'fluksio_nb.memory_cap', 'fluksio_nb.worker.client'))",
        outputs=["loaded"],
    )
    assert outcome.ok, outcome.description
    assert outcome.outputs["loaded"] == []


def test_a_message_the_kernel_cannot_read_ends_the_worker_instead_of_hanging():
    """Guards against a kernel waiting forever for a cell's end that it could not read."""
    with Worker(dict(os.environ)) as worker:
        outcome = worker.run(
            "class Unreadable:\n"
            "    def __reduce__(self):\n"
            "        return (int, ('not a number',))\n"
            "get_ipython().report.channel.send(Unreadable())\n"
            "import time\ntime.sleep(60)"
        )
        assert outcome.status == "died"
        assert "sent a message this kernel cannot read" in outcome.died
        assert not worker.alive


def test_inputs_arrive_and_outputs_come_back(worker):
    """Inputs missing in the worker, or results left behind in it, make claiming useless."""
    array = np.arange(1_000_000, dtype=np.float64)
    outcome = worker.run(
        "scaled = array * factor\nother = 1",
        inputs={"array": array, "factor": 2.0},
        outputs=["scaled", "never_made"],
    )
    assert outcome.ok
    np.testing.assert_array_equal(outcome.outputs["scaled"], array * 2.0)
    assert set(outcome.outputs) == {"scaled"}
    assert outcome.absent == ("never_made",) and outcome.failed == {}
    assert outcome.not_brought_back(by_hand=True) == {"never_made": "the cell did not define it"}
    assert outcome.not_brought_back(by_hand=False) == {}


def test_without_named_outputs_only_what_the_cell_bound_comes_back(worker):
    """Sending back modules, `_private` names, In/Out or unchanged inputs clutters the kernel."""
    outcome = worker.run(
        "import json\n_scratch = 1\nmade = given + 1\nchanged = 2",
        inputs={"given": 1, "changed": 1},
    )
    assert outcome.outputs == {"made": 2, "changed": 2}
    assert outcome.failed == {}


def test_results_are_announced_as_sending_back_unless_they_pack_at_once(worker):
    """Guards the fast path for a few numbers: anything else is said to be on its way."""
    for code, announced in [
        ("n, f, s, nothing = 1, 2.5, 'short', None", False),
        ("listed = [1]", True),
        ("long_text = 'x' * 100_000", True),
        ("class Number(int): pass\nsubclassed = Number(1)", True),
    ]:
        heard: list[tuple[int, int]] = []
        outcome = worker.run(code, on_sending_back=lambda *told, heard=heard: heard.append(told))
        assert outcome.ok, outcome.error
        assert outcome.outputs, code
        assert bool(heard) is announced, code


def test_an_unpicklable_output_is_reported_by_name_and_the_rest_still_arrive(worker):
    """One lock in the namespace must not cost the user every other variable."""
    outcome = worker.run(
        "import threading\nlock = threading.Lock()\nnumbers = (n for n in range(3))\nkept = 42"
    )
    assert outcome.ok
    assert outcome.outputs == {"kept": 42}
    assert set(outcome.failed) == {"lock", "numbers"}
    assert "pickle" in outcome.failed["lock"]


def test_an_input_that_cannot_be_sent_is_refused_before_the_cell_runs(worker):
    """A half-sent request would leave the worker waiting for bytes that never come."""
    with pytest.raises(UnsendableInput, match="'lock'"):
        worker.run("lock", inputs={"lock": threading.Lock()})
    assert worker.run("1 + 1").ok


def test_each_cell_starts_from_an_empty_namespace_but_imports_stay_warm(worker):
    """Claimed cells must not depend on each other, nor pay for `import torch` twice."""
    first = worker.run(
        "import sys\nimported_before = 'wave' in sys.modules\nimport wave\nleftover = 1"
    )
    assert first.outputs["imported_before"] is False
    second = worker.run(
        "import sys\nwarm = 'wave' in sys.modules\nleftover_gone = 'leftover' not in dir()"
    )
    assert second.outputs == {"warm": True, "leftover_gone": True}


def test_aliases_a_cell_made_or_dropped_are_as_they_were_for_the_next_cell(worker, tmp_path):
    """Guards the reset's shortcut past remaking IPython's aliases when no cell touched them."""
    worker.run("pass")  # a worker that has emptied itself once, as a warm one has
    touched = worker.run(
        "%alias say_hi echo hi\n%unalias ls\n"
        "aliases = get_ipython().alias_manager\n"
        "made, dropped = aliases.is_alias('say_hi'), not aliases.is_alias('ls')"
    )
    assert touched.outputs == {"made": True, "dropped": True}
    for _ in range(2):
        after = worker.run(
            "aliases = get_ipython().alias_manager\n"
            "made, ls = aliases.is_alias('say_hi'), aliases.retrieve_alias('ls')"
        )
        assert after.outputs["made"] is False
        assert after.outputs["ls"].startswith("ls ")
    (tmp_path / "inside").mkdir()
    recorder = Recorder()
    listed = worker.run("%ls $where", inputs={"where": str(tmp_path)}, sink=recorder)
    assert listed.ok, listed.error
    assert "inside" in recorder.text()


def test_a_cell_may_await_at_top_level_as_in_the_kernel(worker):
    """Guards the worker's shortcut past IPython's async check: a cell with `await` still runs."""
    outcome = worker.run(
        "import asyncio\nasync def twice(x):\n    await asyncio.sleep(0.01)\n    return 2 * x\n"
        "value = await twice(21)",
        outputs=["value"],
    )
    assert outcome.ok, outcome.error
    assert outcome.outputs["value"] == 42


def test_a_transform_a_cell_adds_rewrites_cells_the_worker_has_seen_before(own_worker):
    """Guards the worker's memory of IPython's rewrites: it never outlives a change to them."""
    seen = "value = 'as typed'\n%env FLUKSIO_SEEN=1"
    assert own_worker.run(seen, outputs=["value"]).outputs["value"] == "as typed"
    added = own_worker.run(
        "def rewrite(lines):\n"
        "    return [line.replace('as typed', 'rewritten') for line in lines]\n"
        "get_ipython().input_transformers_cleanup.append(rewrite)"
    )
    assert added.ok, added.error
    assert own_worker.run(seen, outputs=["value"]).outputs["value"] == "rewritten"
    removed = own_worker.run("get_ipython().input_transformers_cleanup.pop()")
    assert removed.ok, removed.error
    assert own_worker.run(seen, outputs=["value"]).outputs["value"] == "as typed"


def test_a_mistyped_magic_is_reported_as_an_error(worker):
    """IPython prints usage errors instead of raising; the notebook would show no error."""
    recorder = Recorder()
    outcome = worker.run("%no_such_magic", sink=recorder)
    assert outcome.error.ename == "UsageError"
    [(ename, evalue, _)] = recorder.of("error")
    assert ename == "UsageError"
    assert "no_such_magic" in evalue


def test_a_cell_asking_for_input_with_nobody_to_answer_gets_an_error_instead_of_hanging(worker):
    """A sink that cannot ask anyone refuses; input() waiting for an answer would hang."""
    outcome = worker.run("input('name? ')")
    assert outcome.error.ename == "StdinNotImplementedError"
    assert "Ask in a normal cell" in outcome.error.evalue
    assert worker.run("x = 1").ok


# -----------------------------------------------------------------------------
# What comes back while the cell runs
# -----------------------------------------------------------------------------


@pytest.mark.timeout(15)
def test_stdout_arrives_while_the_cell_is_still_running(worker, tmp_path):
    """Output relayed only at the end makes a long training loop look hung."""
    go = tmp_path / "go"
    recorder = Recorder()

    def let_it_go_once_heard() -> None:
        recorder.stdout_seen.wait(20)
        go.touch()

    threading.Thread(target=let_it_go_once_heard, daemon=True).start()
    # The cell goes on only once its line has arrived here: held back to its
    # end, the line would never let it, and the cell would time out.
    outcome = worker.run(
        cell(
            f"""
            import os, time
            print('epoch 1')
            deadline = time.monotonic() + 20
            while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
                time.sleep(0.01)
            print('arrived' if os.path.exists({str(go)!r}) else 'held back')
            """
        ),
        sink=recorder,
    )
    assert outcome.ok
    assert recorder.text() == "epoch 1\narrived\n"


def test_a_flood_of_lines_arrives_whole_in_order_and_in_a_few_messages(worker):
    """A message per line made a loop of prints 50 times slower than in a normal cell."""
    recorder = Recorder()
    outcome = worker.run(
        cell(
            """
            import sys
            for i in range(5000):
                print(i)
            print('then stderr', file=sys.stderr)
            print('last')
            """
        ),
        sink=recorder,
    )
    assert outcome.ok
    assert recorder.text() == "".join(f"{i}\n" for i in range(5000)) + "last\n"
    streams = [(kind, text) for kind, text, _ in recorder.events if kind in ("stdout", "stderr")]
    stderr_at = streams.index(("stderr", "then stderr\n"))
    assert "".join(text for _, text in streams[:stderr_at]).endswith("4999\n")
    assert len(streams) < 100, f"{len(streams)} messages for 5002 lines"


def test_output_of_child_processes_and_c_code_is_relayed(worker):
    """`!cmd`, os.system and printf write to fd 1, which sys.stdout never sees."""
    recorder = Recorder()
    outcome = worker.run(
        cell(
            """
            import ctypes, os
            !echo from-the-shell
            os.system("echo from-os-system >&2")
            ctypes.CDLL(None).printf(b"from-c\\n")
            """
        ),
        sink=recorder,
    )
    assert outcome.ok
    assert "from-the-shell" in recorder.text("stdout")
    assert "from-c" in recorder.text("stdout")
    assert "from-os-system" in recorder.text("stderr")


def test_output_keeps_the_order_the_cell_produced_it_in(worker):
    """A print relayed after the display that followed it tells the story backwards."""
    recorder = Recorder()
    worker.run("print('before')\ndisplay('shown')\nprint('after')", sink=recorder)
    order = [
        "display" if kind == "display" else payload.strip()
        for kind, payload, _ in recorder.events
        if payload != "\n"
    ]
    assert order == ["before", "display", "after"]


def test_a_sink_that_overrides_forward_gets_every_output_as_a_message(worker):
    """The Ray outbox forwards messages unchanged; what the pipes carry must be one too."""

    class Forwarding(Sink):
        def __init__(self) -> None:
            self.messages: list[object] = []

        def forward(self, message) -> None:
            self.messages.append(message)

    sink = Forwarding()
    outcome = worker.run(
        "import os\nprint('framed')\nos.system('echo piped')\ndisplay('shown')\n1 / 0",
        sink=sink,
    )
    assert outcome.error.ename == "ZeroDivisionError"
    kinds = {type(message).__name__ for message in sink.messages}
    assert kinds == {"Stream", "Display", "Error"}
    streamed = "".join(message.text for message in sink.messages if hasattr(message, "text"))
    assert "framed\n" in streamed
    assert "piped\n" in streamed


def test_display_data_and_the_last_expression_come_back_as_mime_bundles(worker):
    """Rich output is why people use notebooks; a text-only worker would lose it."""
    recorder = Recorder()
    worker.run(
        cell(
            """
            from IPython.display import HTML, display
            display(HTML("<b>shown</b>"))

            class Report:
                def _repr_html_(self):
                    return "<i>returned</i>"

            Report()
            """
        ),
        sink=recorder,
    )
    [shown] = recorder.of("display")
    [returned] = recorder.of("result")
    assert shown["text/html"] == "<b>shown</b>"
    assert returned["text/html"] == "<i>returned</i>"
    assert "text/plain" in returned


def test_a_matplotlib_figure_comes_back_as_a_png(worker):
    """Plots are the commonest output of a claimed cell and must not vanish."""
    pytest.importorskip("matplotlib", reason="the figure test needs matplotlib")
    recorder = Recorder()
    outcome = worker.run(
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3]);",
        sink=recorder,
    )
    assert outcome.ok
    figures = [data for data in recorder.of("display") if "image/png" in data]
    assert len(figures) == 1
    assert base64.b64decode(figures[0]["image/png"]).startswith(b"\x89PNG")


def test_an_exception_comes_back_with_its_traceback_and_the_worker_stays_usable(worker):
    """A failing cell is routine; it must read like IPython and cost nothing else."""
    recorder = Recorder()
    outcome = worker.run("def divide():\n    return 1 / 0\ndivide()", sink=recorder)
    assert outcome.status == "error"
    assert outcome.error.ename == "ZeroDivisionError"
    [(ename, evalue, traceback)] = recorder.of("error")
    assert (ename, evalue) == ("ZeroDivisionError", "division by zero")
    rendered = "\n".join(traceback)
    assert "\x1b[" in rendered, "the traceback should keep IPython's colours"
    assert "return 1 / 0" in re.sub(r"\x1b\[[0-9;]*m", "", rendered)
    assert worker.run("1 + 1").ok


# -----------------------------------------------------------------------------
# Stopping a cell
# -----------------------------------------------------------------------------


def test_interrupt_stops_a_sleeping_cell_and_the_worker_stays_usable(own_worker):
    """The stop button has to work, and stopping a cell must not cost the worker."""
    recorder = Recorder()
    interrupt_once_it_prints(own_worker, recorder)
    # Unstopped, the cell would end a minute later, as a success the check below refuses.
    outcome = own_worker.run("import time\nprint('sleeping')\ntime.sleep(60)", sink=recorder)
    assert_stopped_and_still_usable(outcome, own_worker)


def test_a_stop_the_sleeping_main_thread_never_saw_still_stops_the_cell(own_worker):
    """A SIGINT taken but not acted on would leave the cell asleep until the worker is killed.

    That is what CPython's race does to a stop that lands as a cell goes to
    sleep: the signal is flagged, and the sleep goes on. Here the cell builds
    that state on purpose: its main thread does not take SIGINT, so a thread
    of its own does, which flags it and wakes nobody. That thread says when
    to stop, just after the main thread has gone to sleep.
    """
    recorder = Recorder()
    interrupt_once_it_prints(own_worker, recorder)
    outcome = own_worker.run(
        cell(
            """
            import signal, threading, time
            main_thread_deaf, over = threading.Event(), threading.Event()
            def say_it_sleeps():
                main_thread_deaf.wait()
                print("sleeping")
                over.wait(60)
            saying = threading.Thread(target=say_it_sleeps, daemon=True)
            saying.start()
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                main_thread_deaf.set()
                time.sleep(60)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
                # Left running, the thread would take the worker with it.
                over.set()
                saying.join()
            """
        ),
        sink=recorder,
    )
    assert_stopped_and_still_usable(outcome, own_worker)


class StopWhenItPrints(Recorder):
    """Says when the cell first printed, and keeps nothing of what it printed."""

    def stdout(self, text: str) -> None:
        self.stdout_seen.set()


def test_a_stop_held_back_for_a_frame_still_stops_a_cell_whose_main_thread_blocks_sigint(
    own_worker,
):
    """A stop that lands as the cell's main thread sends a frame waits for the frame to be whole.

    It was then raised again at the main thread alone, which this cell keeps
    from taking SIGINT: it stayed pending there, and the cell printed on until
    the worker was killed. The stop the kernel sent, to the whole process, is
    taken by a thread of the cell's own and lands in the main thread anyway;
    the one held back must do the same. The cell spends nearly all its time
    sending frames, so the stop lands in one.
    """
    recorder = StopWhenItPrints()
    interrupt_once_it_prints(own_worker, recorder)
    outcome = own_worker.run(
        cell(
            """
            import signal, threading, time
            threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            line = "x" * (1 << 16)
            try:
                while True:
                    print(line, flush=True)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            """
        ),
        sink=recorder,
    )
    assert_stopped_and_still_usable(outcome, own_worker)


def test_a_cell_that_ignores_sigint_is_killed_with_everything_it_started(own_worker):
    """A cell deaf to SIGINT would otherwise hold its share, and its children, for ever."""
    recorder = Recorder()
    interrupt_once_it_prints(own_worker, recorder)
    # Unkilled, the cell would end a minute later, alive: `died` says which.
    outcome = own_worker.run(
        cell(
            """
            import signal, subprocess, time
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            child = subprocess.Popen(["sleep", "60"])
            print("deaf")
            time.sleep(60)
            """
        ),
        sink=recorder,
    )
    assert outcome.died
    assert outcome.interrupted
    assert "did not stop" in outcome.description
    assert not own_worker.alive
    # Killed with the group, and gone once the scheduler lets it die: on a
    # crowded machine, a moment after the worker itself was reaped.
    assert wait_until(lambda: living_in_group(own_worker.pid) == [])


def test_an_interrupt_that_arrives_after_its_cell_ended_does_not_touch_the_next_one(
    own_worker,
):
    """The ladder's SIGINT can race the end of a cell; it must not kill the idle worker."""
    assert own_worker.run("1 + 1").ok
    os.killpg(own_worker.pid, signal.SIGINT)
    time.sleep(0.1)
    outcome = own_worker.run("import time\ntime.sleep(0.2)\nfinished = True")
    assert outcome.ok
    assert outcome.outputs == {"finished": True}


@pytest.mark.parametrize("deaf_to_sigint", [False, True], ids=["stops", "ignores-sigint"])
def test_keyboard_interrupt_in_the_calling_thread_stops_the_cell_and_is_reraised(
    own_worker, deaf_to_sigint
):
    """The stop button interrupts the kernel's thread inside run(); the cell must stop too."""
    recorder = Recorder()
    interrupt_once_it_prints(own_worker, recorder, stop=lambda: os.kill(os.getpid(), signal.SIGINT))
    deafness = "signal.signal(signal.SIGINT, signal.SIG_IGN)\n" if deaf_to_sigint else ""
    with pytest.raises(KeyboardInterrupt):
        own_worker.run(
            f"import signal, time\n{deafness}print('sleeping')\ntime.sleep(60)", sink=recorder
        )
    if deaf_to_sigint:
        assert not own_worker.alive
        assert wait_until(lambda: living_in_group(own_worker.pid) == [])
    else:
        assert own_worker.run("1 + 1").ok


@contextlib.contextmanager
def crowded_core(others: int):
    """One of this machine's cores, shared with ``others`` processes that never stop computing.

    Each is a session of its own, so that the scheduler's grouping of
    sessions does not fold them into one share.
    """
    core = max(os.sched_getaffinity(0))
    # Each moves itself: a preexec_fn is not safe in a process with threads.
    hog = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    hogs = [
        subprocess.Popen([sys.executable, "-c", hog], start_new_session=True) for _ in range(others)
    ]
    try:
        yield core
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_worker_answering_a_stop_on_a_crowded_core_is_not_killed_as_deaf(own_worker):
    """On a loaded machine an answer to SIGINT is slow, not absent: the worker and its state live.

    The cell tidies up for 0.6 s of CPU after the stop, on a core it shares
    with four busy processes: several seconds by the clock, and far less than
    the grace by the chances it had.
    """
    recorder = Recorder()
    with crowded_core(4) as core:
        os.sched_setaffinity(own_worker.pid, {core})
        interrupt_once_it_prints(own_worker, recorder)
        outcome = own_worker.run(
            textwrap.dedent(
                """
                import signal, time

                def tidy_up(signum, frame):
                    started = time.thread_time()
                    while time.thread_time() - started < 0.6:
                        pass
                    raise KeyboardInterrupt

                signal.signal(signal.SIGINT, tidy_up)
                print("sleeping")
                time.sleep(60)
                """
            ),
            sink=recorder,
        )
    assert outcome.interrupted
    assert not outcome.died, outcome.description
    assert outcome.error is not None and outcome.error.ename == "KeyboardInterrupt"
    assert own_worker.run("1 + 1").ok


# -----------------------------------------------------------------------------
# How a worker ends
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "returncode", "said"),
    [
        ("import ctypes\nctypes.string_at(0)", -signal.SIGSEGV, "died from SIGSEGV (signal 11)"),
        ("import os\nos._exit(3)", 3, "exited with code 3"),
    ],
    ids=["segfault", "os-exit"],
)
def test_a_worker_that_dies_says_how(own_worker, code, returncode, said):
    """A crash reported as a hang, or as nothing at all, leaves the user guessing."""
    outcome = own_worker.run(code)
    assert outcome.died
    assert outcome.returncode == returncode
    assert said in outcome.description
    assert "while running the cell" in outcome.description
    assert not own_worker.alive
    again = own_worker.run("1 + 1")
    assert again.died and "already ended" in again.description


def test_a_cell_that_closes_the_workers_channel_is_told_so_not_blamed_on_memory(own_worker):
    """Guards against a cell that closed every descriptor (os.closerange) being told the
    out-of-memory killer ended it, when the kernel did, having lost its channel."""
    outcome = own_worker.run("import os\nos.closerange(3, 4096)\nimport time\ntime.sleep(60)")
    assert outcome.died
    assert "closed its channel to the kernel and lived on" in outcome.description
    assert "out-of-memory" not in outcome.description
    assert not own_worker.alive


def test_a_worker_killed_from_outside_says_sigkill(own_worker):
    """The out-of-memory killer's SIGKILL must read as a death, not a hang."""
    recorder = Recorder()
    interrupt_once_it_prints(
        own_worker, recorder, stop=lambda: os.kill(own_worker.pid, signal.SIGKILL)
    )
    outcome = own_worker.run("import time\nprint('running')\ntime.sleep(60)", sink=recorder)
    assert outcome.died
    assert outcome.signal_name == "SIGKILL"
    assert "died from SIGKILL" in outcome.description


def test_the_processes_a_cell_leaves_running_end_with_it_and_the_worker_goes_on():
    """A forgotten `sleep` is harmless; a forgotten trainer holds the GPU for ever."""
    with Worker(dict(os.environ)) as started:
        recorder = Recorder()
        assert started.run(LEAVES_THREE_RUNNING, sink=recorder).ok
        left = [int(pid) for pid in recorder.text().split()]
        assert len(left) == 3
        assert wait_until(lambda: all(has_ended(pid) for pid in left), timeout=10)
        assert started.alive
        assert started.run("1 + 1").ok


def test_a_worker_killed_mid_cell_takes_the_processes_its_cell_started():
    started = Worker(dict(os.environ))
    recorder = Recorder()
    interrupt_once_it_prints(started, recorder, stop=started.kill)
    outcome = started.run(LEAVES_THREE_RUNNING + "import time\ntime.sleep(60)", sink=recorder)
    assert outcome.died
    left = [int(pid) for pid in recorder.text().split()]
    assert len(left) == 3
    assert wait_until(lambda: all(has_ended(pid) for pid in left), timeout=10)
    assert has_ended(started.pid)


def stand_in_kernel(script: str) -> subprocess.Popen:
    """A process playing a kernel: runs ``script``, whose stdout the test reads."""
    return subprocess.Popen(
        [sys.executable, "-c", cell(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def holding(name: str) -> list[int]:
    """The processes that hold a descriptor or a mapping of a file called ``name``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            if any(name in link for link in links) or name in Path(f"/proc/{pid}/maps").read_text():
                found.append(int(pid))
    return found


@pytest.mark.timeout(20)
def test_a_killed_kernels_kept_shared_memory_goes_with_it():
    """Guards against the memory a kernel keeps for reuse outliving a kill -9 of it."""
    kernel = stand_in_kernel(
        """
        import os, sys
        import numpy as np
        from fluksio_nb.worker.client import Worker

        worker = Worker(dict(os.environ))
        worker.run("b = a", inputs={"a": np.ones(2**20)}, outputs=["b"])
        print(worker.pid, flush=True)
        sys.stdin.read()
        """
    )
    named = Path(segments.SEGMENT_DIR).glob
    pattern = f"{segments.SEGMENT_PREFIX}{kernel.pid}-*"
    kept = f"memfd:{segments.SEGMENT_PREFIX}{kernel.pid}-kept"
    try:
        worker_pid = int(kernel.stdout.readline())
        assert kernel.pid in holding(kept), "the kernel keeps the memory it sent, to reuse it"
        kernel.kill()
        kernel.wait()
        assert wait_until(lambda: has_ended(worker_pid), timeout=5)
        assert holding(kept) == [], "nobody holds the killed kernel's memory any more"
        assert list(named(pattern)) == [], "and it left no file behind"
    finally:
        kernel.kill()
        kernel.wait()
        kernel.stdout.close()
        for path in named(pattern):
            path.unlink(missing_ok=True)


@pytest.mark.timeout(20)
def test_the_worker_ends_when_its_kernel_dies():
    """A kernel killed by the OOM killer must not leave a worker holding its share."""
    kernel = stand_in_kernel(
        """
        import os, sys
        from fluksio_nb.worker.client import Sink, Worker

        class Relay(Sink):
            def stdout(self, text):
                sys.stdout.write(text)
                sys.stdout.flush()

        worker = Worker(dict(os.environ))
        worker.run(
            "import os, subprocess, time\\n"
            "child = subprocess.Popen(['sleep', '60'])\\n"
            "print(os.getpid(), child.pid)\\n"
            "time.sleep(60)",
            sink=Relay(),
        )
        """
    )
    try:
        worker_pid, child_pid = map(int, kernel.stdout.readline().split())
        kernel.kill()
        kernel.wait()
        assert wait_until(lambda: has_ended(worker_pid) and has_ended(child_pid), timeout=5)
    finally:
        kernel.kill()
        kernel.wait()
        kernel.stdout.close()


# -----------------------------------------------------------------------------
# The channel
# -----------------------------------------------------------------------------


def test_a_large_array_crosses_the_channel_intact_and_writable():
    """Out-of-band buffers are the fast path; rebuilt read-only, `+=` on them would fail."""
    kernel_end, worker_end = (Channel(end) for end in socket.socketpair())
    array = np.random.default_rng(0).random(4_000_000)
    sender = threading.Thread(target=kernel_end.send, args=({"array": array},))
    sender.start()
    received = worker_end.receive()["array"]
    sender.join()
    np.testing.assert_array_equal(received, array)
    received += 1
    kernel_end.close()
    worker_end.close()


def test_a_peer_that_goes_away_mid_frame_raises_instead_of_hanging():
    """A reader blocked for ever on a dead peer is a notebook that never answers."""
    ours, theirs = socket.socketpair()
    channel = Channel(ours)
    body = pickle.dumps({"type": "display"}, protocol=5)
    theirs.sendall(len(body).to_bytes(8, "little") + (0).to_bytes(4, "little") + body[:3])
    theirs.close()
    with pytest.raises(ChannelClosed, match="middle of a frame"):
        channel.receive()
    with pytest.raises(ChannelClosed):
        channel.send({"type": "run"})


def test_a_peer_that_goes_away_between_frames_raises_channel_closed():
    """The ordinary way a worker dies must be told apart from a torn frame."""
    ours, theirs = socket.socketpair()
    theirs.close()
    with pytest.raises(ChannelClosed, match="between frames"):
        Channel(ours).receive()


# -----------------------------------------------------------------------------
# A card memory budget, handed to torch
# -----------------------------------------------------------------------------

#: torch's own calls the worker makes, and nothing else: this machine has no card.
_STAND_IN_TORCH_CUDA = """
calls = []
_initialised = False

def is_initialized():
    return _initialised

def init():
    global _initialised
    _initialised = True

def device_count():
    return 2

def set_per_process_memory_fraction(fraction, device=None):
    if not _initialised:
        raise RuntimeError("set_per_process_memory_fraction initialises CUDA")
    calls.append((fraction, device))
"""


def test_torch_is_held_to_the_card_budget_once_it_uses_a_card_and_not_before(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("from . import cuda\n")
    (tmp_path / "torch" / "cuda.py").write_text(_STAND_IN_TORCH_CUDA)
    env = {**os.environ, "FLUKSIO_GPU_MEMORY_FRACTION": "0.250"}
    with Worker(env) as started:
        imported = cell(f"""
            import sys
            sys.path.insert(0, {str(tmp_path)!r})
            import torch
        """)
        started.run(imported)
        before = started.run("import torch\ncalls = list(torch.cuda.calls)", outputs=["calls"])
        started.run("import torch\ntorch.cuda.init()")
        after = started.run("import torch\ncalls = list(torch.cuda.calls)", outputs=["calls"])
    assert before.outputs["calls"] == []
    assert after.outputs["calls"][:2] == [(0.25, 0), (0.25, 1)]


def _frames(tb) -> list[str]:
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def test_a_traceback_ends_at_the_users_frame_not_in_fluksio_nbs_code_below_it():
    """A stop that lands in our stream, which the user's print called, shows the user's line."""
    from fluksio_nb.resources import ask
    from fluksio_nb.worker.shell import without_our_last_frames

    def users_cell():
        ask(cpus=-1)  # fluksio_nb's own code raises, below the user's line

    try:
        users_cell()
    except Exception as error:
        tb = error.__traceback__
    assert len(_frames(tb)) > 2, "the error was raised below the user's frame"
    assert _frames(without_our_last_frames(tb))[-1] == "users_cell"

    # A traceback all of fluksio_nb's is a fault of ours, and is left whole.
    try:
        ask(cpus=-1)
    except Exception as error:
        ours = error.__traceback__.tb_next
    whole = _frames(ours)
    assert _frames(without_our_last_frames(ours)) == whole


def test_a_stop_raised_as_a_with_of_ours_ends_shows_the_users_line():
    """A stop held back while a frame went out is raised as our ``with`` ends, inside the
    standard library's contextlib: the traceback still ends at the user's line."""
    import os
    import signal

    from fluksio_nb.stop_button import stop_held_back
    from fluksio_nb.worker.shell import without_our_last_frames

    def users_cell():
        with stop_held_back():  # a with of ours that holds the stop back, as a frame's does
            os.kill(os.getpid(), signal.SIGINT)

    try:
        users_cell()
    except KeyboardInterrupt as error:
        tb = error.__traceback__
    assert "__exit__" in _frames(tb), "the stop was not raised as the with ended"
    assert _frames(without_our_last_frames(tb))[-1] == "users_cell"


#: A cell that prints, the stop pressed at every moment Python could run its
#: handler in the worker's output code and the threading module's under it, one
#: moment a round (as a function starts, and as a call into C returns); after
#: each, a line from another thread must still go out.
STOP_AT_EVERY_MOMENT_OF_A_PRINT = """
import threading, time
import fluksio_nb.worker.streams as streams
from fluksio_nb.worker.streams import Outbox

box = Outbox(lambda message: None)

def attempt(made):
    for line in ("one\\n", "two\\n", "three\\n"):
        box.write("stdout", line)

def one_more_line():
    box.write("stdout", "after the stop\\n")
    box.flush()

def check():
    if not finishes(one_more_line):
        return "output_stuck_after_a_stop"
    time.sleep(streams.BATCH_S)  # the next round starts after a quiet spell, as a cell's does

each_moment([streams.__file__, threading.__file__], attempt, lambda made: None, check)
"""


def test_a_stop_at_any_moment_of_a_print_leaves_the_cells_output_going():
    """Guards against a stop landing as ``Condition.__enter__`` returned in a print, which
    left the output's lock held by no ``with``: the worker's every later print, in that
    cell and the next, waited for it for ever."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_PRINT, timeout=25)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 10, said


#: A worker started, the stop pressed at every moment of fluksio_nb's code in
#: the start, one moment a round; after each, the worker made is closed, and no
#: process may be left running and no descriptor open that was not before.
STOP_AT_EVERY_MOMENT_OF_A_WORKERS_START = """
import glob, os
import psutil
import fluksio_nb
from fluksio_nb.worker.client import Worker

descriptors = len(os.listdir("/proc/self/fd"))

def attempt(made):
    made["worker"] = Worker({})

def undo(made):
    if "worker" in made:
        made["worker"].close()

def check():
    if [child for child in psutil.Process().children() if child.status() != "zombie"]:
        return "a_worker_left_running"
    if len(os.listdir("/proc/self/fd")) > descriptors:
        return "a_descriptor_left_open"

here = os.path.dirname(fluksio_nb.__file__)
each_moment(glob.glob(os.path.join(here, "**", "*.py"), recursive=True), attempt, undo, check)
"""


@pytest.mark.timeout(300)
def test_a_stop_at_any_moment_of_a_workers_start_leaves_no_process_or_descriptor():
    """Guards against a stop landing as the worker's lifeline pipe was made, which left
    both its ends open for the kernel's life, and as a half-made worker was being wired
    up, which left its process running, owned by nobody."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_WORKERS_START, timeout=300)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 20, said
