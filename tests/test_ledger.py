"""The machine-wide ledger: one set of books for every kernel on the machine.

The failure this exists for is two kernels each granting "GPU 0". So the
tests here use real processes and a real file: grants never overlap however
the processes interleave, a holder that is killed gives its share back, a
waiter in another process is woken when capacity frees, and a broken file is
rebuilt rather than crashing anyone.
"""

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from types import SimpleNamespace

import pytest

import fluksio_nb.ledger.queue
from fluksio_nb.errors import BadClaim, ClaimCancelled
from fluksio_nb.gpus import Gpu
from fluksio_nb.inventory import Inventory
from fluksio_nb.kernel import books_in_force
from fluksio_nb.ledger import LEDGER_FILE, LedgerBroken, MachineQueue, read_snapshot
from fluksio_nb.resources import Resources
from fluksio_nb.settings import Settings
from tests.stops import A_CLAIM, said_by

pytestmark = pytest.mark.timeout(120)


def inventory(cpus=4, gpus=1, ram=0):
    return Inventory(
        cpus=cpus,
        machine_cpus=cpus,
        ram_bytes=ram,
        machine_ram_bytes=ram,
        gpus=tuple(Gpu(i) for i in range(gpus)),
    )


def other_process(directory, body: str, cpus=4, gpus=1) -> subprocess.Popen:
    """A separate Python process with its own MachineQueue on the same ledger."""
    script = textwrap.dedent(
        f"""
        import json, sys, time
        from fluksio_nb.gpus import Gpu
        from fluksio_nb.inventory import Inventory
        from fluksio_nb.ledger import MachineQueue
        from fluksio_nb.resources import Resources
        inv = Inventory(cpus={cpus}, machine_cpus={cpus}, ram_bytes=0, machine_ram_bytes=0,
                        gpus=tuple(Gpu(i) for i in range({gpus})))
        q = MachineQueue({str(directory)!r}, inv)
        def say(**facts):
            print(json.dumps(facts), flush=True)
        """
    ) + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )


def heard(process: subprocess.Popen) -> dict:
    line = process.stdout.readline()
    assert line, "the other process ended without saying anything"
    return json.loads(line)


def test_two_processes_never_hold_the_same_card(tmp_path):
    holder = other_process(
        tmp_path,
        "t = q.enqueue(Resources(gpus=1), 'theirs'); q.wait(t)\n"
        "say(gpus=list(t.allocation.gpus)); sys.stdin.readline(); q.release(t)\n",
    )
    assert heard(holder) == {"gpus": [0]}
    mine = MachineQueue(tmp_path, inventory())
    ticket = mine.enqueue(Resources(gpus=1), "mine")
    assert ticket.state == "waiting"
    snapshot = mine.snapshot()
    assert snapshot["gpus"] == {"total": 1, "free": 0, "free_ids": []}
    assert [w["label"] for w in snapshot["waiting"]] == ["mine"]
    assert snapshot["running"][0]["pid"] == holder.pid
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert mine.wait(ticket, timeout=5).gpus == (0,)
    mine.release(ticket)
    holder.wait(timeout=10)


def test_a_waiter_in_another_process_is_woken_when_the_share_frees(tmp_path):
    mine = MachineQueue(tmp_path, inventory(cpus=1, gpus=0))
    held = mine.enqueue(Resources(), "holding")
    waiter = other_process(
        tmp_path,
        # It would not look again by itself for a minute: only a wake-up can
        # get it out of its wait in time.
        "import fluksio_nb.ledger.queue\nfluksio_nb.ledger.queue.LOOK_EVERY_S = 60\n"
        "t = q.enqueue(Resources(), 'waiting'); say(state=t.state)\n"
        "q.wait(t); say(granted=time.time()); q.release(t)\n",
        cpus=1,
        gpus=0,
    )
    assert heard(waiter) == {"state": "waiting"}
    time.sleep(0.3)
    freed = time.time()
    mine.release(held)
    granted = heard(waiter)["granted"]
    assert granted - freed < 30
    waiter.wait(timeout=10)


