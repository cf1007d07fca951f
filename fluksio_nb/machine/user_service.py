"""A user's own books: the machine's books service, run as the user, for their kernels alone.

Where nobody set up books for every user (``fluksio-nb machine init``), one
user's kernels must still share one set of books: two notebooks each
granting "GPU 0" is the deadlock fluksio_nb exists to prevent. They are kept
by the same service as the machine's (:mod:`.service`), run as the user, in
a directory of theirs alone (:mod:`.user_dir`): one queue, one set of rules
and one protocol, whoever's books they are.

What it decides:

- **The first kernel that needs it starts it** (:meth:`UserServiceAt.reach`),
  and the others find it answering. A kernel that finds none takes the
  directory's start lock (a file of the user's, in a directory of theirs
  alone: nobody else can hold it), looks again, and only then starts one, so
  two kernels starting at once start one service. The service holds a lock
  of its own while it runs, so one started all the same waits for the one
  before it to go, rather than answer beside it.
- **It lives while kernels do**: it ends ``books_linger`` seconds after its
  last kernel's connection closed, and the next kernel starts it again.
  Only kernels count (a hello's ``lifeline``): the server reads the books
  every second and must keep nothing alive. A view never starts a service:
  with none running, nothing is claimed, and the machine is shown as found.
- **It keeps one description of the machine**, the one the kernel that
  started it declared. A kernel declaring another (a notebook with
  ``FLUKSIO_GPUS=2`` beside one on defaults) is refused at its hello, told
  what differs and which settings said so. With no kernel connected, a
  newcomer's description is taken instead: a kernel restarted with a new
  setting means it.
- **A killed kernel's claims are recorded** (ending ``kernel died``) in the
  user's own usage records, by the service, which saw its connection close:
  the kernel could not, and nobody else knows when.
- **Its restarts lose nothing**: it keeps its state as the machine's service
  does (:mod:`.state`), in the directory, so a service killed while claims
  ran is followed by one their kernels put them back in.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ByteSize

from fluksio_nb.errors import ServiceUnavailable
from fluksio_nb.inventory import Inventory
from fluksio_nb.machine.books import MachineBooks
from fluksio_nb.machine.connection import ServiceAt, connect, hello
from fluksio_nb.machine.protocol import Described
from fluksio_nb.machine.run_dir import SOCKET_NAME
from fluksio_nb.machine.service import BooksService, Connection
from fluksio_nb.machine.service import serve as serve_on
from fluksio_nb.machine.state import ServiceState
from fluksio_nb.machine.user_dir import open_directory, untrusted_file
from fluksio_nb.records import KERNEL_DIED, UsageRecord, default_usage_dir, process_log
from fluksio_nb.settings import ENV_VARS, Settings
from fluksio_nb.stop_button import open_whole, stop_held_back

log = logging.getLogger("fluksio_nb.machine")

#: Held by whichever kernel is starting the service, for as long as that takes.
START_LOCK = "start.lock"
#: Held by the service for as long as it runs; it says its pid.
SERVICE_LOCK = "service.lock"
#: What the service says as it runs, for whoever wonders why it does not answer.
LOG_NAME = "service.log"
#: Its state across its own restarts (:mod:`.state`).
CLAIMS_NAME = "claims.json"
TICKETS_NAME = "tickets.json"
#: How long a kernel waits for the service it started to answer: a Python
#: starting on a machine whose every core is busy.
START_WITHIN_S = 30.0
#: The settings that shape the machine a kernel describes.
SHAPING = ("cpus", "gpus", "ram", "reserve_cpus", "pin_cores")
#: Each part of a description, as a person reads it, the settings behind it,
#: and what else decides it where no setting does.
PARTS = {
    "cpus": ("claimable cpus", ("cpus", "reserve_cpus"), "the cores each kernel may run on"),
    "gpu_ids": ("cards", ("gpus",), "CUDA_VISIBLE_DEVICES, or the cards each kernel finds"),
    "ram_bytes": ("claimable RAM", ("ram",), "the memory each kernel's cgroup allows"),
    "core_ids": (
        "cores",
        ("cpus", "reserve_cpus", "pin_cores"),
        "the cores each kernel may run on",
    ),
    "core_nodes": ("NUMA nodes of the cores", (), "the cores each kernel may run on"),
}


def described(inventory: Inventory, settings: Settings) -> dict[str, Any]:
    """The machine as this kernel declares it, and the settings that said so."""
    said = {
        ENV_VARS[key]: str(getattr(settings, key))
        for key in SHAPING
        if key in settings.model_fields_set
    }
    return {**inventory.for_books(), "settings": said}


@dataclass(frozen=True)
class UserServiceAt(ServiceAt):
    """The user's own service in a directory of theirs: started by the first kernel to reach it."""

    #: What this kernel declares the machine to be; the service keeps one.
    machine: dict[str, Any] = field(default_factory=dict)
    #: How long a service this kernel starts stays after the last kernel left.
    linger: float = 60.0

    @property
    def directory(self) -> Path:
        return self.socket.parent

    def hello(self, share_labels: bool) -> dict[str, Any]:
        return hello(share_labels, lifeline=True, machine=self.machine)

    def not_answering(self, why: str) -> str:
        return (
            f"your own books service in {self.directory} does not answer ({why}); "
            f"{self.directory / LOG_NAME} says why, and the next claim starts it again"
        )

    def reach(self) -> socket.socket:
        """A connection to the service, which is started first if none answers."""
        with contextlib.suppress(ServiceUnavailable):
            return connect(self.socket, 0, self.owner)
        directory = open_directory(self.directory)
        try:
            lock = _own_file(directory, self.directory, START_LOCK)
            try:
                # Held by another kernel of this user only while it starts one.
                fcntl.flock(lock, fcntl.LOCK_EX)
                with contextlib.suppress(ServiceUnavailable):
                    return connect(self.socket, 0, self.owner)
                return self._start(directory)
            finally:
                os.close(lock)
        finally:
            os.close(directory)

    def _start(self, directory: int) -> socket.socket:
        said = _own_file(directory, self.directory, LOG_NAME, append=True)
        # Closed by the service once it answers, or by its end: whichever comes first.
        pipe: tuple[int, ...] = ()
        try:
            with stop_held_back():
                pipe = os.pipe()
        except BaseException:
            for fd in (said, *pipe):
                os.close(fd)
            raise
        answering, told = pipe
        try:
            command = [
                sys.executable,
                # The notebook's directory first on the path could shadow anything.
                "-P",
                "-m",
                "fluksio_nb",
                "machine",
                "serve",
                "--books",
                str(self.directory),
                "--linger",
                repr(self.linger),
                "--described",
                json.dumps(self.machine),
                "--ready-fd",
                str(told),
            ]
            # Started through a shell that leaves it behind, so that it is
            # nobody's child: no kernel has to reap it, and none counts it as
            # its own. In a session of its own: the stop button is not its.
            subprocess.run(
                ["/bin/sh", "-c", '"$@" &', "sh", *command],
                cwd=self.directory,
                stdin=subprocess.DEVNULL,
                stdout=said,
                stderr=said,
                pass_fds=(told,),
                start_new_session=True,
                check=True,
            )
        finally:
            os.close(said)
            os.close(told)
        try:
            ready, _, _ = select.select([answering], [], [], START_WITHIN_S)
        finally:
            os.close(answering)
        with contextlib.suppress(ServiceUnavailable):
            return connect(self.socket, 0, self.owner)
        if not ready:
            raise ServiceUnavailable(
                f"your own books service in {self.directory} did not answer within "
                f"{START_WITHIN_S:g} s of starting: {_last_words(self.directory)}"
            )
        raise ServiceUnavailable(
            f"your own books service in {self.directory} ended as it started: "
            f"{_last_words(self.directory)}"
        )


