"""``with claim(...) as c:`` from plain Python: the share, the env, run, popen.

The failures guarded against: a block whose work does not get the share's
environment, kernel thread pools left at every core inside the block (or
left limited after it), a subprocess that outlives its claim, and threads
using claims at once over-granting the machine.
"""

import os
import re
import subprocess
import sys
import threading
import time

import pytest
from threadpoolctl import threadpool_info

from fluksio_nb import ClaimHalted, RemoteError, accountant, claim
from fluksio_nb.errors import BadClaim, ClaimTimeout, UnsendableInput, WorkerDied
from fluksio_nb.local_claim import Claim
from fluksio_nb.resources import ask
from fluksio_nb.watch import Watch
from tests.kernels import started_kernel
from tests.stops import said_by
from tests.waiting import living_in_group, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def two_cores_one_card(monkeypatch):
    monkeypatch.setenv("FLUKSIO_CPUS", "2")
    monkeypatch.setenv("FLUKSIO_GPUS", "1")
    monkeypatch.setenv("FLUKSIO_RESERVE_CPUS", "0")


def read_env(name):
    import os

    return os.environ.get(name)


def test_the_block_holds_the_share_and_gives_it_back():
    with claim(cpus=2, gpus=1, label="block") as c:
        assert (c.allocation.cpus, c.allocation.gpus) == (2, (0,))
        assert c.env["OMP_NUM_THREADS"] == "2"
        assert c.env["CUDA_VISIBLE_DEVICES"] == "0"
        running = accountant().snapshot()["running"]
        assert [r["label"] for r in running] == ["block"]
    assert accountant().snapshot()["cpus"]["free"] == 2


def test_run_calls_the_function_in_a_worker_born_with_the_share():
    with claim(cpus=1, env={"MY_SETTING": "on"}) as c:
        assert c.run(read_env, "OMP_NUM_THREADS") == "1"
        assert c.run(read_env, "MY_SETTING") == "on"
        assert c.run(pow, 2, 10) == 1024


def test_an_exception_in_run_comes_back_with_the_workers_traceback():
    def fails():
        raise KeyError("inside the worker")

    with claim() as c, pytest.raises(RemoteError) as caught:
        c.run(fails)
    assert caught.value.ename == "KeyError"
    assert any("fails" in line for line in caught.value.traceback)


def test_what_c_run_cannot_send_is_named_as_the_caller_wrote_it():
    """Guards against "input '__fluksio_args__' cannot be sent ... create it inside the
    cell": names the caller never wrote, and a cell there is none of."""
    lock = threading.Lock()
    # A function the notebook defined: sent by value, with the globals it reads.
    notebook = {"__name__": "a_notebook", "lock": lock}
    exec("def uses_the_lock():\n    return lock.locked()", notebook)
    with claim() as c:
        with pytest.raises(UnsendableInput) as positional:
            c.run(print, "fine", lock)
        with pytest.raises(UnsendableInput) as keyword:
            c.run(print, "fine", sep=lock)
        with pytest.raises(UnsendableInput) as through_a_global:
            c.run(notebook["uses_the_lock"])
        assert c.run(pow, 2, 3) == 8, "the claim goes on after a refusal"
    said = [str(e.value) for e in (positional, keyword, through_a_global)]
    assert said[0].startswith("c.run cannot send its argument 2, a lock, to the worker ("), said
    assert said[1].startswith("c.run cannot send its argument sep=, a lock, to the worker ("), said
    assert said[2].startswith(
        "c.run cannot send the function uses_the_lock to the worker: it reads the global "
        "'lock', which cannot travel ("
    ), said
    assert not any("__fluksio" in text or "cell" in text for text in said), said


def test_a_worker_dying_in_c_run_says_the_block_still_holds_its_share():
    with claim() as c:
        with pytest.raises(WorkerDied) as died:
            c.run(os._exit, 3)
        assert c.run(pow, 2, 3) == 8
    said = str(died.value)
    assert "exited with code 3 while running c.run's function" in said, said
    assert said.endswith(
        "The block still holds its share, and its next c.run starts a fresh worker."
    )


def test_a_timeout_in_a_block_says_to_raise_timeout_not_the_magics_option():
    with claim(timeout=1) as c, pytest.raises(ClaimTimeout) as stopped:
        c.run(time.sleep, 60)
    said = str(stopped.value)
    assert said.endswith("Raise timeout=, or make each c.run do less."), said


