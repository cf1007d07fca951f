"""Who gets the machine: the books, the FIFO queue, and giving back.

The failures this guards against are not subtle. Five notebooks each sizing a
thread pool to every core starve the kernel; three processes each taking most
of "GPU 0" deadlock at zero utilisation. Both come down to arithmetic nobody
was doing, so the arithmetic is what is checked, under real threads.
"""

import _thread
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.errors import ClaimCancelled, ClaimTimeout, ClaimTooLarge, ClampedWarning
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.resources import Resources
from tests.stops import A_CLAIM, said_by


def queue(cpus=4, gpus=0, ram_bytes=0) -> ClaimQueue:
    return ClaimQueue(ResourceAccountant(cpus=cpus, gpus=gpus, ram_bytes=ram_bytes))


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


# -----------------------------------------------------------------------------
# The books
# -----------------------------------------------------------------------------


def test_the_books_never_block_and_say_no_when_full():
    books = ResourceAccountant(cpus=2, gpus=1, ram_bytes=100)
    taken = books.try_take(2, 1, 60)
    assert taken == Allocation(cpus=2, gpus=(0,), ram_bytes=60)
    assert books.try_take(1) is None
    assert books.try_take(0, 0, 50) is None
    books.give_back(taken)
    assert books.snapshot()["cpus"] == {"total": 2, "free": 2, "free_ids": []}


def test_fits_tells_a_busy_machine_from_a_machine_too_small():
    """Waiting for a card that is busy is queueing; for one that does not exist, a hang."""
    books = ResourceAccountant(cpus=2, gpus=1, ram_bytes=100)
    books.try_take(2, 1, 100)
    assert books.fits(2, 1, 100)
    assert not books.fits(3)
    assert not books.fits(1, 2)
    assert not books.fits(1, 0, 101)


def test_giving_back_twice_is_refused():
    """A double give-back would later hand one card to two claims."""
    books = ResourceAccountant(cpus=2, gpus=1)
    taken = books.try_take(1, 1)
    books.give_back(taken)
    with pytest.raises(ValueError, match="not taken from these books"):
        books.give_back(taken)


def test_declared_cards_keep_their_physical_ids():
    books = ResourceAccountant(cpus=4, gpus=[3, 1])
    assert books.try_take(1, 1).gpus == (1,)
    assert books.try_take(1, 1).gpus == (3,)


# -----------------------------------------------------------------------------
# The queue
# -----------------------------------------------------------------------------


def test_what_is_free_is_what_was_handed_out():
    q = queue(cpus=4)
    with q.claim(Resources(cpus=3)):
        assert q.snapshot()["cpus"] == {"total": 4, "free": 1, "free_ids": []}
    assert q.snapshot()["cpus"] == {"total": 4, "free": 4, "free_ids": []}


def test_a_claim_waits_visibly_until_there_is_room():
    """Blocking is the mechanism; the waiting list is how the user sees it."""
    q = queue(cpus=2)
    started = threading.Event()

    def second():
        with q.claim(Resources(cpus=2), label="study.b"):
            started.set()

    with q.claim(Resources(cpus=2), label="study.a"):
        thread = threading.Thread(target=second)
        thread.start()
        wait_until(lambda: q.snapshot()["waiting"])
        assert not started.wait(0.2)
        waiting = q.snapshot()["waiting"]
        assert [(w["label"], w["position"]) for w in waiting] == [("study.b", 1)]
        assert waiting[0]["asked"] == {"cpus": 2, "gpus": 0, "ram_bytes": 0}
        assert waiting[0]["since"] <= time.time()
        assert [r["label"] for r in q.snapshot()["running"]] == ["study.a"]
    thread.join(timeout=5)
    assert started.is_set()


def test_a_gpu_is_held_by_one_claim_at_a_time():
    """The deadlock was three processes each preallocating most of one card."""
    q = queue(cpus=8, gpus=2)
    with q.claim(Resources(gpus=1)) as first, q.claim(Resources(gpus=1)) as second:
        assert set(first.gpus) & set(second.gpus) == set()
        assert q.snapshot()["gpus"]["free"] == 0
    assert q.snapshot()["gpus"]["free"] == 2


