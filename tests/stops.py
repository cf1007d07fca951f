"""The stop button pressed at every moment it could land, one moment a round.

A stop that lands at an unlucky moment can leave a lock held by no ``with``,
a ticket nobody will give back, or a reader thread standing aside for an
asker that is gone; a random stop finds such a moment one run in ten, if at
all. Python runs a signal's handler only as a function starts and as a call
into C returns (never as a Python function returns, never just before a
call), and a profile function is told of exactly those moments. So the
scripts here press the stop at the first such moment in the watched files,
then the second, and so on, until a round passes with no moment left, and
check after each round that nothing was left behind, the signal handlers a
hold swapped included.

:data:`STOP_AT` is Python source, put before a script that runs in a
process of its own (its signals are its own): it defines
``each_moment(watched, attempt, undo, check)``, which prints one JSON line,
``{"stopped_at": N}`` once every moment passed, or ``{problem: where}`` for
the first round whose ``check`` found one. It also defines the checks
scripts of a kernel share: ``descriptors_left_open(before)``,
``workers_out_of_the_pool()``, ``devices_cgroups_left()`` and ``what_a_claim_left(lent)``.

A script about what a claim makes beside its share (a cgroup, a descriptor)
keeps its books in the kernel (``FLUKSIO_LEDGER=kernel``). On a books service
every round's claim and check are round trips to another process: the capped
cell's 1,300 rounds took 17.7 CPU-s against 12.9 on the kernel's books, the
card claim's 8.1 against 5.6. What a stop does to the books themselves is
pressed at every moment by :data:`STOP_AT_EVERY_MOMENT_OF_A_CLAIM`, on the
machine's service and on the user's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

STOP_AT = '''
import gc, json, os, signal, sys, threading, time

where = None
HANDLERS_PUT_BACK = (signal.SIGINT, signal.SIGALRM, signal.SIGTERM)
# CO_GENERATOR, CO_COROUTINE and CO_ASYNC_GENERATOR.
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200

# A finalizer (a ``__del__``, or whatever the garbage collector runs) is no
# moment of the code under test: it runs wherever the collector started, or an
# object's last reference went, a different place each round. And CPython
# 3.11 crashed (SIGSEGV) on a stop raised from this profile function inside
# one: 3 times in 19 runs of the claimed cell's rounds under pytest, most of
# them beside two others ("Exception ignored in: <function
# _ProcessFiles.__del__ ...>", then "Fatal Python error: Segmentation
# fault"). So no moment is counted while one runs.
_collecting = False


def _note_collection(phase, info):
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_note_collection)


def _stop_at(moment, watched, beyond_reach, generators):
    seen = finalizing = 0

    def profile(frame, event, arg):
        nonlocal seen, finalizing
        global where
        code = frame.f_code
        if code.co_name == "__del__" and event in ("call", "return"):
            finalizing = max(0, finalizing + (1 if event == "call" else -1))
            return
        if finalizing or _collecting:
            return
        if event not in ("call", "c_return") or code.co_filename not in watched:
            return
        if event == "call" and (code.co_filename, code.co_name) in beyond_reach:
            return
        if not generators and code.co_flags & _GENERATOR_FLAGS:
            return
        seen += 1
        if seen == moment:
            where = f"{event} in {frame.f_code.co_name}, line {frame.f_lineno}"
            # Nothing later in the round is counted: it runs at its own speed.
            sys.setprofile(None)
            signal.raise_signal(signal.SIGINT)

    return profile


def finishes(target, *args):
    """Whether target(*args), in a thread of its own, ends within 10 s: no lock was left held."""
    other = threading.Thread(target=target, args=args, daemon=True)
    other.start()
    other.join(10)
    return not other.is_alive()


def descriptors_left_open(before):
    """Whether more descriptors than ``before`` are open, given 5 s to close.

    The kernel's own threads open a file for a moment (a books service's socket):
    one left open for good is still open seconds later.
    """
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(os.listdir("/proc/self/fd")) > before:
        time.sleep(0.01)
    return len(os.listdir("/proc/self/fd")) > before


def children_alive():
    """This process's children that have not ended, from the kernel's own lists of them.

    psutil's ``children()`` reads every process on the machine to find them:
    two thirds of a claimed cell's check, round after round, on a busy machine.
    """
    import psutil

    pids = None
    while pids is None:
        pids = set()
        for thread in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{thread}/children") as listed:
                    pids.update(int(pid) for pid in listed.read().split())
            except FileNotFoundError:
                # A thread that ended hands its children to another: read them all again.
                pids = None
                break
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def workers_out_of_the_pool():
    """The kernel's worker processes that are not idle in its pool, given 5 s to end.

    An idle worker past the pool's number is ended on a thread of its own, at once.
    """
    from fluksio_nb.worker.pool import kernel_pool

    deadline = time.monotonic() + 5
    while True:
        idle = {entry.worker.pid for entry in kernel_pool()._idle}
        running = children_alive() - idle
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.01)


def books_clear(within=5.0):
    """Whether the kernel's books hold nothing, running or waiting, within ``within`` s.

    On a books service, a claim whose request the stop cut off is given back
    by the kernel's reader thread as the service's answer comes, a moment
    later: what counts is that it is given back, not by whom.
    """
    from fluksio_nb import accountant

    deadline = time.monotonic() + within
    while True:
        books = accountant().snapshot()
        if not (books["running"] or books["waiting"]):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def devices_cgroups_left(within=5.0):
    """This process's claims' devices cgroups still on the machine, given ``within`` s to go.

    Every claim on a machine with cards gets one (fluksio_nb.card_devices), and
    one left behind is left for good while this process lives.
    """
    from fluksio_nb.card_devices import devices_place

    parent = devices_place().parent
    if parent is None:
        return []
    mine = f"fluksio_nb-{os.getpid()}-"
    deadline = time.monotonic() + within
    while True:
        try:
            left = [name for name in os.listdir(parent) if name.startswith(mine)]
        except FileNotFoundError:
            left = []
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.01)


def what_a_claim_left(lent):
    """The first thing a kernel's ended claim left behind, or None.

    ``lent``: whether shared memory was still lent as the round ended.
    """
    from fluksio_nb.watch import kernel_watch

    if not books_clear():
        return "a_share_left_held"
    if devices_cgroups_left():
        return "a_devices_cgroup_left"
    if lent:
        return "shared_memory_left_lent"
    if workers_out_of_the_pool():
        return "a_worker_left_running_out_of_the_pool"
    if kernel_watch()._watched:
        return "the_watch_left_reading_a_worker"
    return None


def each_moment(watched, attempt, undo, check, beyond_reach=(), forgotten=False, generators=True):
    """attempt(made), stopped at each moment in turn; undo(made); then check() -> problem.

    ``beyond_reach``: (file, function) pairs whose start is not pressed on, the
    one moment nothing can hold the stop back at: as an ``__exit__`` starts (a
    kernel catches up with it as the cell ends; a script has no cell).
    ``forgotten``: the stop's traceback is let go before the check, as a kernel
    lets it go at its next error, so that the check sees what is left for good.
    ``generators=False`` presses no moment in a generator: with Ray loaded,
    CPython 3.11 crashed (SIGSEGV) on this profile function raising as one closed.
    """
    global where
    last_error = None
    moment = missed = 0
    # Every hold puts back the handlers it swapped, whatever moment the stop came.
    handlers = {signum: signal.getsignal(signum) for signum in HANDLERS_PUT_BACK}
    # What the script made before the rounds is left out of every collection
    # the rounds make (``forgotten``) or Python makes as they run: a round's
    # garbage is its own, and going through a loaded IPython's every object
    # again, round after round, was most of a round's time. Nothing is
    # collected that would not have been, so nothing left can go unseen: a
    # cycle through an object of before is kept, and fails its round's check.
    gc.collect()
    gc.freeze()
    try:
        while missed < 5:
            moment += 1
            where, made = None, {}
            sys.setprofile(_stop_at(moment, set(watched), set(beyond_reach), generators))
            try:
                attempt(made)
            except KeyboardInterrupt as stop:
                # Kept, traceback and all, as a kernel keeps the last error: it
                # holds whatever a half-entered context manager took.
                last_error = stop
            finally:
                sys.setprofile(None)
                undo(made)
            if forgotten:
                last_error = made = None
                gc.collect()
            missed = 0 if where else missed + 1
            problem = check()
            if any(signal.getsignal(signum) != handler for signum, handler in handlers.items()):
                problem = problem or "handlers_left_swapped"
            if problem:
                print(json.dumps({problem: where}), flush=True)
                return
        print(json.dumps({"stopped_at": moment - missed - 1}), flush=True)
    finally:
        # A kernel's script: its later cells collect as any other's.
        gc.unfreeze()
'''


#: ``attempt`` and ``undo`` for a queue ``q`` (and ``Resources``) the script made:
#: a claim asked for, waited on and looked at, given back whatever came of it.
A_CLAIM = """
def attempt(made):
    made["ticket"] = q.enqueue(Resources(cpus=1), "stopped")
    q.wait(made["ticket"], 5)
    q.position(made["ticket"]), q.holders(), q.snapshot()