def test_a_share_freed_by_another_kernel_of_the_user_wakes_the_waiter_once(tmp_path, monkeypatch):
    """Guards the wake-up between kernels of one user: taken, and one look for it.

    Only the waker's own count says it was the wake-up, not a look of its
    own, that freed the waiter: it would not look for a minute.
    """
    monkeypatch.setattr(fluksio_nb.ledger.queue, "LOOK_EVERY_S", 60)
    holder = other_process(
        tmp_path,
        "t = q.enqueue(Resources()); q.wait(t); say(ok=1)\n"
        "sys.stdin.readline(); q.release(t); say(released=1); time.sleep(600)\n",
        cpus=1,
        gpus=0,
    )
    assert heard(holder) == {"ok": 1}
    mine = MachineQueue(tmp_path, inventory(cpus=1, gpus=0))
    ticket = mine.enqueue(Resources(), "waiting")
    waker = mine._wakers[ticket.number]
    looks = []
    look = mine.look
    monkeypatch.setattr(mine, "look", lambda: (looks.append(1), look()))
    holder.stdin.write("\n")
    holder.stdin.flush()
    mine.wait(ticket, timeout=30)
    assert (waker.accepted, waker.refused, looks) == (1, 0, [1])
    mine.release(ticket)
    holder.kill()
    holder.wait()


def waiting_behind_a_holder(directory):
    """Another process holding the card, and a claim of this one waiting for it."""
    holder = other_process(
        directory, "t = q.enqueue(Resources(gpus=1)); q.wait(t); say(ok=1); time.sleep(600)\n"
    )
    assert heard(holder) == {"ok": 1}
    mine = MachineQueue(directory, inventory())
    ticket = mine.enqueue(Resources(gpus=1))
    assert ticket.state == "waiting"
    return holder, mine, ticket


def test_a_killed_holder_gives_its_share_back(tmp_path):
    """SIGKILL, the OOM killer, a reboot: the holder never says goodbye."""
    holder, mine, ticket = waiting_behind_a_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    # How soon is bench.books' to measure, and the next test's how.
    mine.wait(ticket, timeout=10)
    assert ticket.state == "running"
    mine.release(ticket)


def test_a_waiter_looks_the_moment_its_holder_is_killed(tmp_path, monkeypatch):
    """Guards against a killed holder's share waiting for the waiter's next look:
    nobody gives it back, so nobody wakes the waiter but the holder's end."""
    # It would not look again by itself for an hour.
    monkeypatch.setattr(fluksio_nb.ledger.queue, "LOOK_EVERY_S", 3600)
    holder, mine, ticket = waiting_behind_a_holder(tmp_path)
    waiting = threading.Thread(target=mine.wait, args=(ticket,), daemon=True)
    waiting.start()
    holder.send_signal(signal.SIGKILL)
    waiting.join(timeout=60)
    assert ticket.state == "running", "the waiter slept on after its holder was killed"
    mine.release(ticket)
    holder.wait()


def test_a_reused_pid_does_not_keep_a_dead_claim_alive(tmp_path):
    """The pid of the dead holder now belongs to a younger process: not the holder."""
    mine = MachineQueue(tmp_path, inventory())
    ticket = mine.enqueue(Resources(gpus=1), "ghost")
    mine.wait(ticket, timeout=1)
    with mine.ledger.transaction() as state:
        state["tickets"][0]["owner"]["started"] -= 3600
    other = MachineQueue(tmp_path, inventory())
    assert other.snapshot()["running"] == []
    fresh = other.enqueue(Resources(gpus=1))
    assert fresh.state == "running"
    other.release(fresh)


