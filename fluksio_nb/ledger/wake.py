"""Waking a claim that waits in another kernel, as soon as its share is free.

A waiting claim learns that a share came free only from the ledger, and
looking at the ledger often enough to notice at once would cost every waiter
a transaction every few milliseconds. So whoever frees a share says so.

What it decides:

- **Waiters sleep.** Each waiting claim listens on a Unix datagram socket
  whose address is in its entry. Whoever grants it (a release, a cancel, a
  kernel noticing a dead one) sends a byte there, so capacity freed in one
  kernel reaches a waiter in another within a millisecond or two. A waiter
  also wakes every half second
  (:data:`~fluksio_nb.ledger.queue.LOOK_EVERY_S`), to notice holders that
  died silently.
- **Waking is best effort.** A waiter that is gone, or a socket that is
  full, costs nothing: the waiter looks again on its own anyway.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket


class Waker:
    """A datagram socket a waiting claim sleeps on; its address goes in the ledger."""

    def __init__(self) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The abstract namespace: no file to clean up, gone with the process.
        self.address = f"\0fluksio-{os.getpid()}-{secrets.token_hex(6)}"
        self.socket.bind(self.address)

    def sleep(self, seconds: float) -> None:
        self.socket.settimeout(max(seconds, 0.001))
        with contextlib.suppress(TimeoutError, BlockingIOError, InterruptedError):
            while True:
                self.socket.recv(64)
                # Drain whatever else arrived, then go and look.
                self.socket.settimeout(0)

    def close(self) -> None:
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
