"""Waking a claim that waits in another kernel, as soon as its share is free.

A waiting claim learns that a share came free only from the ledger, and
looking at the ledger often enough to notice at once would cost every waiter
a transaction every few milliseconds. So whoever frees a share says so.

What it decides:

- **Waiters sleep.** Each waiting claim listens on a Unix datagram socket
  whose address is in its entry. Whoever grants it (a release, a cancel, a
  kernel noticing a dead one) sends a byte there, so capacity freed in one
  kernel reaches a waiter in another within a millisecond or two.
- **A holder that dies wakes them too.** A kernel killed with SIGKILL gives
  nothing back and wakes nobody, so a waiter also watches the processes that
  hold shares (a pidfd each, which the OS makes readable as the process
  ends), and looks the moment one ends. Before, it noticed on its next look,
  up to half a second later. It still looks every half second
  (:data:`~fluksio_nb.ledger.queue.LOOK_EVERY_S`), for a holder it could not
  watch.
- **Waking is best effort.** A waiter that is gone, or a socket that is
  full, costs nothing: the waiter looks again on its own anyway.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import select
import socket
from collections.abc import Iterable
from typing import Any

from fluksio_nb.ledger.owner import seen_to_end


class Waker:
    """A datagram socket a waiting claim sleeps on; its address goes in the ledger."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The abstract namespace: no file to clean up, gone with the process.
        self.address = f"\0fluksio-{os.getpid()}-{secrets.token_hex(6)}"
        self.socket.bind(self.address)
        self.socket.setblocking(False)
        #: A pidfd for each holder watched, by its pid and start time.
        self._holders: dict[tuple[int, float], tuple[int, dict[str, Any]]] = {}
        self._ended_unwatched = False

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
        if self._ended_unwatched:
            self._ended_unwatched = False
            return
        pidfds = {fd: key for key, (fd, _) in self._holders.items()}
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([self.socket, *pidfds], [], [], max(seconds, 0.001))
            for fd in ready:
                if fd in pidfds:
                    # Ended: forgotten here, and as alive, so the look that
                    # follows asks the OS rather than believing it still is.
                    os.close(fd)
                    seen_to_end(self._holders.pop(pidfds[fd])[1])
        # Drain whatever else arrived, then go and look.
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                self.socket.recv(64)

    def close(self) -> None:
        self.watch(())
        self.socket.close()


def wake(addresses: list[str]) -> None:
    """Tell waiting claims to look at the ledger again. Best effort: they also poll."""
    if not addresses:
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.setblocking(False)
        for address in addresses:
            with contextlib.suppress(OSError):
                sender.sendto(b"!", address)
