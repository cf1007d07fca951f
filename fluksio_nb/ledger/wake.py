"""Waking a claim that waits in another kernel, as soon as its share is free.

A waiting claim learns that a share came free only from the ledger, and
looking at the ledger often enough to notice at once would cost every waiter
a transaction every few milliseconds. So whoever frees a share says so.

What it decides:

- **Waiters sleep.** Each waiting claim listens on a Unix datagram socket
  whose name is in its entry. Whoever grants it (a release, a cancel, a
  kernel noticing a dead one) sends a byte there, so capacity freed in one
  kernel reaches a waiter in another within a millisecond or two.
- **Only the user's own kernels can wake a waiter.** The socket is a file in
  the ledger's own checked directory (:mod:`fluksio_nb.ledger.directory`),
  bound and reached through that directory's descriptor, never by a path
  that could lead elsewhere. Another user cannot get to it: the directory
  fluksio_nb makes is 0700, and the socket itself is 0600. It used to be an
  abstract socket, which anyone can find in ``/proc/net/unix`` and send to,
  and every datagram cost the waiter a look at the ledger. Behind that, the
  socket asks the OS who sent each datagram (``SO_PASSCRED``), and one from
  another uid is dropped without waking anyone: a directory chosen with
  ``FLUKSIO_LEDGER`` may let others through, and the socket is not 0600 from
  the instant it is bound.
- **A burst costs one look.** A waiter woken takes whatever else has arrived
  (up to :data:`_MOST_PER_WAKE`, so a flood cannot keep it reading) and then
  looks at the ledger once.
- **The dead leave no sockets behind for long.** A waiter removes its socket
  once its claim is given back; one killed before it could is removed by the next
  waiter made in that directory, which finds its process gone.
- **A holder that dies wakes them too.** A kernel killed with SIGKILL gives
  nothing back and wakes nobody, so a waiter also watches the processes that
  hold shares (a pidfd each, which the OS makes readable as the process
  ends), and looks the moment one ends. Before, it noticed on its next look,
  up to half a second later. It still looks every half second
  (:data:`~fluksio_nb.ledger.queue.LOOK_EVERY_S`), for a holder it could not
  watch.
- **Waking is best effort.** A waiter that is gone, or a socket that is
  full, costs nothing: the waiter looks again on its own anyway. So does a
  waiter without a socket: the directory is reached through
  ``/proc/self/fd`` (its own path may be longer than a socket address can
  hold), so without ``/proc`` there is none. A kernel of an older version,
  whose waiters listen on abstract sockets, and this one cannot wake each
  other's waiters; those still look on their own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import select
import socket
import stat
import struct
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import psutil

from fluksio_nb.ledger.owner import seen_to_end

if TYPE_CHECKING:
    from fluksio_nb.ledger.file import LedgerFile

#: A waiter's address as the ledger records it. The leading NUL is how older
#: versions wrote an abstract address, and what the ledger's document still
#: requires; the socket's file in the ledger's directory is :func:`_file_name`.
_ADDRESS = re.compile(r"\x00fluksio-([0-9]+)-[0-9a-f]{12}")
_SUFFIX = ".wake"

#: The most datagrams a waiter reads per wake; more than a socket queues by
#: default (``net.unix.max_dgram_qlen``), so a burst is taken at once.
_MOST_PER_WAKE = 64

#: ``struct ucred``: pid, uid, gid.
_UCRED = struct.Struct("iII")


def _file_name(address: str) -> str | None:
    """The socket's name in the ledger's directory, if ``address`` is one of ours."""
    if not isinstance(address, str) or _ADDRESS.fullmatch(address) is None:
        return None
    return address[1:] + _SUFFIX


def _in_directory(directory_fd: int, name: str) -> str:
    """``name`` in the directory open as ``directory_fd``, as a socket address.

    Through the descriptor, the path is short whatever the directory's own
    path is, and leads to the checked directory, not to whatever its path
    leads to now.
    """
    return f"/proc/self/fd/{directory_fd}/{name}"


class Waker:
    """A datagram socket a waiting claim sleeps on; its address goes in the ledger.

    ``address`` is ``None`` if no socket could be made: the claim then only
    looks on its own. ``accepted`` counts the wakes taken, ``refused`` the
    datagrams of other users dropped.
    """

    def __init__(self, ledger: LedgerFile) -> None:
        #: A descriptor of the ledger's checked directory, of its own: the
        #: socket is removed through it even after the ledger is closed.
        self._dir_fd: int | None = None
        self.socket: socket.socket | None = None
        self.address: str | None = None
        self.accepted = 0
        self.refused = 0
        #: A pidfd for each holder watched, by its pid and start time.
        self._holders: dict[tuple[int, float], tuple[int, dict[str, Any]]] = {}
        self._ended_unwatched = False
        # The ledger's own descriptor, checked as the ledger opened it.
        checked = ledger.directory_fd
        if checked is None:
            return
        self._dir_fd = os.dup(checked)
        _remove_left_behind(self._dir_fd)
        address = f"\0fluksio-{os.getpid()}-{secrets.token_hex(6)}"
        name = _file_name(address)
        assert name is not None
        made = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # Before the bind: no datagram arrives without its sender's uid.
            made.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            made.bind(_in_directory(self._dir_fd, name))
        except OSError:
            made.close()
            return
        try:
            os.chmod(name, 0o600, dir_fd=self._dir_fd)
        except OSError:
            made.close()
            self._unlink(name)
            return
        made.setblocking(False)
        self.socket, self.address = made, address

    def watch(self, holders: Iterable[dict[str, Any]]) -> None:
        """Wake also as one of these kernels (ledger owners) ends, and stop watching the rest."""
        wanted = {(owner["pid"], owner["started"]): owner for owner in holders}
        for key in self._holders.keys() - wanted.keys():
            os.close(self._holders.pop(key)[0])
        for key in wanted.keys() - self._holders.keys():
            try:
                self._holders[key] = (os.pidfd_open(key[0]), wanted[key])
            except OSError as error:
                if error.errno == errno.ESRCH:
                    # Ended, and reaped, since the ledger was read.
                    seen_to_end(wanted[key])
                    self._ended_unwatched = True
                # Otherwise no pidfds here (Linux before 5.3): the looks find it.

    def sleep(self, seconds: float) -> None:
        """Until woken by this user, a watched holder ends, or ``seconds`` pass."""
        if self._ended_unwatched:
            self._ended_unwatched = False
            return
        deadline = time.monotonic() + max(seconds, 0.001)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            pidfds = {fd: key for key, (fd, _) in self._holders.items()}
            # poll, not select: a kernel may hold more descriptors than select takes.
            poller = select.poll()
            for fd in [*pidfds, *([self.socket.fileno()] if self.socket is not None else [])]:
                poller.register(fd, select.POLLIN)
            try:
                ready = [fd for fd, _ in poller.poll(left * 1000)]
            except InterruptedError:
                return
            if not ready:
                return
            ended = False
            for fd in ready:
                if fd in pidfds:
                    # Ended: forgotten here, and as alive, so the look that
                    # follows asks the OS rather than believing it still is.
                    os.close(fd)
                    seen_to_end(self._holders.pop(pidfds[fd])[1])
                    ended = True
            # Whatever else arrived is taken now, so that a burst costs one look.
            woken = self._take_wakes()
            if woken or ended:
                return

    def _take_wakes(self) -> bool:
        """Read what has arrived, up to :data:`_MOST_PER_WAKE`; whether this user sent any."""
        if self.socket is None:
            return False
        mine = False
        for _ in range(_MOST_PER_WAKE):
            try:
                _, ancillary, _, _ = self.socket.recvmsg(1, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                break
            if _sent_by_this_user(ancillary):
                self.accepted += 1
                mine = True
            else:
                self.refused += 1
        return mine

    def close(self) -> None:
        self.watch(())
        if self.socket is not None:
            self.socket.close()
            self.socket = None
            if self.address is not None:
                self._unlink(_file_name(self.address))
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def _unlink(self, name: str | None) -> None:
        if name is not None and self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._dir_fd)


def _sent_by_this_user(ancillary: list[tuple[int, int, bytes]]) -> bool:
    """Whether the OS says a datagram's sender is this process's user."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            if len(data) < _UCRED.size:
                return False
            _, uid, _ = _UCRED.unpack_from(data)
            return uid == os.geteuid()
    return False


