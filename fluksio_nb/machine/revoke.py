"""An admin's cancel carried out by the service, whatever the owner's kernel does.

The service tells a claim's kernel to stop, and the kernel ends the work and
gives the share back. A kernel stopped with ``SIGSTOP``, hung, or written to
ignore the stop would keep the card for ever, and an admin who is not root
could not end it. So a cancelled claim still held :data:`STOP_GRACE_S` later
is ended by the service: it kills the claim's processes, and frees the share
in the books whatever the kernel says or does not say.

Which processes are the claim's is the kernel's word (it reports the pid of
each worker or process it starts for the claim), and that word is never
taken as it is: the service, root, would otherwise kill any process a user
named. A pid is signalled only if its process, and each one of its tree, is
the claim owner's (real, effective and saved uid) and descends from the very
process that holds the claim's connection (``SO_PEERCRED``'s pid), which
itself is never killed: a user's kernel holds more than one claim's work.
Each process is held by a pidfd from before it is checked until it is
signalled, so a pid that ends and is reused meanwhile is not signalled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterable

log = logging.getLogger("fluksio_nb.machine")

#: How long a cancelled claim's kernel has to end it and give the share back
#: itself before the service does: enough for a kernel to stop a worker and
#: release, and short enough that the next claim is granted within 5 s.
STOP_GRACE_S = 2.0
#: The most processes of one claim the service remembers, and kills.
MOST_PIDS = 64


def _status(pid: int) -> tuple[int, tuple[int, ...]] | None:
    """``(ppid, (real, effective, saved uid))`` of ``pid`` as the OS says; ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as file:
            text = file.read(1 << 16).decode(errors="replace")
    except OSError:
        return None
    ppid, uids = None, None
    for line in text.splitlines():
        if line.startswith("PPid:"):
            ppid = int(line.split()[1])
        elif line.startswith("Uid:"):
            uids = tuple(int(n) for n in line.split()[1:4])
    if ppid is None or uids is None:
        return None
    return ppid, uids


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``ancestor`` is a parent, grandparent, ... of ``pid``."""
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        status = _status(pid)
        if status is None:
            return False
        pid = status[0]
        if pid == ancestor:
            return True
    return False


def _children(pid: int) -> list[int]:
    try:
        import psutil

        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


def _held(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return os.pidfd_open(pid)
    return None


def stop_claims_processes(pids: Iterable[int], uid: int, owner_pid: int) -> list[int]:
    """Kill the trees of ``pids`` that are user ``uid``'s below ``owner_pid``; the pids killed.

    Each pid, and each process below it, is checked while a pidfd holds it;
    one that is not the owner's, or not below the owner's connected process,
    is left alone, and said in the log.
    """
    held: dict[int, int] = {}
    try:
        for pid in pids:
            for one in (pid, *_children(pid)):
                if one in held or one == owner_pid or one <= 1:
                    continue
                fd = _held(one)
                if fd is None:
                    continue
                status = _status(one)
                # Checked after the pidfd is taken: the pid checked is the process held.
                if status is None or set(status[1]) != {uid} or not _descends_from(one, owner_pid):
                    os.close(fd)
                    if one == pid:
                        log.warning(
                            "pid %d was reported as a claim's process by uid %d's kernel %d, "
                            "but is not a process of theirs below it; it was not signalled",
                            one,
                            uid,
                            owner_pid,
                        )
                    continue
                held[one] = fd
        killed = []
        for pid, fd in held.items():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed
    finally:
        for fd in held.values():
            os.close(fd)
