"""What outlives what: the worker never its kernel, and no process of a cell its cell.

A worker holds a claim's cores, and whatever its cells start runs on them
and is read against the claim's budget. Once a cell is over, its share goes
back to the books and its worker back to a pool any claim may take; once
the kernel is gone, nobody is left to give anything back. A process still
running then would go on using cores the books call free, unseen by every
reading: a ``subprocess.Popen`` never waited for, ``os.system("server &")``,
a daemon that forked twice.

It decides:

- **The worker goes with its kernel.** A pipe whose write end only the kernel
  holds, and a pidfd of the kernel where Linux has one, become readable when
  the kernel is gone, however it went (:func:`leave_with_the_kernel`); the
  worker then ends everything below it and its own process group, removes the
  shared-memory files the dead kernel was sending, and leaves the claim's
  cgroups for the ones it was born in.
- **A cell's processes go with the cell.** The worker ends them after every
  cell (:func:`end_leftovers`), as the processes of ``c.popen`` end with
  their block, SIGTERM first and SIGKILL half a second later, as the stop
  button gives a cell its chance to end by itself. It looks once the kernel
  has the cell's outcome, on the claim's core, so a cell that leaves nothing
  costs the kernel nothing; the next cell waits for the ending.
- **A cell's threads go with the cell, and take its worker with them.** A
  thread still running the cell's code when the cell ends would find the
  cell's names gone (every cell starts from an empty namespace) and print
  into whichever cell ran next. Python cannot end a thread from outside, so
  the worker leaves after such a cell, and says why (:func:`threads_left`);
  the claim's next cell gets a fresh one.
- **The worker adopts what its cells orphan.** It is the child subreaper of
  everything below it (Linux's ``PR_SET_CHILD_SUBREAPER``): a process whose
  parent exits is handed to the worker rather than to init, so it is still
  found below the worker, whichever session or group it moved to, and the
  worker reaps it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from fluksio_nb import claim_cgroups, segments, shelf
from fluksio_nb.inventory import descendants

#: How often the worker asks who its parent is, for the case the lifeline
#: cannot see (a process forked from the kernel that still holds its write
#: end), where the kernel's death cannot be waited for as a file descriptor.
PARENT_CHECK_SECONDS = 1.0

#: prctl(2)'s option, from <linux/prctl.h>.
PR_SET_CHILD_SUBREAPER = 36

#: How long a leftover has to end after SIGTERM before SIGKILL.
GRACE_S = 0.5


def adopt_orphans() -> bool:
    """Make this process the reaper of every orphan below it; False where Linux cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def end_leftovers(grace_s: float = GRACE_S) -> list[int]:
    """End every process below this one; the ones that were running.

    SIGTERM first, and SIGKILL for what is left ``grace_s`` later; with no
    grace, SIGKILL at once.
    """
    reap()
    left = _running(descendants(os.getpid()))
    running = left
    steps = ((signal.SIGTERM, grace_s),) if grace_s > 0 else ()
    for sig, wait_s in (*steps, (signal.SIGKILL, 1.0)):
        if not running:
            break
        for pid in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while True:
            reap()
            # Listed again: a child that exits hands its own children to this process.
            running = _running(descendants(os.getpid()))
            if not running or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
    return left


def threads_left(namespace: dict[str, Any]) -> list[str]:
    """The names of the threads still running code of the cell whose names are ``namespace``."""
    frames = sys._current_frames()
    # The main thread's entry is this very frame, and through it the cell's
    # caller, whose locals hold the cell's inputs: kept in the dict, the two
    # make a cycle that only a garbage collection breaks, and a warm worker
    # that allocates little between cells held every cell's inputs (512 MB
    # mapped a cell) until one came.
    frames.pop(threading.main_thread().ident, None)
    left = []
    try:
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            while frame is not None and frame.f_globals is not namespace:
                frame = frame.f_back
            if frame is not None:
                left.append(thread.name)
    finally:
        frames.clear()
    return left


def reap() -> None:
    """Collect every child that has exited, adopted ones included, so none stays a zombie."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running: a zombie has ended, and only its parent can clear it."""
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z":
            alive.append(pid)
    return alive


def sweep_after(kernel_pid: int) -> None:
    """Remove the shared-memory files a kernel that died was sending.

    They would otherwise stay until some kernel next loads the extension (the
    memory a kernel keeps for reuse is a memfd, and goes with it). Its
    workers are the ones who notice the death. A dying process closes its
    descriptors, which is what wakes the worker, a moment before its children
    are handed to another parent, so the worker waits that moment out: a
    kernel that is merely done with the worker keeps its files.
    """
    deadline = time.monotonic() + 0.5
    while os.getppid() == kernel_pid:
        if time.monotonic() > deadline:
            return
        time.sleep(0.005)
    with contextlib.suppress(Exception):
        segments.sweep_orphans(gone=kernel_pid)


def kernels_death(kernel_pid: int) -> int | None:
    """A descriptor that becomes readable when the kernel exits, or None where Linux has none.

    A pidfd (Linux 5.3): unlike the lifeline, no process the kernel forked can
    hold it open. Opened, then the parent checked, so that a kernel already
    gone, whose number may be someone else's by now, is not the one watched.
    """
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd = pidfd_open(kernel_pid)
    except OSError:
        return None
    if os.getppid() != kernel_pid:
        # Gone already: a descriptor that is readable at once says so.
        os.close(fd)
        read_end, write_end = os.pipe()
        os.close(write_end)
        return read_end
    return fd


def leave_with_the_kernel(lifeline_fd: int, kernel_pid: int) -> None:
    """Take the worker and everything it started down as soon as the kernel is gone.

    A thread rather than ``PR_SET_PDEATHSIG``: that fires when the *thread*
    that started the worker exits, and the kernel may well start workers from
    a thread that ends long before the kernel does.
    """

    # Read now, while the worker is where its kernel started it: moved into a
    # claim's cgroup later, that is where it goes back to.
    born_in = {
        c: claim_cgroups.own_memory_cgroup(controller=c)
        for c in ("memory", "cpu", "cpuset", "devices")
    }

    kernel_gone = kernels_death(kernel_pid)

    def watch() -> None:
        # Any thread may take a signal sent to the process, and a SIGINT taken
        # here would only be flagged for the main thread, not wake it from a
        # cell's `time.sleep`.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        if kernel_gone is not None:
            # Both are waited for with no timeout: an idle worker, the one
            # started ahead of a notebook's first claim included, is then
            # never woken while its kernel lives.
            select.select([lifeline_fd, kernel_gone], [], [])
        else:
            while True:
                readable, _, _ = select.select([lifeline_fd], [], [], PARENT_CHECK_SECONDS)
                if readable or os.getppid() != kernel_pid:
                    break
        sweep_after(kernel_pid)
        for controller, home in born_in.items():
            with contextlib.suppress(Exception):
                claim_cgroups.leave_claim_cgroup(home, controller)
        # os._exit runs no atexit: let go of the memory kept for the next
        # cell's outputs now rather than with the process.
        with contextlib.suppress(Exception):
            shelf.clear_shelf()
        # What left the group (setsid daemons) was adopted, and is below it.
        with contextlib.suppress(Exception):
            end_leftovers(grace_s=0)
        # Only a group this worker leads is its own to end; started by hand
        # from a terminal, the group is the terminal's.
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="fluksio-lifeline", daemon=True).start()