def test_asking_for_more_than_there_is_gets_what_there_is_with_a_warning():
    """A notebook written on a big box still has to run on a laptop."""
    q = queue(cpus=2, gpus=0, ram_bytes=1000)
    with (
        pytest.warns(ClampedWarning, match="cpus=64 gpus=4") as warned,
        q.claim(Resources(cpus=64, gpus=4, ram=5000)) as allocation,
    ):
        assert allocation == Allocation(cpus=2, gpus=(), ram_bytes=1000)
    assert "--strict" in str(warned[0].message)


def test_a_card_memory_budget_clamped_to_no_card_goes_with_the_card():
    q = queue(cpus=2, gpus=0)
    with pytest.warns(ClampedWarning, match="running with cpus=1 gpus=0 instead"):
        fitted = q.fit_to_machine(Resources(gpus=1, gpu_ram="8G"))
    assert (fitted.gpus, fitted.gpu_ram) == (0, None)
    with pytest.warns(ClampedWarning, match="running with cpus=2 gpus=1 gpu_ram=8.0GB"):
        keeps = queue(cpus=2, gpus=1).fit_to_machine(Resources(cpus=4, gpus=2, gpu_ram="8G"))
    assert (keeps.gpus, keeps.gpu_ram_bytes) == (1, 8 * 10**9)


def test_the_clamp_warning_names_only_what_was_too_much():
    """Guards against `cpus=64 ram=500B is more than…` when the memory asked for was there."""
    q = queue(cpus=2, gpus=0, ram_bytes=1000)
    with pytest.warns(ClampedWarning) as warned:
        q.fit_to_machine(Resources(cpus=64, ram=500))
    said = str(warned[0].message)
    assert said.startswith("cpus=64 is more than this machine has to hand out (cpus=2); "), said
    assert "running with cpus=2 ram=500B instead" in said
    with pytest.warns(ClampedWarning) as warned:
        q.fit_to_machine(Resources(cpus=1, gpus=1, gpu_ram="8G"))
    said = str(warned[0].message)
    assert said.startswith(
        "gpus=1 gpu_ram=8.0GB is more than this machine has to hand out (gpus=0, no cards)"
    ), said


def test_a_strict_claim_too_large_is_refused_with_the_capacity():
    q = queue(cpus=2, gpus=1)
    with pytest.raises(ClaimTooLarge, match=r"cpus=2 gpus=1 ram=0B"):
        q.enqueue(Resources(cpus=3, strict=True))
    assert q.snapshot()["waiting"] == []


def test_everything_comes_back_when_the_block_fails():
    q = queue(cpus=4, gpus=1)
    with (
        pytest.raises(ValueError, match="the cell raised"),
        q.claim(Resources(cpus=4, gpus=1)),
    ):
        raise ValueError("the cell raised")
    assert q.snapshot()["cpus"]["free"] == 4
    assert q.snapshot()["gpus"]["free"] == 1


def test_claims_are_granted_in_the_order_they_asked():
    q = queue(cpus=1)
    order: list[str] = []
    holder = q.enqueue(Resources(), "first")
    threads = []
    for name in "abcde":
        thread = threading.Thread(target=lambda n=name: _hold_and_record(q, n, order))
        thread.start()
        threads.append(thread)
        # Each must be queued before the next asks, or there is no order to keep.
        wait_until(lambda n=name: any(w["label"] == n for w in q.snapshot()["waiting"]))
    q.release(holder)
    for thread in threads:
        thread.join(timeout=5)
    assert order == list("abcde")


def _hold_and_record(q, name, order):
    with q.claim(Resources(), label=name):
        order.append(name)
        time.sleep(0.01)


def test_a_later_claim_overtakes_only_with_what_the_head_does_not_need():
    """A CPU cell may pass a cell waiting for a GPU; it may not take the head's cores."""
    q = queue(cpus=4, gpus=1)
    gpu_holder = q.enqueue(Resources(gpus=1), "holds the card")
    head = q.enqueue(Resources(cpus=2, gpus=1), "head wants the card")
    small = q.enqueue(Resources(cpus=1), "small cpu cell")
    greedy = q.enqueue(Resources(cpus=2), "would take the head's cores")
    assert small.state == "running"
    assert greedy.state == "waiting", "1 + 2 cores would leave the head one short"
    assert head.state == "waiting"
    q.release(gpu_holder)
    assert head.state == "running"
    for ticket in (head, small, greedy):
        q.release(ticket)
    assert q.snapshot()["cpus"]["free"] == 4


