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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from fluksio_nb.card_slices import CardAsk, Slice

# The same bounds as a usage record's: a time no clock can show, or more bytes
# than any machine has, is only ever an attacker's.
from fluksio_nb.records import LATEST_TIME, MOST_BYTES

#: The longest line a client reads. A snapshot of a busy machine is a few
#: kilobytes; anything near this is an attack or a bug, and ends the connection.
#: The service reads far shorter lines: no request is longer than
#: :data:`~fluksio_nb.machine.turns.MAX_REQUEST_BYTES`.
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
    #: A slice of one card instead of whole cards: a fraction strictly between
    #: 0 and 1 of it, or that many bytes of its memory. At most one, and only
    #: with ``gpus`` 0: a claim is whole cards or one slice.
    gpu_fraction: float | None = Field(default=None, gt=0, lt=1, allow_inf_nan=False)
    gpu_bytes: int | None = Field(default=None, ge=1, le=1 << 50)

    @model_validator(mode="after")
    def _whole_cards_or_one_slice(self) -> Need:
        if self.gpu_fraction is not None and self.gpu_bytes is not None:
            raise ValueError("a slice is a fraction of a card or bytes of it, not both")
        if self.gpus and (self.gpu_fraction is not None or self.gpu_bytes is not None):
            raise ValueError("a claim asks for whole cards or for a slice of one, not both")
        return self

    def piece(self) -> Slice | None:
        """The slice of one card this need asks for, if it asks for one."""
        if self.gpu_fraction is None and self.gpu_bytes is None:
            return None
        return Slice(fraction=self.gpu_fraction, nbytes=self.gpu_bytes)


def need_said(cpus: int, cards: CardAsk, ram_bytes: int) -> dict[str, Any]:
    """A claim's :class:`Need` as a kernel sends it: a slice only where it asks for one,
    so that a service of a release before slices still reads every other claim."""
    need: dict[str, Any] = {"cpus": cpus, "gpus": cards.whole, "ram_bytes": ram_bytes}
    if cards.piece is not None and cards.piece.fraction is not None:
        need["gpu_fraction"] = cards.piece.fraction
    elif cards.piece is not None:
        need["gpu_bytes"] = cards.piece.nbytes
    return need


class Described(_Message):
    """The machine a kernel keeps its books over, and the settings that said so."""

    cpus: int = Field(ge=1, le=1 << 20)
    gpu_ids: list[int] = Field(max_length=1 << 12)
    ram_bytes: int = Field(ge=0, le=1 << 62)
    core_ids: list[int] = Field(max_length=1 << 16)
    core_nodes: dict[str, int] = Field(max_length=1 << 16)
    #: ``FLUKSIO_*`` variable to the value it had; a setting left unset is absent.
    settings: dict[str, str] = Field(max_length=32)


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
    #: A kernel's connection, which holds its claims; not a view's or a
    #: terminal's, which ask once and go. A user's own service lives while
    #: one is open (:mod:`.user_service`).
    lifeline: bool = False
    #: The machine as this kernel declares it: a user's own service keeps
    #: one description for all their kernels. The machine's service, whose
    #: inventory is its admin's, never reads it.
    machine: Described | None = None


class Claim(_Message):
    op: Literal["claim"]
    id: int
    need: Need
    label: str = Field(max_length=512)


#: How a kernel may say its claim ended, in its own words
#: (:data:`fluksio_nb.status.Ending`): the metrics count halts, timeouts and
#: cancels by these, and nothing else is taken.
KernelEnding = Literal[
    "ok",
    "error",
    "interrupted",
    "halted",
    "timed out",
    "died",
    "cancelled",
    "time limit",
    "idle cards",
]


class Release(_Message):
    """A claim given back; no reply, since nothing the kernel does next depends on one.

    ``ending`` is sent only to a service whose welcome said it hears one
    (``hears_endings``): an older service refuses a field it does not know.
    """

    op: Literal["release"]
    ticket: int
    ending: KernelEnding | None = None


class Cancel(_Message):
    op: Literal["cancel"]
    id: int
    ticket: int
    reason: str = Field(max_length=1024)