def test_claims_are_granted_in_ticket_order_across_processes(tmp_path):
    mine = MachineQueue(tmp_path, inventory(cpus=1, gpus=0))
    held = mine.enqueue(Resources())
    others = []
    for name in "abc":
        process = other_process(
            tmp_path,
            f"t = q.enqueue(Resources(), {name!r}); say(n=t.number)\n"
            "q.wait(t); say(at=time.time()); time.sleep(0.05); q.release(t)\n",
            cpus=1,
            gpus=0,
        )
        heard(process)
        others.append(process)
    mine.release(held)
    times = [heard(process)["at"] for process in others]
    assert times == sorted(times)
    for process in others:
        process.wait(timeout=10)


def test_a_waiting_claim_can_be_cancelled_from_another_process(tmp_path):
    mine = MachineQueue(tmp_path, inventory(cpus=1, gpus=0))
    held = mine.enqueue(Resources())
    ticket = mine.enqueue(Resources(), "to cancel")
    canceller = other_process(tmp_path, f"say(done=q.cancel({ticket.number}, 'not now'))\n", 1, 0)
    assert heard(canceller) == {"done": True}
    with pytest.raises(ClaimCancelled, match="not now"):
        mine.wait(ticket, timeout=5)
    mine.release(ticket)
    mine.release(held)
    assert mine.snapshot()["cpus"]["free"] == 1


def test_a_running_claim_cancelled_elsewhere_is_told_to_stop(tmp_path):
    mine = MachineQueue(tmp_path, inventory(cpus=1, gpus=0))
    ticket = mine.enqueue(Resources(), "runner")
    mine.wait(ticket)
    stopped = []
    ticket.on_cancel = stopped.append
    canceller = other_process(tmp_path, f"say(done=q.cancel({ticket.number}, 'stop'))\n", 1, 0)
    assert heard(canceller) == {"done": True}
    deadline = time.monotonic() + 5
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stopped == ["stop"]
    mine.release(ticket)


