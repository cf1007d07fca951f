"""What the books service keeps across its own restarts: whose each running claim is, and
which ticket numbers it has given out.

A restart (an admin's ``machine init``, a crash) closes every connection,
and the kernels that held shares put them back (:mod:`.put_back`). Without a
record of who held what, the service could only take each restore at its
word, and any user who read another's card and cores from a snapshot could
"put back" that share first. So the service writes down, for each running
claim, its number, its owner's uid, what it holds, and a digest of a secret
only the owner's kernel was given with the grant; after a restart a share is
put back only against a record it matches in every part.

And a ticket number an admin read before a restart must not name someone
else's claim after it: the numbers given out are reserved ahead, in blocks,
in a file that outlives the service (and a reboot), so a new service starts
past every number any earlier one may have used.

Both files are the service's user's alone (mode 0600), in directories of
theirs alone: root's for the machine's service, the user's for their own
(:mod:`.user_service`). Each
is written to a new file and renamed into place, so a crash leaves the old
one or the new one whole, and neither is ever opened through a link. What
is read back is validated as strictly as a request from a stranger: a file
that does not parse is a warning in the log and counts as nothing, never a
crash.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from fluksio_nb.machine.books import Entry

log = logging.getLogger("fluksio_nb.machine")

#: How many ticket numbers are reserved at a time: the file that says so is
#: written, and flushed to disk, once per this many claims, not per claim.
TICKETS_RESERVED = 1000
#: The longest state file read back: thousands of claims are a few hundred KB.
MOST_STATE_BYTES = 16 << 20


def new_secret() -> str:
    """A secret for one grant, which only its owner's kernel is told."""
    return secrets.token_hex(16)