def _own_file(directory: int, where: Path, name: str, *, append: bool = False) -> int:
    """A file of this user's alone in the checked ``directory``, made if missing; never a link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = open_whole(name, flags | (os.O_APPEND if append else 0), 0o600, dir_fd=directory)
    try:
        wrong = untrusted_file(where / name, os.fstat(fd))
        if wrong is not None:
            raise ServiceUnavailable(f"{where / name} {wrong}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _last_words(directory: Path, most: int = 2000) -> str:
    """The end of the service's log, for a kernel whose service would not start."""
    try:
        with open(directory / LOG_NAME, "rb") as said:
            said.seek(0, os.SEEK_END)
            said.seek(max(0, said.tell() - most))
            text = said.read().decode(errors="replace").strip()
    except OSError as error:
        return f"its log cannot be read ({error.strerror})"
    return text.splitlines()[-1] if text else "its log says nothing"


def running(path: Path) -> str:
    """Whether the user's own service at ``path`` runs now, said for ``machine status``."""
    try:
        connect(path, 0, os.geteuid()).close()
    except (ServiceUnavailable, OSError):
        return (
            "no books service of yours runs now: the first kernel that claims starts one, "
            "and it ends a while after your last kernel does"
        )
    holder = _read_text(path.parent / SERVICE_LOCK)
    return f"your books service (pid {holder or 'unknown'}) answers at {path}"


