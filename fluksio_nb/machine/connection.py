"""Talking to the machine's books service over its socket, below any one request.

Finding the service and checking that root runs it, the hello every
connection starts with, and reading whole lines no longer than the protocol
allows. One-off requests on a connection of their own (a snapshot, a cancel)
are here too, for the server and the terminal; a kernel keeps one connection
open instead (:mod:`fluksio_nb.machine.client`).

What it decides: a process answering at the socket that is not root's is
refused before anything is sent, since another user could otherwise plant
a socket that collects this kernel's claims.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluksio_nb.errors import NotYours, ServiceUnavailable
from fluksio_nb.machine import protocol
from fluksio_nb.stop_button import open_whole

#: How long a request waits for the service's answer before it is an error.
ANSWER_WITHIN_S = 10.0
#: How long a kernel keeps trying to reach a service that is set up but not
#: answering, before a claim says so.
REACH_WITHIN_S = 3.0


@dataclass(frozen=True)
class ServiceAt:
    """A books service a kernel keeps its claims in: where it answers, and whose it must be.

    The machine's, root's; a user's own is reached as
    :class:`~fluksio_nb.machine.user_service.UserServiceAt`, which starts it.
    """

    socket: Path
    owner: int = 0

    def reach(self) -> socket.socket:
        return connect(self.socket, REACH_WITHIN_S, self.owner)

    def hello(self, share_labels: bool) -> dict[str, Any]:
        return hello(share_labels, lifeline=True)

    def not_answering(self, why: str) -> str:
        return not_answering(self.socket, why)


def connect(path: Path | str, within: float = REACH_WITHIN_S, owner: int = 0) -> socket.socket:
    """A connection to the service at ``path``, checked to run as ``owner`` (root's, by default)."""
    deadline = time.monotonic() + within
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(ANSWER_WITHIN_S)
            connect_at(sock, path)
            _, uid, _ = protocol.peer_credentials(sock)
            if uid != owner:
                whose = "root" if owner == 0 else f"this user (uid {owner})"
                raise ServiceUnavailable(
                    f"the process answering at {path} runs as uid {uid}, not {whose}; "
                    f"fluksio_nb trusts only a books service run by {whose}"
                )
            return sock
        except OSError as error:
            sock.close()
            if time.monotonic() >= deadline:
                raise ServiceUnavailable(
                    not_answering(path, error.strerror or str(error))
                ) from None
            time.sleep(0.1)
        except BaseException:
            sock.close()
            raise


def connect_at(sock: socket.socket, path: Path | str) -> None:
    """Connect ``sock`` to the socket at ``path``, however long the path is.

    A socket's address holds 107 bytes at most, and a user's runtime
    directory, or a test's, can be deeper than that: the directory is opened
    (never through a link) and the socket reached through its descriptor.
    """
    path = Path(path)
    fd = open_whole(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)


def not_answering(path: Path, why: str) -> str:
    """What to tell someone whose claim found no service at ``path``, and what they can do.

    A run directory no longer marked was taken down with ``machine remove``:
    an admin's restart would not help, and a kernel picks its books only as
    it starts.
    """
    from fluksio_nb.machine.run_dir import socket_in

    if socket_in(path.parent) is None:
        return (
            f"this machine's books at {path.parent} were taken down by its admin (`fluksio-nb "
            "machine remove`); a kernel chooses its books as it starts, so restart this "
            "kernel to keep books of your own"
        )
    return (
        f"this machine's books are set up at {path.parent}, but their service does not "
        f"answer ({why}). `fluksio-nb machine status` says more; the machine's admin "
        "restarts it with `fluksio-nb machine init`."
    )


def hello(
    share_labels: bool, *, lifeline: bool = False, machine: dict[str, Any] | None = None
) -> dict[str, Any]:
    from fluksio_nb.identity import this_kernel

    said = {"op": "hello", **this_kernel(), "share_labels": share_labels, "lifeline": lifeline}
    if machine is not None:
        said["machine"] = machine
    return said


class Lines:
    """Reading whole lines from a socket, no longer than the protocol allows."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer = sock, b""

    def next(self) -> dict[str, Any] | None:
        while b"\n" not in self.buffer:
            if len(self.buffer) > protocol.MAX_LINE_BYTES:
                raise ValueError("the service sent a line longer than the protocol allows")
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(raw)

    def ready(self) -> list[dict[str, Any]] | None:
        """Every whole line after one read that does not block; ``None`` once the peer closed."""
        try:
            chunk = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return []
        if not chunk:
            return None
        self.buffer += chunk
        *whole, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > protocol.MAX_LINE_BYTES:
            raise ValueError("the service sent a line longer than the protocol allows")
        return [json.loads(raw) for raw in whole]


def ask_once(
    path: Path, request: dict[str, Any], within: float = REACH_WITHIN_S, owner: int = 0
) -> dict[str, Any]:
    """One request on a connection of its own: for the server and the terminal."""
    with connect(path, within, owner) as sock:
        sock.sendall(protocol.line(hello(False)) + protocol.line({**request, "id": 1}))
        lines = Lines(sock)
        welcome = lines.next()
        if welcome is None or welcome.get("op") != "welcome":
            raise ServiceUnavailable(f"the books service at {path} refused: {welcome}")
        while True:
            message = lines.next()
            if message is None:
                raise ServiceUnavailable(f"the books service at {path} closed the connection")
            if message.get("id") == 1:
                return {**message, "welcome": welcome}


def read_snapshot(path: Path, owner: int = 0, within: float = REACH_WITHIN_S) -> dict[str, Any]:
    answer = ask_once(path, {"op": "snapshot"}, within, owner)
    return {**answer["snapshot"], "user": answer["welcome"]["user"]}


def cancel_claim(path: Path, number: int, reason: str, owner: int = 0) -> bool:
    answer = ask_once(path, {"op": "cancel", "ticket": number, "reason": reason}, owner=owner)
    if answer["op"] == "error":
        raise NotYours(answer["message"])
    return bool(answer.get("found"))