def test_a_kernel_describing_another_machine_is_refused_and_drops_nobodys_claim(tmp_path):
    """Guards against two notebooks declaring different machines on one user's books
    each dropping the other's claims as "not this machine's"."""
    holder = other_process(
        tmp_path,
        "t = q.enqueue(Resources(gpus=2), 'demo'); q.wait(t); say(gpus=list(t.allocation.gpus))\n"
        "sys.stdin.readline(); q.look()\n"
        "say(state=t.state, cancelled=t.cancelled); q.release(t)\n",
        cpus=4,
        gpus=2,
    )
    assert heard(holder) == {"gpus": [0, 1]}
    mine = MachineQueue(tmp_path, inventory(cpus=4, gpus=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", LedgerBroken)
        with pytest.raises(BadClaim) as refused:
            mine.enqueue(Resources(cpus=1), "mine")
        # What this kernel shows is the books as they are kept, warning of nothing.
        assert mine.snapshot()["gpus"]["total"] == 2
    said = str(refused.value)
    assert said.startswith("mine was not queued: the books in "), said
    assert "cards [0, 1] there, none here" in said, said
    assert f"1 claim held by the kernel pid {holder.pid}" in said, said
    assert "FLUKSIO_GPUS" in said and "FLUKSIO_LEDGER" in said, said
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert heard(holder) == {"state": "running", "cancelled": None}
    holder.wait(timeout=10)
    # Nobody holds anything under the other description now: this kernel's is taken.
    ticket = mine.enqueue(Resources(cpus=1), "mine")
    assert ticket.state == "running"
    assert mine.snapshot()["gpus"]["total"] == 0
    mine.release(ticket)


def test_a_kernel_restarted_with_a_new_setting_describes_the_machine_from_then_on(tmp_path):
    before = MachineQueue(tmp_path, inventory(cpus=2, gpus=1))
    before.release(before.enqueue(Resources(gpus=1)))
    after = MachineQueue(tmp_path, inventory(cpus=8, gpus=2))
    held = after.enqueue(Resources(cpus=8, gpus=2))
    assert held.state == "running"
    assert after.snapshot()["cpus"]["total"] == 8
    after.release(held)


def test_a_truncated_ledger_is_rebuilt_and_the_next_claim_works(tmp_path):
    mine = MachineQueue(tmp_path, inventory(cpus=2, gpus=1))
    running = mine.enqueue(Resources(gpus=1), "survivor")
    mine.wait(running)
    with open(mine.ledger.path, "r+") as ledger:
        ledger.truncate(17)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ticket = mine.enqueue(Resources(), "after")
    assert any(issubclass(w.category, LedgerBroken) for w in caught)
    assert ticket.state == "running"
    # This kernel's running claim was written back: the card is still held.
    assert mine.snapshot()["gpus"]["free"] == 0
    assert sorted(r["label"] for r in mine.snapshot()["running"]) == ["after", "survivor"]
    mine.release(ticket)
    mine.release(running)
    assert mine.snapshot()["gpus"]["free"] == 1


def test_garbage_in_the_ledger_never_crashes_a_reader(tmp_path):
    mine = MachineQueue(tmp_path, inventory())
    mine.ledger.path.write_text("\x00\x01 not json")
    assert mine.snapshot()["running"] == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LedgerBroken)
        ticket = mine.enqueue(Resources(gpus=1))
    assert ticket.state == "running"
    mine.release(ticket)


STRESS = """
import os
grants = []
for i in range(200):
    t = q.enqueue(Resources(cpus=1 + i % 2, gpus=i % 2), f'p{os.getpid()}-{i}')
    q.wait(t, timeout=60)
    start = time.time()
    # The end is noted before letting go: the next holder may be granted
    # inside the release itself.
    grants.append([start, list(t.allocation.gpus), t.allocation.cpus, time.time()])
    q.release(t)
say(grants=grants)
"""


@pytest.mark.parametrize("left", ["", "garbage", "{}", "[]"])
def test_a_ledger_nobody_can_read_is_shown_as_the_machine_found_and_said_to_be(tmp_path, left):
    """Guards against the terminal and the server showing a machine of 0 cores and 0 B
    for a ledger a crash or a full disk left empty or half written."""
    MachineQueue(tmp_path, inventory(cpus=4)).release(
        MachineQueue(tmp_path, inventory(cpus=4)).enqueue(Resources())
    )
    (tmp_path / LEDGER_FILE).write_text(left)
    with pytest.warns(LedgerBroken, match="could not be read"):
        shown = read_snapshot(tmp_path)
    assert shown["cpus"]["total"] >= 1 and shown["ram_bytes"]["total"] > 0, shown


def test_four_processes_of_two_hundred_claims_keep_the_books(tmp_path):
    """No deadlock, no card granted twice at once, and the books balance after."""
    processes = [other_process(tmp_path, STRESS, cpus=2, gpus=1) for _ in range(4)]
    intervals = []
    for process in processes:
        intervals += heard(process)["grants"]
        process.wait(timeout=60)
    assert len(intervals) == 800
    card_holds = sorted((start, end) for start, gpus, _, end in intervals if gpus)
    for (_, end), (start, _) in itertools.pairwise(card_holds):
        assert start >= end, "one card was held by two claims at once"
    after = MachineQueue(tmp_path, inventory(cpus=2, gpus=1)).snapshot()
    assert after["cpus"] == {"total": 2, "free": 2, "free_ids": []}
    assert after["running"] == [] and after["waiting"] == []


def books_for(tmp_path, ledger: str | None):
    """The books a kernel with ``ledger`` as its setting uses, on a machine without a service."""
    no_service = SimpleNamespace(run_dir=tmp_path / "no-machine-service")
    return books_in_force(no_service, Settings(ledger=ledger))


def test_a_chosen_location_is_private_to_the_user_too(tmp_path):
    """Guards against the old team mode: a FLUKSIO_LEDGER place made group-writable.

    A group member could rewrite every claim in it; books several users share
    are the machine service's.
    """
    books = books_for(tmp_path, str(tmp_path / "team"))
    assert (books.mode, books.where) == ("user", tmp_path / "team")
    queue = MachineQueue(books.where, inventory())
    queue.release(queue.enqueue(Resources()))
    assert os.stat(books.where).st_mode & 0o777 == 0o700
    assert os.stat(queue.ledger.path).st_mode & 0o777 == 0o600
    assert os.stat(books.where / "ledger.lock").st_mode & 0o777 == 0o600


def test_the_default_ledger_is_private_to_the_user(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    books = books_for(tmp_path, None)
    assert (books.mode, books.where) == ("user", tmp_path / "runtime" / "fluksio")
    queue = MachineQueue(books.where, inventory())
    queue.release(queue.enqueue(Resources()))
    assert os.stat(books.where).st_mode & 0o777 == 0o700
    assert os.stat(queue.ledger.path).st_mode & 0o077 == 0


def test_kernel_only_books_are_a_setting(tmp_path):
    books = books_for(tmp_path, "kernel")
    assert (books.mode, books.where) == ("kernel", None)


def test_the_command_line_prints_every_kernels_claims(tmp_path):
    """`fluksio-nb` on a shared box: who holds what, before starting a notebook."""
    holder = other_process(
        tmp_path,
        "t = q.enqueue(Resources(gpus=1), 'training run'); q.wait(t); say(ok=1)\n"
        "sys.stdin.readline()\n",
    )
    heard(holder)
    env = {**os.environ, "FLUKSIO_LEDGER": str(tmp_path)}
    shown = subprocess.run(
        [sys.executable, "-m", "fluksio_nb"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "gpus  1/1 used" in shown
    [line] = [line for line in shown.splitlines() if "training run" in line]
    # gpus= counts, as on the line; which card it is goes beside it.
    assert f"cpus=1 gpus=1 (card 0) (pid {holder.pid})" in line
    holder.stdin.write("\n")
    holder.stdin.flush()
    holder.wait(timeout=10)


def test_the_stop_button_at_any_moment_leaves_no_claim_held_in_the_ledger(tmp_path):
    """Guards against a claim the ledger recorded that its kernel never received."""
    from tests.test_queue import run_interrupted

    got = run_interrupted(
        "from fluksio_nb.inventory import Inventory\n"
        "from fluksio_nb.ledger import MachineQueue\n"
        "inventory = Inventory(cpus=2, machine_cpus=2, ram_bytes=0, machine_ram_bytes=0)\n"
        f"make = lambda: MachineQueue({str(tmp_path)!r}, inventory)\n"
    )
    assert got["interrupted"] > 0, got
    assert (got["running"], got["waiting"], got["free"]) == (0, 0, 2), got


#: The stop pressed at every moment Python could run its handler while a claim
#: is asked for, waited on and given back on a user's ledger, one moment a round
#: (as a function starts, and as a call into C returns: the moments a profile
#: function is told of), in the ledger's code and in what it stands on. After
#: each, another kernel of the user's takes every core and frees them while
#: this one waits for one: a claim left held, or the ledger's lock, would keep
#: it waiting, and a kernel that no longer heard its waker would never start.
STOP_AT_EVERY_MOMENT = '''
import contextlib, subprocess, threading
import fluksio_nb.queue
import fluksio_nb.stop_button
from fluksio_nb.errors import ClaimTimeout

OTHER = """
import sys
for line in sys.stdin:
    if line.strip() == "hold":
        held = q.enqueue(Resources(cpus=4), "everything")
        try:
            q.wait(held, 5)
            print("held", flush=True)
        except Exception as error:
            print(type(error).__name__, flush=True)
    else:
        q.release(held)
        print("freed", flush=True)
"""
other = subprocess.Popen(
    [sys.executable, "-c", PRELUDE + OTHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    text=True,
)

def tell(word):
    other.stdin.write(word + "\\n")
    other.stdin.flush()
    return other.stdout.readline().strip()

def check():
    if tell("hold") != "held":
        return "left_held_by_a_stop"
    waiter = q.enqueue(Resources(cpus=1), "waiter")
    tell("free")
    try:
        q.wait(waiter, 5)
    except ClaimTimeout:
        return "deaf_after_a_stop"
    q.release(waiter)

ledger = [m.__file__ for name, m in sys.modules.items() if name.startswith("fluksio_nb.ledger")]
watched = [fluksio_nb.queue.__file__, fluksio_nb.stop_button.__file__, *ledger]
watched += [contextlib.__file__, threading.__file__]
each_moment(watched, attempt, undo, check)
'''

#: A kernel's books found and opened for the first time, stopped at every
#: moment, one a round: the machine's run directory looked for, the user's
#: ledger directory made, its lock and its document opened and read, and a
#: first transaction. After each round the ledger is closed, the stop's
#: traceback let go and the ledger's directory removed: a descriptor still
#: open then was left open by nobody, for the kernel's life.
STOP_AT_EVERY_MOMENT_OF_FINDING_THE_BOOKS = """
import shutil
from pathlib import Path
import fluksio_nb.ledger.directory, fluksio_nb.ledger.file, fluksio_nb.machine.run_dir
from fluksio_nb.ledger.file import LedgerFile
from fluksio_nb.machine.run_dir import socket_in

HERE = Path(DIRECTORY)

def attempt(made):
    socket_in(HERE)
    ledger = made["ledger"] = LedgerFile(HERE / "ledger", {"cpus": 1})
    ledger.read()
    with ledger.transaction():
        pass

def undo(made):
    if "ledger" in made:
        made.pop("ledger").close()
    shutil.rmtree(HERE / "ledger", ignore_errors=True)

def check():
    if descriptors_left_open(descriptors):
        return "a_descriptor_left_open"

descriptors = len(os.listdir("/proc/self/fd"))
watched = [fluksio_nb.ledger.directory.__file__, fluksio_nb.ledger.file.__file__,
           fluksio_nb.machine.run_dir.__file__]
each_moment(watched, attempt, undo, check, forgotten=True)
"""


def test_a_stop_at_any_moment_of_finding_the_books_leaves_no_descriptor_open(tmp_path):
    """Guards against a stop landing as the ledger's directory, its lock or its document,
    or the machine's run directory, was opened: the descriptor stayed open for the
    kernel's life with nothing holding its number, one more at each unlucky stop."""
    said = said_by(
        f"DIRECTORY = {str(tmp_path)!r}\n{STOP_AT_EVERY_MOMENT_OF_FINDING_THE_BOOKS}", 100
    )
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 20, said


PRELUDE = """
from fluksio_nb.gpus import Gpu
from fluksio_nb.inventory import Inventory
from fluksio_nb.ledger import MachineQueue
from fluksio_nb.resources import Resources
INVENTORY = Inventory(cpus=4, machine_cpus=4, ram_bytes=0, machine_ram_bytes=0, gpus=())
q = MachineQueue(DIRECTORY, INVENTORY)
"""


def test_a_stop_at_any_moment_of_a_claim_leaves_the_users_ledger_free_and_its_waiters_woken(
    tmp_path,
):
    """Guards against a stop landing at an unlucky moment of a claim on a user's ledger,
    after which a claim stayed held, or the ledger's lock, and the user's other kernels
    waited for ever, or this kernel no longer heard that its turn had come."""
    prelude = f"DIRECTORY = {str(tmp_path)!r}\n" + PRELUDE
    script = f"{prelude}PRELUDE = {prelude!r}\n{A_CLAIM}{STOP_AT_EVERY_MOMENT}"
    said = said_by(script, timeout=100)
    assert "stopped_at" in said, said
    # A claim's way through the ledger is hundreds of such moments: every one was tried.
    assert said["stopped_at"] > 20, said