def _read_text(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 64).decode(errors="replace").strip()
    finally:
        os.close(fd)


# -- the service's side -----------------------------------------------------------


def differences(theirs: dict[str, Any], mine: dict[str, Any]) -> str:
    """Where two descriptions of the machine differ, and the settings behind each part.

    "cards [0, 1] there, none here (FLUKSIO_GPUS is 2 there, unset here)".
    """

    def said(key: str, value: Any) -> str:
        if key == "ram_bytes":
            return ByteSize(value).human_readable(decimal=True)
        if isinstance(value, dict):
            return str(dict(sorted(value.items()))) if value else "none"
        if isinstance(value, list):
            return str(sorted(value)) if value else "none"
        return str(value)

    parts = []
    for key, (name, behind, otherwise) in PARTS.items():
        if theirs.get(key) == mine.get(key):
            continue
        part = f"{name} {said(key, theirs.get(key))} there, {said(key, mine.get(key))} here"
        there, here = theirs.get("settings", {}), mine.get("settings", {})
        differ = [
            f"{var} is {there.get(var, 'unset')} there, {here.get(var, 'unset')} here"
            for var in (ENV_VARS[setting] for setting in behind)
            if there.get(var) != here.get(var)
        ]
        parts.append(part + f" ({'; '.join(differ) if differ else f'detected: {otherwise}'})")
    return "; ".join(parts)


class UserBooksService(BooksService):
    """The books service for one user's kernels: one description, and an end once they left."""

    def __init__(
        self,
        directory: Path,
        machine: dict[str, Any],
        linger: float,
        numbers: Iterator[int],
        **kept: Any,
    ) -> None:
        super().__init__(books_over(machine, numbers), **kept)
        self.directory, self.machine, self.linger = directory, machine, linger
        #: The kernels connected now: what keeps the service.
        self.lifelines: set[Connection] = set()
        #: Counts the moments the last kernel left, so that only the latest ends it.
        self._emptied = 0

    def arrived(self, connection: Connection) -> None:
        if connection.uid != os.geteuid():
            # Its directory is this user's alone, so another user reaches it
            # only through a socket passed on to them: turned away all the same.
            connection.turned_away = True
            connection.refuse("this books service keeps one user's books, not yours")
            return
        super().arrived(connection)

    def refuses(self, connection: Connection) -> str | None:
        hello = connection.hello
        assert hello is not None
        if not hello.lifeline:
            return None
        declared = None if hello.machine is None else hello.machine.model_dump()
        if declared is not None and _books_part(declared) != _books_part(self.machine):
            if self.lifelines or self.books.entries:
                return (
                    "this kernel describes another machine than the one your other kernels "
                    f"keep their books over, in {self.directory}: "
                    f"{differences(self.machine, declared)}. All of one user's kernels share "
                    "one set of books: start this kernel with the same settings as the "
                    "others, or restart them all with the new ones, or give this kernel "
                    "books of its own with FLUKSIO_LEDGER=kernel."
                )
            log.info("the books are kept over a new description, as no kernel is connected")
            self.machine = declared
            self.books = books_over(declared, self.books.numbers)
        self.lifelines.add(connection)
        return None

    def left(self, connection: Connection) -> None:
        super().left(connection)
        if connection in self.lifelines:
            self.lifelines.discard(connection)
            if not self.lifelines:
                self.alone()

    def alone(self) -> None:
        """No kernel is connected: the service ends after ``linger`` s unless one comes.

        Also as it starts: the kernel that started it may be gone before it connects.
        """
        self._emptied += 1
        asyncio.get_running_loop().call_later(self.linger, self._end, self._emptied)

    def _end(self, emptied: int) -> None:
        """End, if no kernel came since the last one left.

        A connection that has not said hello yet may be a kernel, slow to
        say so on a busy machine: the service waits another ``linger`` for it.
        """
        if self.lifelines or emptied != self._emptied or self.stop is None:
            return
        if any(connection.hello is None for connection in self.connections):
            self.alone()
            return
        log.info("no kernel for %g s: the service ends", self.linger)
        self.stop.set()