def digest(secret: str) -> str:
    """What is written down of a secret: the file never holds one that works."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str | None, recorded: str) -> bool:
    """Whether ``secret`` is the one whose digest was recorded, in constant time."""
    return secret is not None and hmac.compare_digest(digest(secret), recorded)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class HeldClaim(_Strict):
    """A running claim as the service wrote it down: whose, and exactly what it holds."""

    ticket: int = Field(ge=1)
    uid: int = Field(ge=0, le=(1 << 32) - 1)
    secret_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    label: str = Field(max_length=512)
    cpus: int = Field(ge=1, le=1 << 20)
    gpus: list[int] = Field(max_length=1 << 12)
    ram_bytes: int = Field(ge=0, le=1 << 62)
    cores: list[int] = Field(max_length=1 << 20)
    #: When it was granted (``time.time()``), which its time limit counts
    #: from; ``None`` in what a service before this field wrote.
    granted_at: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    #: The card memory of its slice of its one card; 0 for cards held whole.
    gpu_bytes: int = Field(default=0, ge=0, le=1 << 50)

    def holds(
        self, cpus: int, gpus: list[int], ram_bytes: int, cores: list[int], gpu_bytes: int = 0
    ) -> bool:
        mine = (self.cpus, sorted(self.gpus), self.ram_bytes, sorted(self.cores), self.gpu_bytes)
        return mine == (cpus, sorted(gpus), ram_bytes, sorted(cores), gpu_bytes)


class HeldClaims(_Strict):
    claims: list[HeldClaim] = Field(default_factory=list)


class Tickets(_Strict):
    """Every number below ``next`` may have been given out already."""

    next: int = Field(ge=1)


class ServiceState:
    """The service's two files: the claims held now, and the ticket numbers reserved."""

    def __init__(self, claims: Path, tickets: Path) -> None:
        self.claims_path, self.tickets_path = claims, tickets

    # -- claims ---------------------------------------------------------------------

    def held_before(self) -> dict[int, HeldClaim]:
        """The claims the service that ran before this one wrote down, by ticket."""
        text = _read_own_only(self.claims_path)
        if text is None:
            return {}
        try:
            held = HeldClaims.model_validate_json(text)
        except ValidationError as error:
            log.warning(
                "%s does not hold the claims of a books service, so no claim can be put "
                "back after this restart: %s",
                self.claims_path,
                error,
            )
            return {}
        return {claim.ticket: claim for claim in held.claims}

    def write_held(self, running: Iterable[Entry]) -> None:
        """The running claims now; never raises: a failed write is a warning in the log."""
        claims = [
            HeldClaim(
                ticket=e.number,
                uid=e.uid,
                secret_sha256=e.secret_sha256,
                label=e.label,
                cpus=e.need[0],
                gpus=list(e.gpus),
                ram_bytes=e.need[2],
                cores=list(e.cores),
                granted_at=e.granted_at,
                gpu_bytes=e.gpu_bytes,
            )
            for e in running
            if e.secret_sha256 is not None
        ]
        try:
            _write_own_only(self.claims_path, HeldClaims(claims=claims).model_dump_json())
        except OSError as error:
            log.warning("the claims held were not written to %s: %s", self.claims_path, error)

    # -- ticket numbers -------------------------------------------------------------

    def ticket_numbers(self) -> Iterator[int]:
        """Numbers no service on this machine gave out before, reserved a block at a time."""
        number = self._first_number()
        while True:
            reserved = number + TICKETS_RESERVED
            try:
                _write_own_only(
                    self.tickets_path, Tickets(next=reserved).model_dump_json(), flush=True
                )
            except OSError as error:
                # Claims go on: a number that may repeat after a restart is
                # better than no claims at all. Said, so that an admin knows.
                log.warning(
                    "ticket numbers reserved up to %d were not written to %s (%s): after a "
                    "restart the service may give out numbers it gave out before",
                    reserved,
                    self.tickets_path,
                    error,
                )
            while number < reserved:
                yield number
                number += 1

    def _first_number(self) -> int:
        text = _read_own_only(self.tickets_path)
        if text is None and not self.tickets_path.exists():
            return 1
        try:
            return Tickets.model_validate_json(text or "").next
        except ValidationError as error:
            # Past any count a machine reaches: a claim a second for 50 years
            # is 1.6e9, and time only grows, so a later fallback is past this one.
            floor = int(time.time())
            log.warning(
                "%s does not say which ticket numbers were given out (%s); starting from %d",
                self.tickets_path,
                error,
                floor,
            )
            return floor


def _open_own_dir(directory: Path) -> int:
    """``directory``, opened without following a link, if the service's user's and nobody else's.

    Root's, for the machine's service; a user's own service keeps its state
    in that user's books directory.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        fix = (
            "run `fluksio-nb machine init` again to make it so"
            if os.geteuid() == 0
            else f"`chmod go-w {directory}` makes it so"
        )
        raise PermissionError(
            f"{directory} is not uid {os.geteuid()}'s alone (uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):o}); {fix}"
        )
    return fd


def _read_own_only(path: Path) -> str | None:
    """The text of the service's private file ``path``; ``None`` if absent or not that."""
    try:
        directory = _open_own_dir(path.parent)
    except OSError:
        return None
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
    except OSError:
        return None
    finally:
        os.close(directory)
    with open(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            log.warning("%s is not the service's private file; it is not read", path)
            return None
        return file.read(MOST_STATE_BYTES).decode(errors="replace")


def _write_own_only(path: Path, text: str, *, flush: bool = False) -> None:
    """Replace ``path`` with ``text`` whole, mode 0600, never through a link."""
    directory = _open_own_dir(path.parent)
    staged = f".{path.name}.{os.getpid()}.new"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged, dir_fd=directory)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(staged, flags, 0o600, dir_fd=directory)
        with open(fd, "wb") as file:
            file.write(text.encode())
            if flush:
                file.flush()
                os.fsync(file.fileno())
        # A rename replaces a link at the name; it never writes where one points.
        os.replace(staged, path.name, src_dir_fd=directory, dst_dir_fd=directory)
        if flush:
            os.fsync(directory)
    finally:
        os.close(directory)