def test_the_readings_print_as_their_figures():
    """Guards against `print(c.readings)` saying `<fluksio_nb.sampler.Readings object at 0x...>`."""
    with claim() as c:
        before = repr(c.readings)
        c.run(pow, 2, 3)
        after = repr(c.readings)
    assert before.startswith("<Readings: no reading yet; peak 0 bytes, mean 0% CPU"), before
    shown = re.fullmatch(
        r"<Readings: now (\d+) bytes, [\d.]+% CPU, \d+ processes; peak (\d+) bytes, "
        r"mean [\d.]+% CPU over \d+ readings>",
        after,
    )
    assert shown is not None, after
    assert 0 < int(shown.group(1)) <= int(shown.group(2)), after


def test_popen_starts_a_real_script_with_the_derived_env(tmp_path):
    script = tmp_path / "report.py"
    script.write_text("import os\nprint(os.environ['OPENBLAS_NUM_THREADS'], os.environ['EXTRA'])\n")
    with claim(cpus=2) as c:
        process = c.popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env={"EXTRA": "x"}
        )
        out, _ = process.communicate(timeout=30)
    assert out.split() == ["2", "x"]


def test_an_ended_claim_refuses_more_work_and_a_second_block():
    """Guards against work on a share the books have given back, maybe to someone else."""
    c = claim(cpus=1, label="once")
    with c:
        assert c.run(pow, 2, 3) == 8
    for more_work in (lambda: c.run(pow, 2, 3), lambda: c.popen(["true"]), c.__enter__):
        with pytest.raises(RuntimeError, match="once has ended"):
            more_work()
    assert accountant().snapshot()["running"] == []


def test_a_subprocess_still_running_when_the_block_ends_is_ended():
    with claim() as c:
        process = c.popen(["sleep", "60"])
    assert process.poll() is not None


def started_and_ready(c, script: str, ready) -> int:
    """``sh -c script`` in the claim, once it says it is ready (touches ``ready``): its group."""
    group = c.popen(["sh", "-c", script]).pid
    assert wait_until(ready.exists, 30), "the script never got ready"
    return group


def test_a_second_stop_while_a_stopped_claim_ends_still_gives_everything_back(tmp_path):
    """Guards against the stop button pressed twice, the second landing while the first
    one's cleanup ends the claim's processes (it gives them half a second to go): the
    share stayed held for the rest of the kernel's life, and the processes ran on."""
    pressed, ready = tmp_path / "second stop", tmp_path / "ready"
    # Pressed by the claim's own process as it is asked to end: inside the cleanup.
    second_stop = (
        f"trap 'touch \"{pressed}\"; kill -INT {os.getpid()}; exit' TERM; "
        f'sleep 300 & touch "{ready}"; wait'
    )
    with pytest.raises(KeyboardInterrupt), claim(cpus=2, label="stopped twice") as c:
        group = started_and_ready(c, second_stop, ready)
        raise KeyboardInterrupt  # the first stop
    assert pressed.exists(), "the second stop was never pressed"
    books = accountant().snapshot()
    assert books["running"] == [] and books["cpus"]["free"] == 2
    assert wait_until(lambda: not living_in_group(group), 30), "the claim's processes ran on"


#: A ``with claim()`` block entered and left, stopped at every moment in
#: fluksio_nb's code, one moment a round: its share must be back after each.
#: One moment is beyond reach of plain Python, as the block's ``__exit__``
#: starts: Python checks for the stop there, before any line of it runs. In a
#: kernel the cell's end catches up with it (the test after this one).
STOP_AT_EVERY_MOMENT_OF_A_BLOCK = """
import glob, os
import fluksio_nb
import fluksio_nb.lifecycle
from fluksio_nb import accountant, claim

def attempt(made):
    made["claim"] = claim(cpus=1, label="stopped")
    # As a `with` enters it; a stop that lands in here never reaches __exit__.
    made["claim"].__enter__()
    made["claim"].__exit__(None, None, None)

def check():
    if not books_clear():
        return "a_share_left_held"

here = os.path.dirname(fluksio_nb.__file__)
watched = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
beyond_reach = [(fluksio_nb.lifecycle.__file__, "__exit__")]
each_moment(watched, attempt, lambda made: None, check, beyond_reach)
"""


def test_a_stop_at_any_moment_of_a_block_gives_its_share_back():
    """Guards against a stop landing as a started claim noted itself held by its thread,
    or as its block's release started: its block was never entered, or never left
    whole, and nothing gave its share back."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_BLOCK, timeout=300)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 100, said


#: Pressed by the cell itself at the one moment no hold reaches: as the
#: block's ``__exit__`` starts, before any line of it runs.
STOPPED_AS_THE_BLOCK_ENDS = """
import signal, sys
from fluksio_nb import claim
from fluksio_nb.lifecycle import ClaimLifecycle