def books_over(machine: dict[str, Any], numbers: Iterator[int]) -> MachineBooks:
    """Empty books over the machine a kernel described, numbering claims from ``numbers``."""
    return MachineBooks(
        machine["cpus"],
        tuple(machine["gpu_ids"]),
        machine["ram_bytes"],
        core_ids=tuple(machine["core_ids"]),
        core_nodes={int(core): node for core, node in machine["core_nodes"].items()},
        numbers=numbers,
    )


def _books_part(description: dict[str, Any]) -> dict[str, Any]:
    return {key: description.get(key) for key in PARTS}


class KilledKernelsLog:
    """The user's own records of claims whose kernel was killed: a living kernel writes its own."""

    def write(self, record: UsageRecord) -> None:
        if record.ending != KERNEL_DIED:
            return
        # The user's own file: whose it is, its owner says, not the record.
        record = record.model_copy(update={"uid": None, "by_service": None})
        process_log(default_usage_dir(), create=True).write(record)


def serve(
    directory: Path, machine: dict[str, Any], linger: float, ready_fd: int | None = None
) -> None:
    """Run the user's books service in ``directory`` until no kernel used it for ``linger`` s."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    Described.model_validate(machine)
    fd = open_directory(directory)
    lock = _own_file(fd, directory, SERVICE_LOCK)
    # A service on its way out lets go in a moment; one that holds on is said.
    deadline = time.monotonic() + START_WITHIN_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                holder = os.pread(lock, 32, 0).decode(errors="replace").strip()
                log.error(
                    "another books service (pid %s) holds %s and does not answer; "
                    "end it (`kill %s`) and the next claim starts a new one",
                    holder,
                    directory,
                    holder,
                )
                raise SystemExit(1) from None
            time.sleep(0.05)
    os.ftruncate(lock, 0)
    os.pwrite(lock, str(os.getpid()).encode(), 0)
    # Every kernel of the user holds a connection: as many as the user may open.
    _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    state = ServiceState(directory / CLAIMS_NAME, directory / TICKETS_NAME)
    service = UserBooksService(
        directory,
        machine,
        linger,
        state.ticket_numbers(),
        state=state,
        accounts=KilledKernelsLog(),
    )
    # Reached through the checked directory's descriptor: however deep it is,
    # the address fits in a socket's, and nobody can swap the directory.
    socket_path = Path(f"/proc/self/fd/{fd}/{SOCKET_NAME}")

    def ready(_: Any) -> None:
        os.chmod(socket_path, 0o600)
        service.alone()
        if ready_fd is not None:
            # The kernel that started it connects now.
            os.close(ready_fd)

    log.info("the books service of uid %d answers in %s", os.geteuid(), directory)
    asyncio.run(serve_on(socket_path, service, ready))
    log.info("the books service of uid %d in %s ended", os.geteuid(), directory)