#: The most a percentage may say: a claim's CPU is summed over its cores.
MOST_PERCENT = 100.0 * (1 << 14)

_Bytes = Annotated[int, Field(ge=0, le=MOST_BYTES)]
_Percent = Annotated[float, Field(ge=0, le=MOST_PERCENT, allow_inf_nan=False)]
_Time = Annotated[float, Field(ge=0, le=LATEST_TIME, allow_inf_nan=False)]


class Readings(BaseModel):
    """What a running claim's kernel last read of it, shown to every user in each snapshot.

    Each figure is the reporting user's word, read by every other user's
    views: so each is of its type, finite and in range, or the report is
    refused. A figure this version does not know is dropped, never passed
    on unchecked; one that is not known is ``None``.
    """

    # Not strict: an int where a float is wanted is the same figure.
    model_config = ConfigDict(extra="ignore", frozen=True)

    rss_bytes: _Bytes | None = None
    peak_rss_bytes: _Bytes | None = None
    cpu_percent: _Percent | None = None
    processes: Annotated[int, Field(ge=0, le=1 << 22)] | None = None
    gpu_bytes: _Bytes | None = None
    peak_gpu_bytes: _Bytes | None = None
    gpu_percent: _Percent | None = None
    stopped_since: _Time | None = None
    at: _Time | None = None

    @model_validator(mode="before")
    @classmethod
    def _a_handful(cls, said: Any) -> Any:
        # Unknown figures are dropped, but not read without end: a handful at most.
        if isinstance(said, dict) and len(said) > 32:
            raise ValueError("more than 32 readings")
        return said


def trusted_readings(said: Any) -> dict[str, Any] | None:
    """A claim's readings as a view may show them, whoever wrote them; ``None`` if they are not.

    For readers of books that did not validate them (an older service, a
    a copy written by hand): a view shows no figure rather than fail on one.
    """
    if not isinstance(said, dict):
        return None
    try:
        return Readings.model_validate(said).model_dump()
    except ValidationError:
        return None


class Report(_Message):
    """A running claim's latest readings; no reply."""

    op: Literal["report"]
    ticket: int
    # Shown to every user in each snapshot: a handful of short figures, each checked.
    readings: Readings


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
    """A claim this kernel was running when its connection to the service broke.

    Put back only if the service that granted it wrote down this very share
    as this user's claim ``ticket``, granted with ``secret``: whoever else
    read the share from a snapshot knows neither. Optional only so that an
    older kernel is told why, rather than cut off.
    """

    op: Literal["restore"]
    id: int
    label: str = Field(max_length=512)
    cpus: int = Field(ge=1, le=1 << 20)
    gpus: list[int] = Field(max_length=1 << 12)
    ram_bytes: int = Field(ge=0, le=1 << 62)
    cores: list[int] = Field(default_factory=list, max_length=1 << 20)
    #: The card memory of a slice it held of its one card; 0 for whole cards.
    gpu_bytes: int = Field(default=0, ge=0, le=1 << 50)
    ticket: int | None = None
    secret: str | None = Field(default=None, max_length=128)


class Processes(_Message):
    """Processes a running claim's kernel started for it; no reply.

    What the service kills when an admin's cancel is not carried out by the
    kernel, and only those of them it finds are the owner's, below the
    kernel (:mod:`.revoke`). Never shown to anyone.
    """

    op: Literal["processes"]
    ticket: int
    pids: list[Annotated[int, Field(ge=2, le=1 << 22)]] = Field(max_length=64)


class News(_Message):
    """Answered once everything the service sent this connection before it is sent.

    A kernel whose worker died asks it, to have heard a stop the service may
    have sent before it killed the worker, and so say who stopped it.
    """

    op: Literal["news"]
    id: int


Request = Annotated[
    Claim | Release | Cancel | Report | Snapshot | KernelDeaths | Restore | Processes | News,
    Field(discriminator="op"),
]
read_hello = TypeAdapter(Hello).validate_json
read_request = TypeAdapter(Request).validate_json


def line(message: dict[str, Any]) -> bytes:
    """One message as the line that goes over the socket."""
    import json

    return json.dumps(message, separators=(",", ":")).encode() + b"\n"