def press_as_exit_starts(frame, event, arg):
    if event == "call" and frame.f_code is ClaimLifecycle.__exit__.__code__:
        sys.setprofile(None)
        signal.raise_signal(signal.SIGINT)

def unlucky():
    sys.setprofile(press_as_exit_starts)
    with claim(cpus=1, label="unlucky"):
        pass
"""


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param("unlucky()", id="the stop ends the cell"),
        pytest.param(
            "try:\n    unlucky()\nexcept KeyboardInterrupt as stop:\n    caught = stop",
            id="the cell catches the stop",
        ),
    ],
)
def test_a_stop_as_a_blocks_exit_starts_gives_its_share_back_as_the_cell_ends(tmp_path, cell):
    """Guards against the stop landing as a block's ``__exit__`` starts, where nothing
    can hold it back: the block was gone and its share held for the rest of the
    kernel's life, every later claim of the machine queued behind it; and where
    the cell caught the stop, even after the kernel caught up with one it raised."""
    with started_kernel(tmp_path, FLUKSIO_CPUS="2", FLUKSIO_RESERVE_CPUS="0") as kernel:
        kernel.run(STOPPED_AS_THE_BLOCK_ENDS, check=True)
        ran = kernel.run(cell)
        if "caught" in cell:
            assert ran.error is None, ran.so_far()
            stop = kernel.facts(
                "[repr(caught), ''.join(__import__('traceback').format_tb(caught.__traceback__))]"
            )
        else:
            assert ran.error is not None, ran.so_far()
            stop = [
                ran.error["ename"],
                re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(ran.error["traceback"])),
            ]
        # Where the test meant to press: as the block's __exit__ started.
        assert "KeyboardInterrupt" in stop[0] and "__exit__" in stop[1], stop
        books = kernel.books()
        assert books["running"] == [] and books["cpus"]["free"] == 2, books
        # The kernel claims on as before.
        kernel.run("with claim(cpus=2):\n    pass", check=True)


#: Blocks that rightly stay open once the cell that entered them is over.
STILL_OPEN_AS_THE_CELL_ENDS = {
    "entered by hand": (
        "held = claim(cpus=1, label='kept')\nheld.__enter__()",
        "held.__exit__(None, None, None)",
    ),
    "in a generator": (
        "def holding():\n    with claim(cpus=1, label='kept'):\n        yield\n"
        "held = holding()\nnext(held)",
        "next(held, None)",
    ),
}


@pytest.mark.parametrize("how", STILL_OPEN_AS_THE_CELL_ENDS)
def test_a_block_that_outlives_its_cell_keeps_its_share_until_it_is_left(tmp_path, how):
    """Guards the catch-up as a cell ends against taking the share of a block that
    is still open: entered by hand, or in a generator, to be left in a later cell."""
    enter, leave = STILL_OPEN_AS_THE_CELL_ENDS[how]
    with started_kernel(tmp_path, FLUKSIO_CPUS="2", FLUKSIO_RESERVE_CPUS="0") as kernel:
        kernel.run(f"from fluksio_nb import claim\n{enter}", check=True)
        kernel.run("x = 1", check=True)
        assert [entry["label"] for entry in kernel.books()["running"]] == ["kept"]
        kernel.run(leave, check=True)
        assert kernel.books()["running"] == []


def test_a_cell_run_from_inside_a_block_leaves_the_block_its_share(tmp_path):
    """Guards the catch-up as a cell ends against a cell run inside a block (by
    ``run_cell``): the block below it is still running, and keeps its share."""
    with started_kernel(tmp_path, FLUKSIO_CPUS="2", FLUKSIO_RESERVE_CPUS="0") as kernel:
        ran = kernel.run(
            "from fluksio_nb import accountant, claim\n"
            "with claim(cpus=1, label='outer'):\n"
            "    get_ipython().run_cell('inner = 1')\n"
            "    print([e['label'] for e in accountant().snapshot()['running']])",
        )
        assert ran.error is None, ran.so_far()
        assert ran.stdout.strip() == "['outer']", ran.so_far()
        assert kernel.books()["running"] == []


#: ``c.run(f, array)`` inside a ``with claim()`` block, stopped at every moment
#: of fluksio_nb's code, one moment a round: as the block takes its share, as
#: the array is written into shared memory, as the worker is handed over, runs
#: the call and goes back to its pool, and as the block ends. After each: no
#: share held, no shared memory lent, no worker running outside the pool, and no
#: descriptor left open.
STOP_AT_EVERY_MOMENT_OF_C_RUN = """
import glob, os
import numpy
import fluksio_nb
import fluksio_nb.lifecycle
from fluksio_nb import claim, shelf

