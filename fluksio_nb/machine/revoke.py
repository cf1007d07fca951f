"""A claim the service ends (an admin's cancel, a time limit, idle cards), whatever its kernel does.

Before an admin's rule ends a claim, its owner is warned, in their cell and
in everyone's views (:meth:`Stopping.warn_claim`), and a warning that no
longer holds is withdrawn. Then the service tells the claim's kernel to
stop, and the kernel ends the work and gives the share back. A kernel
stopped with ``SIGSTOP``, hung, or written to ignore the stop would keep
the card for ever, and an admin who is not root could not end it. So a
stopped claim still held :data:`STOP_GRACE_S` later is ended by the
service: it kills the claim's processes, and frees the share in the books
whatever the kernel says or does not say.

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

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fluksio_nb.machine.books import Entry, MachineBooks
    from fluksio_nb.machine.time_limits import TimeLimits
    from fluksio_nb.machine.turns import Connection

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


class Stopping:
    """The part of :class:`~fluksio_nb.machine.service.BooksService` that ends claims itself.

    It records an end with the service's ``record_end``, writes down what
    runs with ``note_held``, and grants what the end frees with ``dispatch``.
    """

    books: MachineBooks
    time_limits: TimeLimits

    if TYPE_CHECKING:
        # The service's own, and the restarts' (note_held), named here for the reader.
        def record_end(self, entry: Entry, ended_at: float, ending: str) -> None: ...
        def note_held(self) -> None: ...
        def dispatch(self) -> None: ...

    def warn_claim(self, entry: Entry, message: str) -> None:
        """Tell a claim's owner, in their cell, and everyone, in their views, what is coming."""
        if entry.warning == message:
            return
        entry.warning = message
        self.books.changed()
        owner: Connection = entry.owner
        owner.send({"op": "warning", "ticket": entry.number, "message": message})

    def clear_warning(self, entry: Entry, message: str) -> None:
        """Withdraw a claim's warning: gone from everyone's views, and its owner told why."""
        if entry.warning is None:
            return
        entry.warning = None
        self.books.changed()
        owner: Connection = entry.owner
        owner.send({"op": "warning", "ticket": entry.number, "message": message, "cleared": True})

    def end_claim(self, entry: Entry, reason: str, ending: str) -> None:
        """End a claim for ``reason``, whatever its kernel does; its record ends ``ending``.

        A waiting claim leaves the queue at once. A running one's kernel is
        told to stop it, and given :data:`STOP_GRACE_S` to; then the service
        kills its processes and frees the share itself (:meth:`_carry_out`).
        """
        self.books.changed()
        entry.cancel, entry.ended_as = reason, ending
        owner: Connection = entry.owner
        if entry.state == "waiting":
            # Gone from the queue at once; the owner learns why when told.
            self.books.remove(entry.number)
            owner.entries.pop(entry.number, None)
            self.record_end(entry, time.time(), ending)
        # The ending, for the kernel's own record to say the same.
        owner.send({"op": "stop", "ticket": entry.number, "reason": reason, "ending": ending})
        if entry.state == "running":
            asyncio.get_running_loop().call_later(STOP_GRACE_S, self._carry_out, entry, ending)
        # A waiting claim that left may have been the head of the queue.
        self.dispatch()

    def _carry_out(self, entry: Entry, ending: str) -> None:
        """End a stopped claim its kernel did not give back: its processes, and its share.

        The kernel may be stopped, hung or ignoring the stop; the share is
        free now whatever it does, and it hears the stop when it next reads.
        """
        if self.books.entries.get(entry.number) is not entry:
            return  # given back by its kernel, as it should be
        killed = stop_claims_processes(entry.pids, entry.uid, entry.pid)
        log.info(
            "claim %s of %s was not given back %g s after it was stopped (%s): the service "
            "freed it, and killed its processes %s",
            entry.number,
            entry.user,
            STOP_GRACE_S,
            entry.cancel,
            killed or "(none it could verify)",
        )
        self.books.remove(entry.number)
        self.time_limits.forget(entry.number)
        owner: Connection = entry.owner
        owner.entries.pop(entry.number, None)
        self.record_end(entry, time.time(), ending)
        self.note_held()
        self.dispatch()