def test_a_stream_of_small_claims_cannot_starve_a_large_one():
    q = queue(cpus=2)
    first = q.enqueue(Resources(cpus=1), "small 1")
    big = q.enqueue(Resources(cpus=2), "big")
    later = q.enqueue(Resources(cpus=1), "small 2")
    assert later.state == "waiting", "the free core is set aside for the big claim"
    q.release(first)
    assert big.state == "running"
    q.release(big)
    assert later.state == "running"
    q.release(later)


def test_waiting_longer_than_the_timeout_is_a_clear_error():
    q = queue(cpus=1)
    with (
        q.claim(Resources(), label="fit"),
        pytest.raises(ClaimTimeout) as caught,
        q.claim(Resources(), label="eval", timeout=0.1),
    ):
        pass
    message = str(caught.value)
    assert "eval waited 0.1 s for cpus=1" in message
    assert "'fit' (cpus=1)" in message
    assert q.snapshot()["waiting"] == []
    assert q.snapshot()["cpus"]["free"] == 1


def test_the_claims_own_timeout_bounds_the_wait():
    q = queue(cpus=1)
    with q.claim(Resources()), pytest.raises(ClaimTimeout), q.claim(Resources(timeout=0.05)):
        pass


def test_a_waiting_claim_can_be_cancelled():
    q = queue(cpus=1)
    caught: list[BaseException] = []

    def waiter():
        try:
            with q.claim(Resources(), label="cancel me"):
                pass
        except ClaimCancelled as error:
            caught.append(error)

    with q.claim(Resources()):
        thread = threading.Thread(target=waiter)
        thread.start()
        wait_until(lambda: q.snapshot()["waiting"])
        number = q.snapshot()["waiting"][0]["ticket"]
        assert q.cancel(number, "the user pressed cancel")
        thread.join(timeout=5)
    assert "the user pressed cancel" in str(caught[0])
    assert q.cancel(number) is False
    assert q.snapshot()["cpus"]["free"] == 1


def test_cancelling_a_running_claim_asks_its_runner_to_stop():
    q = queue(cpus=1)
    ticket = q.enqueue(Resources())
    stopped: list[str] = []
    ticket.on_cancel = stopped.append
    assert q.cancel(ticket.number, "stop it")
    assert stopped == ["stop it"]
    q.release(ticket)


def test_an_interrupt_while_waiting_leaves_nothing_behind():
    """The stop button raises KeyboardInterrupt inside the wait; the ticket must go."""
    q = queue(cpus=1)
    holder = q.enqueue(Resources())
    timer = threading.Timer(0.1, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt), q.claim(Resources(), label="interrupted"):
        pass
    timer.join()
    assert q.snapshot()["waiting"] == []
    q.release(holder)
    assert q.snapshot()["cpus"]["free"] == 1


def test_releasing_twice_is_harmless():
    q = queue(cpus=1)
    ticket = q.enqueue(Resources())
    q.release(ticket)
    q.release(ticket)
    assert q.snapshot()["cpus"]["free"] == 1


def test_many_claims_at_once_all_finish():
    """The queue is on every claim's path, so it must not deadlock under contention."""
    q = queue(cpus=4)
    done = []

    def work():
        with q.claim(Resources(cpus=2), label="study.n"):
            time.sleep(0.01)
            done.append(1)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(done) == 8
    assert q.snapshot()["cpus"]["free"] == 4


@pytest.mark.timeout(60)
def test_sixty_four_threads_of_fifty_claims_balance_the_books():
    """Never more handed out than exists, no deadlock, and every core back after."""
    q = queue(cpus=4, gpus=2)
    over: list[str] = []
    finished = []

    def work(index):
        wanted = Resources(cpus=1 + index % 4, gpus=index % 3 % 2)
        for _ in range(50):
            with q.claim(wanted, label=f"t{index}") as allocation:
                snap = q.books.snapshot()
                if snap["cpus"]["free"] < 0 or snap["gpus"]["free"] < 0:
                    over.append(str(snap))
                assert allocation.cpus == wanted.cpus
        finished.append(index)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=50)
        assert not thread.is_alive(), "a claim deadlocked"
    assert len(finished) == 64
    assert over == []
    assert q.snapshot()["cpus"] == {"total": 4, "free": 4, "free_ids": []}
    assert q.snapshot()["gpus"]["free"] == 2
    assert q.snapshot()["running"] == [] and q.snapshot()["waiting"] == []


