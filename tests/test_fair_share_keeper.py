"""The fair share's keeper moves only the kernels it launched, never a pid reused since.

A Jupyter server run as root may set any process's affinity. A kernel that
died is reaped by the server's restarter before its cleanup tells the keeper
to forget it (and never, once the restarts have run out), so its pid can name
another user's process by the time the claims change: a claim's worker,
whose cores the keeper would take away. These tests hand a dead kernel's pid
to a real second user's process, as the kernel's pid allocator would on a
busy machine, and hold a real claim on real books so the keeper acts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

from fluksio_nb.kernel import books_in_force
from fluksio_nb.provisioner import _Keeper, _Kept
from tests.machines import wait_until
from tests.unix_users import USER_B, as_user, ready_user, user_environ

pytestmark = pytest.mark.timeout(120)

MACHINE = frozenset(os.sched_getaffinity(0))

#: Holds one claim of one core on the books FLUKSIO_LEDGER names until its stdin closes.
HOLDER = """
import json, sys
from fluksio_nb import Resources, accountant
queue = accountant()
ticket = queue.enqueue(Resources(cpus=1), label="held-elsewhere")
print(json.dumps(list(queue.wait(ticket, timeout=60).cores)), flush=True)
sys.stdin.read()
queue.release(ticket)
"""

#: Says its pid, then waits for its stdin to close.
IDLE = "import os, sys; print(os.getpid(), flush=True); sys.stdin.read()"


def idle(prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", IDLE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd="/",
    )


def idle_with_pid(pid: int, prefix: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A process started with the pid ``pid``, as the allocator hands out a freed one.

    Root may say which pid the next process gets (``ns_last_pid``); another
    process forking in between takes it, so it is tried until it holds.
    """
    for _ in range(1000):
        with open("/proc/sys/kernel/ns_last_pid", "w") as last:
            last.write(str(pid - 1))
        process = idle(prefix, env)
        if process.pid == pid:
            process.stdout.readline()
            return process
        process.kill()
        process.wait()
    pytest.skip(f"pid {pid} went to other processes on this busy machine 1000 times")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.stdin.close()
        process.wait(timeout=30)


@pytest.mark.skipif(len(MACHINE) < 2, reason="a claim holds cores of its own only with two or more")
def test_a_dead_kernels_pid_taken_by_another_users_process_is_not_moved():
    """Guards against a root server's keeper that confines whatever process now has a
    dead kernel's pid to the unclaimed cores: another user's, or a claim's worker,
    which loses the cores the books gave it."""
    other_user = ready_user(USER_B)
    books = books_in_force()
    keeper = _Keeper()
    processes: list[subprocess.Popen] = []
    try:
        dead = idle()
        processes.append(dead)
        dead.stdout.readline()
        keeper.keep(dead.pid, _Kept(books, MACHINE, MACHINE))
        live = idle()
        processes.append(live)
        live.stdout.readline()
        keeper.keep(live.pid, _Kept(books, MACHINE, MACHINE))
        # The kernel died and the server reaped it; its cleanup has not run.
        dead.kill()
        dead.wait()

        theirs = idle_with_pid(dead.pid, as_user(other_user), user_environ(other_user))
        processes.append(theirs)
        assert os.stat(f"/proc/{theirs.pid}").st_uid == other_user.uid
        assert os.sched_getaffinity(theirs.pid) == MACHINE

        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        processes.append(holder)
        held = frozenset(json.loads(holder.stdout.readline()))
        assert held and held < MACHINE

        # The keeper goes through its kernels in the order it was given them:
        # once the live one is off the claimed cores, it has been past the dead one.
        wait_until(
            lambda: os.sched_getaffinity(live.pid) == MACHINE - held,
            what=f"the live kernel off the claimed cores {sorted(held)}",
        )
        assert os.sched_getaffinity(theirs.pid) == MACHINE, (
            f"{other_user.name}'s process {theirs.pid}, which only has a dead kernel's pid, "
            f"was moved onto cores {sorted(os.sched_getaffinity(theirs.pid))}"
        )
        assert keeper.kernels() == 1
    finally:
        for process in processes:
            stop(process)


def test_a_dead_kernels_cleanup_leaves_kept_the_kernel_launched_since_on_its_pid():
    """Guards against a kernel's late cleanup making the keeper forget the kernel the
    server launched since on the same pid, whose threads then stay wherever they were
    while the claims change."""
    keeper = _Keeper()
    books = books_in_force()
    dead = idle()
    dead.stdout.readline()
    first = _Kept(books, MACHINE, MACHINE)
    keeper.keep(dead.pid, first)
    dead.kill()
    dead.wait()
    relaunched = idle_with_pid(dead.pid, [], None)
    try:
        keeper.keep(relaunched.pid, _Kept(books, MACHINE, MACHINE))

        keeper.release(dead.pid, first)

        assert keeper.kernels() == 1, "the kernel launched on the dead one's pid is not kept"
    finally:
        stop(relaunched)
        keeper.release(relaunched.pid)