# Big enough to travel through shared memory, in a file its parcel must give back.
blob = numpy.zeros(40_000)
with claim(cpus=1, label="warm") as c:
    assert c.run(len, blob) == 40_000
shelf.clear_shelf()
last = {}

def attempt(made):
    with claim(cpus=1, label="stopped") as c:
        made["got"] = c.run(len, blob)

def undo(made):
    last["got"] = made.get("got")
    last["lent"] = any(kept.lent for kept in shelf._shelf._files.values())
    # Every round from an empty shelf, so that each takes the same path.
    shelf.clear_shelf()

def check():
    left = what_a_claim_left(last["lent"])
    if left:
        return left
    if descriptors_left_open(descriptors):
        return "a_descriptor_left_open"
    if last["got"] not in (None, 40_000):
        return f"c_run_returned_{last['got']!r}"

descriptors = len(os.listdir("/proc/self/fd"))
here = os.path.dirname(fluksio_nb.__file__)
watched = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
beyond_reach = [(fluksio_nb.lifecycle.__file__, "__exit__")]
each_moment(watched, attempt, undo, check, beyond_reach, forgotten=True)
"""


@pytest.mark.timeout(900)
def test_a_stop_at_any_moment_of_c_run_in_a_block_leaves_nothing_behind():
    """Guards against the stop button landing as ``c.run`` sends its arguments, hands
    the call to a worker, or takes the worker back: the share, the shared memory, a
    worker or a descriptor left held by nobody."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_C_RUN, timeout=900)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 500, said


def test_what_a_process_started_as_it_ended_goes_with_the_claim(tmp_path):
    """Guards against ending only the process a claim started: what it left running in
    its group, or started in answer to SIGTERM, ran on after the claim."""
    ready = tmp_path / "ready"
    leaves_one_behind = "sleep 300 & exit"
    starts_one_as_it_ends = (
        f"trap 'sleep 300 & exit' TERM; touch \"{ready}\"; while :; do sleep 0.05; done"
    )
    with claim(cpus=1) as c:
        left = c.popen(["sh", "-c", leaves_one_behind])
        left.wait(30)
        assert living_in_group(left.pid), "nothing was left running to end"
        ending = started_and_ready(c, starts_one_as_it_ends, ready)
    assert wait_until(lambda: not living_in_group(left.pid) and not living_in_group(ending), 30)


def test_a_claims_ended_subprocess_no_longer_keeps_the_sampling_thread():
    """The thread runs while something it samples runs, and not for good after."""
    watch = Watch(linger_s=0)
    with Claim(ask(cpus=1), watch=watch) as held:
        held.popen(["sleep", "60"])
        assert watch.running
    deadline = time.monotonic() + 30
    while watch.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not watch.running, "a subprocess that was ended is still being watched"


def test_a_subprocess_over_the_budget_is_halted():
    hog = (
        "b = bytearray(400 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
        "import time\ntime.sleep(30)"
    )
    with pytest.raises(ClaimHalted) as caught, claim(ram="150M") as c:
        process = c.popen([sys.executable, "-c", hog])
        process.wait(timeout=30)
        c.run(pow, 1, 1)  # the claim was stopped: further work is refused
    # Held by the kernel's cap or by the sampler: see test_memory_cap for which says what.
    assert "memory budget of 150.0MB" in str(caught.value)


def test_a_block_whose_subprocess_was_stopped_for_its_budget_ends_halted():
    """Ended "ok", its record and its usage line would hide why the subprocess died.

    Nothing in the block asks the claim anything after the subprocess is
    killed, by the kernel's cap or by the sampler; the block's end must notice.
    """
    hog = "b = bytearray(400 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
    with claim(ram="150M") as c:
        process = c.popen([sys.executable, "-c", hog + "import time\ntime.sleep(30)"])
        process.wait(timeout=30)
    assert process.returncode < 0, "the subprocess was meant to be stopped, not to finish"
    assert c.status.ending == "halted"
    assert "memory budget of 150.0MB" in c.status.message


def hold_nine_tenths_of(budget_bytes, told, then_grow):
    """In the worker: hold 90% of the budget (the warning stage), then grow past it when told."""
    import psutil

    held = []
    while psutil.Process().memory_info().rss < 0.9 * budget_bytes:
        held.append(bytearray(b"x") * 10**6)
    with open(told) as fifo:
        fifo.read()
    while then_grow:
        held.append(bytearray(b"x") * 10**6)
    return "let go"