def undo(made):
    if "ticket" in made:
        q.release(made["ticket"])
"""


def said_by(script: str, timeout: float) -> dict[str, Any]:
    """Run ``STOP_AT`` and ``script`` in a Python of its own: the last line it printed, read."""
    ran = subprocess.run(
        [sys.executable, "-c", STOP_AT + script], capture_output=True, text=True, timeout=timeout
    )
    lines = ran.stdout.splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        # It ended before its last line: how, and its last words, are the failure.
        return {"exit": ran.returncode, "stdout": ran.stdout[-3000:], "stderr": ran.stderr[-3000:]}


#: The stop pressed at every moment Python could run its handler while a claim
#: asks a books service (``q``, the machine's or the user's own), waits and
#: gives back, one moment a round: Python runs a
#: signal's handler as a function starts and as a call into C returns (never as
#: a Python function returns), the moments a profile function is told of. After
#: each, another kernel takes every core and frees them: a claim left held
#: would keep it waiting, and a kernel that no longer heard its grants would
#: never see the core it waits for come free.
STOP_AT_EVERY_MOMENT_OF_A_CLAIM = """
import fluksio_nb.machine.client as client
import fluksio_nb.stop_button
from fluksio_nb.errors import ClaimTimeout
from fluksio_nb.machine.client import ServiceQueue

other = ServiceQueue(q.at)

def attempt(made):
    made["ticket"] = q.enqueue(Resources(cpus=1), "stopped")
    q.wait(made["ticket"], 5)

def undo(made):
    if "ticket" in made:
        q.release(made["ticket"])

def check():
    everything = other.enqueue(Resources(cpus=q.books.cpus), "everything")
    try:
        other.wait(everything, 5)
    except ClaimTimeout:
        return "left_held_by_a_stop"
    waiter = q.enqueue(Resources(cpus=1), "waiter")
    other.release(everything)
    try:
        q.wait(waiter, 5)
    except ClaimTimeout:
        return "deaf_after_a_stop"
    q.release(waiter)

each_moment([client.__file__, fluksio_nb.stop_button.__file__], attempt, undo, check)
"""