def _remove_left_behind(directory_fd: int) -> None:
    """Remove the sockets of waiters whose process is gone (SIGKILL, a crash)."""
    try:
        names = os.listdir(directory_fd)
    except OSError:
        return
    for name in names:
        if not name.endswith(_SUFFIX):
            continue
        found = _ADDRESS.fullmatch("\0" + name.removesuffix(_SUFFIX))
        # A pid in use by anybody may still be a waiter's.
        if found is None or psutil.pid_exists(int(found.group(1))):
            continue
        with contextlib.suppress(OSError):
            seen = os.stat(name, dir_fd=directory_fd, follow_symlinks=False)
            if stat.S_ISSOCK(seen.st_mode) and seen.st_uid == os.geteuid():
                os.unlink(name, dir_fd=directory_fd)


def wake(ledger: LedgerFile, addresses: list[str]) -> None:
    """Tell waiting claims to look at the ledger again. Best effort: they also poll.

    Each is reached in the ledger's checked directory, by the name its
    address gives; an address that is not one of ours is skipped.
    """
    directory_fd = ledger.directory_fd
    names = [name for name in map(_file_name, addresses) if name is not None]
    if not names or directory_fd is None:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for name in names:
            with contextlib.suppress(OSError):
                sender.sendto(b"!", _in_directory(directory_fd, name))