def test_the_kernel_has_one_accountant_made_from_the_settings(monkeypatch):
    from fluksio_nb import accountant

    monkeypatch.setenv("FLUKSIO_CPUS", "6")
    monkeypatch.setenv("FLUKSIO_GPUS", "2")
    monkeypatch.setenv("FLUKSIO_RESERVE_CPUS", "2")
    assert accountant() is accountant()
    snap = accountant().snapshot()
    assert snap["cpus"]["total"] == 4
    assert snap["gpus"]["total"] == 2


INTERRUPTED = """
import json, random, signal, sys
from fluksio_nb.resources import Resources

armed = False

def interrupt(*_):
    if armed:
        raise KeyboardInterrupt

signal.signal(signal.SIGALRM, interrupt)
random.seed(int(sys.argv[1]))
q = make()
interrupted = 0
for _ in range(400):
    ticket = None
    armed = True
    try:
        # The stop button, at a moment nobody chose: asking, waiting or returning.
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.000005, 0.0005))
        ticket = q.enqueue(Resources(cpus=1))
        q.wait(ticket, 5)
    except KeyboardInterrupt:
        interrupted += 1
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        if ticket is not None:
            q.release(ticket)
shown = q.snapshot()
print(json.dumps({"interrupted": interrupted, "running": len(shown["running"]),
                  "waiting": len(shown["waiting"]), "free": shown["cpus"]["free"]}))
"""


