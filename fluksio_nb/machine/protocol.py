"""What a kernel and the machine's books service say to each other.

One JSON object per line over a Unix stream socket. Every line the service
reads comes from a process it does not trust, so each is parsed into one of
the models below or refused; a line that does not parse ends that
connection and nobody else's. Replies carry the ``id`` of the request they
answer; the service also pushes news about a connection's own claims
(``granted``, ``stop``) without being asked.

What the service decides from the operating system, never from a message:
who is asking (``SO_PEERCRED``'s uid and pid), and when they asked (the
order it read the lines in).
"""

from __future__ import annotations

import socket
import struct
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter

#: The longest line either side reads. A snapshot of a busy machine is a few
#: kilobytes; anything near this is an attack or a bug, and ends the connection.
MAX_LINE_BYTES = 1 << 20


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """The process at the other end: (pid, uid, gid), from the kernel, not from the peer."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class _Message(BaseModel):
    # Strict: a count sent as "2" is a client that does not speak the protocol.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Need(_Message):
    # At least one core: a claim of nothing would fit however full the machine
    # is, and one user could fill the books with as many as they like.
    cpus: int = Field(ge=1, le=1 << 20)
    gpus: int = Field(ge=0, le=1 << 12)
    ram_bytes: int = Field(ge=0, le=1 << 62)


class Hello(_Message):
    """The first line of every connection: what the kernel says of itself.

    Only what a reader may be shown about the kernel, and only to whom its
    owner allows: ``share_labels`` false hides the labels, the notebook and
    the kernel id from every other user.
    """

    op: Literal["hello"]
    kernel_id: str | None = Field(default=None, max_length=256)
    notebook: str | None = Field(default=None, max_length=4096)
    share_labels: bool = False


class Claim(_Message):
    op: Literal["claim"]
    id: int
    need: Need
    label: str = Field(max_length=512)


class Release(_Message):
    """A claim given back; no reply, since nothing the kernel does next depends on one."""

    op: Literal["release"]
    ticket: int


class Cancel(_Message):
    op: Literal["cancel"]
    id: int
    ticket: int
    reason: str = Field(max_length=1024)


class Report(_Message):
    """A running claim's latest readings; no reply."""

    op: Literal["report"]
    ticket: int
    # Shown to every user in each snapshot: a handful of short figures.
    readings: dict[Annotated[str, StringConstraints(max_length=32)], float | int | None] = Field(
        max_length=32
    )


class Snapshot(_Message):
    op: Literal["snapshot"]
    id: int


class KernelDeaths(_Message):
    """The asker's own claims whose kernel was killed: the records the service wrote, which
    only root may read."""

    op: Literal["kernel_deaths"]
    id: int
    #: Only those that ended since (``time.time()``).
    since: float | None = None


class Restore(_Message):
    """A claim this kernel was running when its connection to the service broke."""

    op: Literal["restore"]
    id: int
    label: str = Field(max_length=512)
    cpus: int = Field(ge=1, le=1 << 20)
    gpus: list[int] = Field(max_length=1 << 12)
    ram_bytes: int = Field(ge=0, le=1 << 62)
    cores: list[int] = Field(default_factory=list, max_length=1 << 20)


Request = Annotated[
    Claim | Release | Cancel | Report | Snapshot | KernelDeaths | Restore,
    Field(discriminator="op"),
]
read_hello = TypeAdapter(Hello).validate_json
read_request = TypeAdapter(Request).validate_json


def line(message: dict[str, Any]) -> bytes:
    """One message as the line that goes over the socket."""
    import json

    return json.dumps(message, separators=(",", ":")).encode() + b"\n"