@pytest.mark.parametrize("then_grow", [True, False], ids=["halted", "ends"])
def test_the_warning_stage_is_told_at_the_next_reading_unless_the_halt_comes_first(
    tmp_path, capfd, then_grow
):
    """A claim growing straight through its budget would hear its halt twice, as a warning first.

    The readings come 5 s apart here rather than every half second: the test
    tells the worker to grow once a reading has turned the claim amber, and
    the halt then has seconds, not a fraction of one, to come before the next
    reading, however crowded the machine.
    """
    told = tmp_path / "told"
    os.mkfifo(told)
    with Claim(ask(ram="400M"), watch=Watch(interval_s=5, linger_s=0)) as held:

        def tell_once_amber():
            if wait_until(lambda: held.status.memory_warning, timeout=60):
                with open(told, "w"):
                    pass

        threading.Thread(target=tell_once_amber, daemon=True).start()
        if then_grow:
            with pytest.raises(ClaimHalted):
                held.run(hold_nine_tenths_of, 400 * 10**6, str(told), then_grow)
        else:
            assert held.run(hold_nine_tenths_of, 400 * 10**6, str(told), then_grow) == "let go"
    assert held.status.memory_warning
    warnings = [line for line in capfd.readouterr().err.splitlines() if "memory budget" in line]
    if then_grow:
        assert warnings == [], "the halt says it all"
    else:
        assert len(warnings) == 1
        assert "of its memory budget of 400.0MB" in warnings[0]


def test_the_kernels_own_thread_pools_are_limited_inside_the_block():
    import numpy  # noqa: F401  (loads OpenBLAS into this process)

    def blas_threads():
        return {p["internal_api"]: p["num_threads"] for p in threadpool_info()}

    before = blas_threads()
    with claim(cpus=1):
        assert set(blas_threads().values()) == {1}
    assert blas_threads() == before


def test_threads_claiming_at_once_never_exceed_the_machine():
    in_flight, peak = [0], [0]
    lock = threading.Lock()

    def work():
        with claim(cpus=1):
            with lock:
                in_flight[0] += 1
                peak[0] = max(peak[0], in_flight[0])
            time.sleep(0.05)
            with lock:
                in_flight[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert peak[0] == 2
    assert accountant().snapshot()["cpus"]["free"] == 2


def test_a_claim_that_could_only_start_once_its_own_outer_block_ends_is_refused():
    """Guards against a claim nested in another, in one thread, waiting for ever on it."""
    with claim(cpus=2, label="outer"):
        with pytest.raises(BadClaim) as refused, claim(cpus=1, label="inner"):
            pass
        assert accountant().snapshot()["waiting"] == []
    assert "inner would wait for ever: it asks for cpus=1 inside a claim of this same " in str(
        refused.value
    )
    assert "thread that holds cpus=2 until its `with` block ends" in str(refused.value)
    # One that fits beside the outer block is simply granted.
    with claim(cpus=1, label="outer"), claim(cpus=1, label="inner") as inner:
        assert inner.allocation.cpus == 1
    assert accountant().snapshot()["cpus"]["free"] == 2


def test_bad_arguments_are_refused_before_anything_waits():
    with pytest.raises(BadClaim, match="ram='plenty' is not a size"):
        claim(ram="plenty")
    with pytest.raises(BadClaim, match="flavor 'nope' does not exist"):
        claim(flavor="nope")
    assert accountant().snapshot()["waiting"] == []


def test_a_card_memory_budget_nothing_can_read_is_refused_and_the_share_given_back():
    """A budget no reading holds would be a number on the screen that says something untrue."""
    from fluksio_nb.gpu_usage import kernel_cards

    if kernel_cards().source is not None:
        pytest.skip(f"this machine reads its cards ({kernel_cards().source}); the test needs none")
    refused = pytest.raises(BadClaim, match=r"gpu_ram=1.0GB.*nothing here reads the cards")
    with refused, claim(gpus=1, gpu_ram="1G"):
        pass
    assert accountant().snapshot()["running"] == []


def test_a_card_memory_budget_nothing_can_read_is_refused_before_it_waits_for_a_card():
    """Guards against such a claim waiting in the queue for a card, to its timeout or
    for as long as the card is held, only to be refused once it had one."""
    from fluksio_nb.gpu_usage import kernel_cards

    if kernel_cards().source is not None:
        pytest.skip(f"this machine reads its cards ({kernel_cards().source}); the test needs none")
    with claim(gpus=1, label="holder"):
        refused = pytest.raises(BadClaim, match=r"gpu_ram=1.0GB.*nothing here reads the cards")
        with refused, claim(gpus=1, gpu_ram="1G", timeout=5):
            pass
        assert accountant().snapshot()["waiting"] == []