def run_interrupted(make: str, seed: int = 0) -> dict:
    """Four hundred claims, a random one in three stopped at a moment nobody chose."""
    ran = subprocess.run(
        [sys.executable, "-c", make + INTERRUPTED, str(seed)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(ran.stdout.splitlines()[-1])


def test_the_stop_button_at_any_moment_leaves_no_claim_held_in_the_kernels_books():
    """Guards against a ticket the books granted that its caller never received."""
    got = run_interrupted(
        "from fluksio_nb.books import ResourceAccountant\n"
        "from fluksio_nb.queue import ClaimQueue\n"
        "make = lambda: ClaimQueue(ResourceAccountant(cpus=2))\n"
    )
    assert got["interrupted"] > 0, got
    assert (got["running"], got["waiting"], got["free"]) == (0, 0, 2), got


def words_printed_by(script: str) -> list[str]:
    """Run ``script`` in a Python of its own, whose signals are its own; what it printed."""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.split()


HELD_BACK_FROM_ANOTHER_THREAD = """
import os, select, signal, sys, threading
from fluksio_nb.stop_button import stop_held_back

# A kernel has threads besides the main one: the stop is delivered to one of
# them, and Python runs its handler in the main thread all the same.
sleeper = threading.Thread(target=lambda: select.select([], [], [], 60), daemon=True)
sleeper.start()
read_end, write_end = os.pipe()
os.set_blocking(write_end, False)
signal.set_wakeup_fd(write_end)
changed = False
try:
    with stop_held_back():
        signal.pthread_kill(sleeper.ident, signal.SIGINT)
        os.read(read_end, 1)  # the signal has arrived: its handler is due
        sum(range(1000))  # bytecodes, each a moment the handler could run at
        changed = True
    print("not at all")
except KeyboardInterrupt:
    print("after the change" if changed else "during the change")
"""


def test_a_stop_delivered_to_another_thread_lands_after_the_books_change():
    """Guards against the stop landing halfway through a change in a kernel with threads."""
    assert words_printed_by(HELD_BACK_FROM_ANOTHER_THREAD) == ["after", "the", "change"]


HELD_BACK_FROM_A_MAIN_THREAD_THAT_BLOCKS_IT = """
import os, select, signal, threading
from fluksio_nb.stop_button import stop_held_back

sleeper = threading.Thread(target=lambda: select.select([], [], [], 60), daemon=True)
sleeper.start()
read_end, write_end = os.pipe()
os.set_blocking(write_end, False)
signal.set_wakeup_fd(write_end)
# A cell may block SIGINT in its main thread: the stop the kernel sends is
# then taken by another thread, and still lands in the main one.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
try:
    with stop_held_back():
        os.kill(os.getpid(), signal.SIGINT)
        os.read(read_end, 1)  # the stop has arrived, and was written down
    # Sent again as the hold ends: wait until some thread has taken it.
    if select.select([read_end], [], [], 30)[0]:
        os.read(read_end, 1)
        sum(range(1000))  # bytecodes, each a moment the handler could run at
    print("held for good")
except KeyboardInterrupt:
    print("landed")
finally:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a stop still pending must not end this
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
"""


def test_a_stop_held_back_lands_in_a_main_thread_that_blocks_sigint():
    """Guards against a held-back stop raised at the main thread alone, pending there for good."""
    assert words_printed_by(HELD_BACK_FROM_A_MAIN_THREAD_THAT_BLOCKS_IT) == ["landed"]


HELD_BACK_IN_A_PROCESS_WHOSE_THREADS_ALL_BLOCK_IT = """
import _thread, signal
from fluksio_nb.stop_button import stop_held_back

# As in a Ray task's process: SIGINT is blocked in every thread, and Ray's
# cancel raises the stop by interrupt_main, which no mask holds back.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
try:
    with stop_held_back():
        _thread.interrupt_main()
        sum(range(1000))  # bytecodes, each a moment the handler could run at
    sum(range(1000))
    print("pending" if signal.SIGINT in signal.sigpending() else "lost")
except KeyboardInterrupt:
    print("landed")
"""


def test_a_stop_held_back_lands_in_a_process_whose_threads_all_block_sigint():
    """Guards the stop Ray raises in a task: re-sent as a signal, it waited in the mask for good."""
    assert words_printed_by(HELD_BACK_IN_A_PROCESS_WHOSE_THREADS_ALL_BLOCK_IT) == ["landed"]


HELD_BACK_ACROSS_A_NESTED_CHANGE = """
import os, signal
from fluksio_nb.stop_button import stop_held_back

where = "nowhere"
try:
    with stop_held_back():
        with stop_held_back():  # a hold inside a claim's own change
            os.kill(os.getpid(), signal.SIGINT)
        where = "between"
        sum(range(1000))  # bytecodes, each a moment the handler could run at
        where = "after"
    print("not at all")
except KeyboardInterrupt:
    print(where)
# The handlers are the ones from before: a second stop raises at once.
try:
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(1000))
    print("held for good")
except KeyboardInterrupt:
    print("restored")
"""


def test_a_stop_during_a_nested_change_lands_once_the_outermost_change_is_whole():
    """Guards the claim's change that holds another hold: the inner end lets nothing in."""
    assert words_printed_by(HELD_BACK_ACROSS_A_NESTED_CHANGE) == ["after", "restored"]


def test_an_oversized_claim_in_python_dash_c_warns_instead_of_failing(tmp_path):
    """Guards against the clamp's warning raising ImportError where __main__ has no source."""
    ran = subprocess.run(
        [
            sys.executable,
            "-c",
            "from fluksio_nb import claim\n"
            "with claim(cpus=100_000) as c:\n    print('granted', c.allocation.cpus)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "FLUKSIO_LEDGER": str(tmp_path / "ledger")},
    )
    assert ran.returncode == 0, ran.stderr
    assert "ClampedWarning" in ran.stderr and "cpus=100000" in ran.stderr, ran.stderr
    assert ran.stdout.startswith("granted"), ran.stdout


#: The stop pressed at every moment Python could run its handler while a claim
#: is asked for, waited on and given back, one moment a round (as a function
#: starts, and as a call into C returns: the moments a profile function is told
#: of), in the queue's code and in the threading module's under it. After each,
#: another thread claims the whole machine: a lock the stop left held would
#: keep it out for ever.
STOP_AT_EVERY_MOMENT = """
import threading
import fluksio_nb.queue
import fluksio_nb.stop_button
from fluksio_nb.books import ResourceAccountant
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.resources import Resources

q = ClaimQueue(ResourceAccountant(cpus=2))

def the_whole_machine():
    ticket = q.enqueue(Resources(cpus=2), "everything")
    q.wait(ticket, 5)
    q.release(ticket)

def check():
    if not finishes(the_whole_machine):
        return "locked_out_by_a_stop"

watched = [fluksio_nb.queue.__file__, fluksio_nb.stop_button.__file__, threading.__file__]
each_moment(watched, attempt, undo, check)
"""


def test_a_stop_at_any_moment_of_a_claim_leaves_the_kernels_books_to_its_other_threads():
    """Guards against a stop landing as ``Condition.__enter__`` returned, which left the
    books' lock held by no ``with``: every other thread that claimed (a background job,
    the sampler's look at the queue) then waited for it for ever."""
    said = said_by(A_CLAIM + STOP_AT_EVERY_MOMENT, timeout=100)
    assert "stopped_at" in said, said
    # A claim's way through the queue is dozens of such moments: every one was tried.
    assert said["stopped_at"] > 20, said
