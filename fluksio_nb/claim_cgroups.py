"""A claim's memory cgroup as the files it is: what a worker needs of it, without the books.

A worker moves itself: out of its claim's cgroup to write its results
(:func:`copy_back_outside_the_cap`), and out for good, removing the cgroup,
when its kernel is gone (:func:`leave_claim_cgroup`). Those moves, and the
file operations under them, live here rather than in
:mod:`fluksio_nb.memory_cap`, which makes and fills the cgroups: everything
that module imports to decide a claim's budget (the settings, the budget,
the enforcement, and pydantic under them) was half of a worker's start,
paid by every claimed cell that waited for a fresh worker. Nothing here
imports them; ``tests/test_worker.py`` checks that a worker's process does
not either.

What it decides: a claim's cgroup is named by :data:`CLAIM_NAME`, and is
removed only once the processes still in it are killed (``rmdir`` fails
while any task is in it), within a grace the caller gives.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from fluksio_nb.inventory import CGROUP_ROOT, PROC_SELF_CGROUP, cgroup_paths
from fluksio_nb.stop_button import open_whole

#: ``fluksio_nb-<owner pid>-<owner start time in clock ticks>-<claim number>``.
CLAIM_NAME = re.compile(r"^fluksio_nb-(\d+)-(\d+)-(\d+)$")

#: How long the processes left in a claim's cgroup get to be gone after SIGKILL.
KILL_GRACE_S = 5.0


def v2_mount(root: Path) -> Path | None:
    """Where the unified hierarchy is: ``root`` itself, or ``root/unified`` beside v1."""
    for candidate in (root, root / "unified"):
        if (candidate / "cgroup.controllers").exists():
            return candidate
    return None


def own_memory_cgroup(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP, controller: str = "memory"
) -> Path | None:
    """This process's ``controller`` cgroup directory: the v1 one, else the v2 one."""
    paths = cgroup_paths(proc_cgroup)
    if controller in paths and (root / controller).is_dir():
        return root / controller / paths[controller].lstrip("/")
    mount = v2_mount(root)
    if "" in paths and mount is not None:
        return mount / paths[""].lstrip("/")
    return None


def leave_claim_cgroup(home: Path | None, controller: str = "memory") -> None:
    """Move this process home and remove the claim cgroup it is in, if it is in one.

    For a worker whose kernel is gone: nobody else will remove the cgroup,
    and a cgroup cannot be removed while the process removing it is inside.
    ``home`` is the cgroup the worker was born in, its kernel's.
    """
    here = own_memory_cgroup(controller=controller)
    if home is None or here is None or not CLAIM_NAME.match(here.name) or here == home:
        return
    with contextlib.suppress(OSError):
        write_cgroup_file(home / "cgroup.procs", str(os.getpid()))
        remove_cgroup(here)


@contextlib.contextmanager
def copy_back_outside_the_cap() -> Iterator[Callable[[], None]]:
    """A step out of the claim's memory cgroup for writing its results, and back in after.

    Pages written in ``/dev/shm`` stay charged to the cgroup of whoever wrote
    them: a cell keeping 320 MB under ``ram=500M`` was killed by its cap
    writing the second 320 MB, which is the kernel's memory from then on. So
    they are written from the kernel's own cgroup, where
    :meth:`fluksio_nb.memory_cap.ClaimCgroup.let_go` puts the worker after the cell anyway. The
    step is taken (call what this gives) once every value is pickled: a value
    whose pickling copies it (text, objects) is still held to the budget, and
    only ``write()`` of buffers, which allocates nothing in the worker, is
    outside. A worker in no claim cgroup, or that may not move, stays, and
    the cap counts the copy.
    """
    left: Path | None = None

    def step_out() -> None:
        nonlocal left
        claim = own_memory_cgroup()
        if left is not None or claim is None or not CLAIM_NAME.match(claim.name):
            return
        # The kernel started the worker, and is never in a claim's cgroup itself.
        home = own_memory_cgroup(proc_cgroup=Path(f"/proc/{os.getppid()}/cgroup"))
        if home is None or home == claim:
            return
        with contextlib.suppress(OSError):
            write_cgroup_file(home / "cgroup.procs", str(os.getpid()))
            left = claim

    try:
        yield step_out
    finally:
        if left is not None:
            # Gone if the claim ended meanwhile: the worker then stays home.
            with contextlib.suppress(OSError):
                write_cgroup_file(left / "cgroup.procs", str(os.getpid()))


def remove_cgroup(path: Path, grace_s: float = KILL_GRACE_S) -> bool:
    """Kill every process in the cgroup at ``path`` and remove it; whether it is gone."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as error:
            # Busy is the one a kill fixes: processes still in it. Not ours
            # to remove is not worth the grace at every claim's sweep.
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        for pid in cgroup_pids(path):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def write_cgroup_file(path: Path, text: str) -> None:
    """``text`` into the cgroup file at ``path``, in the one write the kernel reads it from."""
    fd = open_whole(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def cgroup_pids(path: Path) -> list[int]:
    """The processes in the cgroup at ``path``; none if it cannot be read."""
    try:
        return [int(pid) for pid in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []
