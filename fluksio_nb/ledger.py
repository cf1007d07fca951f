"""One user's books, shared by every kernel of theirs on this machine.

A queue inside one kernel stops one notebook from oversubscribing the
machine. The real damage comes from several notebooks of one user on a
workstation or JupyterHub node, each sure it owns the machine: two kernels
that each grant "GPU 0" to a cell of their own are the deadlock this project
exists to prevent. So by default every kernel of a user keeps its books in
one file, and every grant is a transaction on that file. Books shared by
several Unix users are not kept here: a file that two users can write is a
file either of them can forge, so those are kept by a service of their own
(:mod:`fluksio_nb.machine`).

What it trusts, and what it refuses:

- **Only a directory its owner alone can write.** The directory is opened
  once, without following a symlink, and checked on the open descriptor: it
  must belong to this process's user and be writable by nobody else. A
  directory that fails is refused with :class:`UnsafeLedgerDir`, saying how
  to fix it, and never chmod-ed into shape: the directory somebody chose
  (``FLUKSIO_LEDGER``) may be theirs to share, like ``/tmp``, and quietly
  taking its sticky bit away is worse than refusing. Only a directory it
  creates itself does it make (0700).
- **Only files it reached through that directory.** Every file is opened
  relative to the checked descriptor, never following a symlink, and used
  only if it is a regular file of this user's that nobody else can write and
  that has no other name. Swapping the directory or planting a link after the
  check therefore changes nothing the ledger touches. Its files are 0600.
- **Who a kernel is comes from the OS.** An entry records the process's
  effective uid and that uid's name, not ``$USER``, which anyone can set.
- **Every entry is checked, none is believed.** Entries are validated
  (:class:`LedgerEntry`) on every read; one that does not validate, or a running
  one holding a card the machine lacks, a card another claim holds, or more
  than is left, is dropped with a :class:`LedgerBroken` warning saying why.
  Nothing read from the file can raise out of a transaction, and the books
  never show less than nothing free.

What it decides:

- **A file and a lock, no daemon.** The state is one small JSON document,
  rewritten under an exclusive ``flock`` on a separate lock file. That gives
  real transactions across processes with less code than SQLite, and readers
  take the lock shared, so they never see half a document.
- **Nothing stored that can drift.** What is free is worked out from the
  inventory and the running claims on every transaction, never kept as a
  counter, so a crash in the middle of anything cannot unbalance the books.
- **FIFO by ticket, machine-wide.** Tickets are numbered by the ledger, and
  the same rule as the kernel's own queue (:func:`~fluksio_nb.queue.who_goes_next`)
  decides who goes next, whichever kernel asked.
- **The dead give their share back.** Every entry records its kernel's pid and
  that process's start time; a transaction that finds the pid gone, or
  reused by a younger process, drops the entry. A kernel killed with SIGKILL,
  by the OOM killer or by a reboot cannot say goodbye, and need not.
- **Waiters sleep.** Each waiting claim listens on a Unix datagram socket
  whose address is in its entry. Whoever grants it (a release, a cancel, a
  kernel noticing a dead one) sends a byte there, so capacity freed in one
  kernel reaches a waiter in another within a millisecond or two. A waiter
  also wakes every half second, to notice holders that died silently.
- **A broken file is rebuilt, never fatal.** A truncated or corrupted
  document is copied aside with a warning and started afresh; this kernel's
  own claims are written back into it, and other kernels put back theirs
  the next time they look (their running claims check their entries every
  half second).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fluksio_nb.books import Allocation, ResourceAccountant, pick_cores
from fluksio_nb.errors import BadSettings, ClaimCancelled, ClaimTimeout, NotYours
from fluksio_nb.identity import user_name
from fluksio_nb.inventory import Inventory, take_inventory
from fluksio_nb.queue import Ticket, books_changing, fit_to_capacity, timeout_message, who_goes_next
from fluksio_nb.resources import Resources, explain
from fluksio_nb.settings import Settings, load_settings

LEDGER_FILE = "ledger.json"
LOCK_FILE = "ledger.lock"
VERSION = 1

#: How often a waiter or a running claim looks at the ledger when nobody wakes
#: it: the bound on how long a silently dead holder keeps its share.
LOOK_EVERY_S = 0.5

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_MODE = 0o600

#: How to fix a ledger directory that is not this user's alone.
_WAY_OUT = (
    "point FLUKSIO_LEDGER at a directory of your own; books shared by several users "
    "are set up with `fluksio-nb machine init`"
)


class LedgerBroken(UserWarning):
    """The ledger file, or an entry in it, could not be used and was left out."""


class UnsafeLedgerDir(BadSettings):
    """The ledger's directory, or a file in it, is not this user's alone.

    Raised rather than repaired: the books are only as good as the guarantee
    that nobody else can write them, and the directory may be someone's to share.
    """


def default_ledger_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "fluksio"


def _who(uid: int) -> str:
    return f"uid {uid} ({user_name(uid)})"


def _open_directory(directory: Path) -> int:
    """The ledger's directory, opened and checked: made (0700) if missing, never changed."""
    try:
        fd = os.open(directory, _OPEN_DIR)
    except FileNotFoundError:
        try:
            os.makedirs(directory.parent, exist_ok=True)
            # Made by someone else in the meantime: checked below like any other.
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
            fd = os.open(directory, _OPEN_DIR)
        except OSError as error:
            raise _unusable_directory(directory, error) from None
    except OSError as error:
        raise _unusable_directory(directory, error) from None
    try:
        found = os.fstat(fd)
        if found.st_uid != os.geteuid():
            raise UnsafeLedgerDir(
                f"fluksio_nb's ledger directory {directory} belongs to {_who(found.st_uid)}, "
                f"not to this user ({_who(os.geteuid())}): whoever owns it can rewrite the "
                f"books of every kernel kept there. To fix it, {_WAY_OUT}."
            )
        if found.st_mode & 0o022:
            raise UnsafeLedgerDir(_writable_by_others(directory, found.st_mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _writable_by_others(directory: Path, mode: int) -> str:
    said = (
        f"fluksio_nb's ledger directory {directory} can be written by other users "
        f"(mode {stat.S_IMODE(mode):o}): any of them could rewrite these books, or leave "
        "links in it for this user's kernels to follow."
    )
    if mode & stat.S_ISVTX:
        # A sticky, world-writable directory is somebody's shared scratch
        # space, such as /tmp: telling them to chmod it would break it.
        own = directory / f"fluksio-{user_name(os.geteuid())}"
        return (
            f"{said} It is a shared scratch directory, such as /tmp: keep the books in a "
            f"directory of your own instead, such as {own}, by pointing FLUKSIO_LEDGER "
            "there; books shared by several users are set up with `fluksio-nb machine init`."
        )
    return f"{said} Fix it with `chmod go-w {directory}`, or {_WAY_OUT}."


def _unusable_directory(directory: Path, error: OSError) -> BadSettings:
    if error.errno in (errno.ELOOP, errno.ENOTDIR) and directory.is_symlink():
        # O_NOFOLLOW on a symlink fails with ELOOP, or ENOTDIR with O_DIRECTORY.
        return UnsafeLedgerDir(
            f"fluksio_nb's ledger directory {directory} is a symbolic link, which is "
            "not followed: whoever can change the link decides where the books go. "
            f"Point FLUKSIO_LEDGER at the directory itself, or {_WAY_OUT}."
        )
    return BadSettings(
        f"fluksio_nb's ledger directory {directory} cannot be used: "
        f"{error.strerror or error}. To fix it, {_WAY_OUT}."
    )


def _untrusted_file(path: Path, found: os.stat_result) -> str | None:
    """What is wrong with a file in the ledger's directory, and its fix; None if nothing."""
    remove = f"remove it (`rm {path}`)"
    if not stat.S_ISREG(found.st_mode):
        return f"is not a regular file. Fix it: {remove}"
    if found.st_uid != os.geteuid():
        return f"belongs to {_who(found.st_uid)}. Fix it: {remove}"
    if found.st_mode & 0o022:
        mode = stat.S_IMODE(found.st_mode)
        return f"can be written by other users (mode {mode:o}). Fix it: `chmod go-w {path}`"
    if found.st_nlink != 1:
        # Its other name may be somewhere the books must never write.
        return f"has {found.st_nlink} names (hard links). Fix it: {remove}"
    return None


def process_started(pid: int) -> float | None:
    """When a process started, or ``None`` if there is no such process.

    A zombie is no such process: it holds nothing and runs nothing, and a
    kernel killed under a server that has not reaped it yet is one.
    """
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.Error:
        return None


#: How long a holder found alive is taken to still be alive without looking
#: again. Every transaction checks every entry's owner, and reading /proc for
#: each of them was most of a transaction's time under contention; a dead
#: holder is still noticed within the half second the issue allows it.
_ALIVE_FOR_S = 0.25
_seen_alive: dict[tuple[int, float], float] = {}


def _owner_alive(owner: dict[str, Any]) -> bool:
    key = (owner["pid"], owner["started"])
    now = time.monotonic()
    if now - _seen_alive.get(key, -_ALIVE_FOR_S) < _ALIVE_FOR_S:
        return True
    started = process_started(owner["pid"])
    # A pid reused by a younger process is not the holder come back to life.
    alive = started is not None and abs(started - owner["started"]) < 1.0
    if alive:
        _seen_alive[key] = now
    else:
        _seen_alive.pop(key, None)
    return alive


# -- what a document may say ---------------------------------------------------


class _Checked(BaseModel):
    # Strict: "2" where a count belongs is not something this module wrote,
    # and guessing what it meant is how the books stop balancing. Fields it
    # does not know are allowed: a later version may add some. Entries are
    # only checked against these models; the document keeps the dicts it was
    # read as, so nothing is lost on the way back to the file.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


Count = Annotated[int, Field(ge=0)]


class Asked(_Checked):
    """What a claim asked for."""

    cpus: Count
    gpus: Count
    ram_bytes: Count


class Held(_Checked):
    """What a running claim was granted: which cards and cores, not how many."""

    cpus: Count
    gpus: list[Count]
    ram_bytes: Count
    cores: list[Count] = Field(default_factory=list)


class Owner(_Checked):
    """The kernel that made a claim: its process, and whose it is."""

    pid: int = Field(gt=0)
    started: float
    kernel_id: str | None = None
    notebook: str | None = None
    user: str | None = None
    uid: Count | None = None


class LedgerEntry(_Checked):
    """One claim as the ledger records it."""

    number: int = Field(ge=1)
    state: Literal["waiting", "running", "cancelled"]
    label: str
    asked: Asked
    allocation: Held | None = None
    owner: Owner
    since: float
    granted_at: float | None = None
    # Only ever one of this module's own sockets in the abstract namespace:
    # an address read from the file is never a path to write to.
    wake: str | None = Field(default=None, pattern=r"^\x00fluksio-")
    cancel: str | None = None
    readings: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _running_says_what_it_holds(self) -> LedgerEntry:
        if self.state == "running" and (self.allocation is None or self.granted_at is None):
            raise ValueError("a running claim must say what it holds and since when")
        return self


class _MachineInventory(_Checked):
    cpus: Count
    gpu_ids: list[Count]
    ram_bytes: Count
    core_ids: list[Count] = Field(default_factory=list)
    core_nodes: dict[str, Count] = Field(default_factory=dict)


class _Document(_Checked):
    version: Literal[1]
    next: int = Field(ge=1)
    tickets: list[Any]
    inventory: _MachineInventory


def _trusted(
    entries: Any, inventory: dict[str, Any], checked: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """The entries that can be believed, of live owners, and what was wrong with the rest.

    Running claims are counted against the inventory in ticket order, so when
    the books do not balance it is the later claim that is left out.
    ``checked`` says each entry was validated already, or made by this module:
    validating every entry was the dearest part of a transaction, and once
    per transaction is enough.
    """
    kept: list[dict[str, Any]] = []
    problems: list[str] = []
    if not isinstance(entries, list):
        return kept, ["the list of claims is not a list"]
    free_cpus, free_ram = inventory["cpus"], inventory["ram_bytes"]
    cards_here = set(inventory["gpu_ids"])
    free_cards = set(cards_here)
    free_cores = set(inventory.get("core_ids", ()))
    numbers: set[int] = set()
    for place, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict):
            problems.append(f"entry {place} is not an object")
            continue
        if not checked:
            try:
                LedgerEntry.model_validate(entry)
            except ValidationError as error:
                problems.append(f"entry {place}: {explain(error)}")
                continue
        number = entry["number"]
        if number in numbers:
            problems.append(f"claim {number} appears twice")
            continue
        numbers.add(number)
        if not _owner_alive(entry["owner"]):
            continue  # reaped, not broken
        if entry["state"] == "running":
            held = entry["allocation"]
            cards = held["gpus"]
            missing = sorted(set(cards) - cards_here)
            if missing:
                problems.append(f"claim {number} holds card(s) {missing}, not this machine's")
                continue
            if not set(cards) <= free_cards or len(set(cards)) != len(cards):
                problems.append(f"claim {number} holds card(s) {cards}, held already")
                continue
            cores = held.get("cores", [])
            if not set(cores) <= free_cores or len(set(cores)) != len(cores):
                problems.append(f"claim {number} holds core(s) {cores}, held already or not here")
                continue
            if held["cpus"] > free_cpus or held["ram_bytes"] > free_ram:
                problems.append(
                    f"claim {number} holds {held['cpus']} cpus and {held['ram_bytes']} bytes "
                    f"of RAM, more than was left ({free_cpus} cpus, {free_ram} bytes)"
                )
                continue
            free_cards -= set(cards)
            free_cores -= set(cores)
            free_cpus -= held["cpus"]
            free_ram -= held["ram_bytes"]
        kept.append(entry)
    return kept, problems


def _warn_left_out(where: Path | None, problems: list[str]) -> None:
    if problems:
        ledger = "the ledger" if where is None else f"the ledger {where}"
        warnings.warn(
            f"fluksio_nb: {ledger} had claims that cannot be trusted, and they were left "
            f"out: {'; '.join(problems)}",
            LedgerBroken,
            stacklevel=3,
        )


def _dump(state: dict[str, Any]) -> str:
    return json.dumps(state, separators=(",", ":"))


def _empty_state(inventory: dict[str, Any] | None) -> dict[str, Any]:
    inventory = inventory or {"cpus": 0, "gpu_ids": [], "ram_bytes": 0}
    return {"version": VERSION, "inventory": inventory, "next": 1, "tickets": []}


class LedgerFile:
    """The document and its lock: transactions, shared reads, and repair.

    The document is rewritten in place, under the lock, rather than written
    aside and renamed over: on ext4 a rename over an existing file flushes the
    new file to disk first, which measured 1.7 ms, most of a transaction. So
    readers take the lock too, shared, and never see half a document. A
    process that dies between writing and trimming the file leaves trailing
    bytes, which read as a broken document and are rebuilt like one.

    Raises :class:`UnsafeLedgerDir` when it is made, and when a file is first
    opened, if what it finds is not this user's alone.
    """

    def __init__(
        self, directory: Path, inventory: dict[str, Any] | None = None, shared: bool = False
    ):
        # ``shared`` is ignored: a ledger is one user's books, and books
        # several users share are the machine service's. It stays until the
        # callers that pass it are updated.
        del shared
        #: What this process says the machine has; ``None`` for a reader that
        #: takes the ledger's word for it (the server).
        self.inventory = inventory
        self.directory = Path(directory)
        self.path = self.directory / LEDGER_FILE
        self._lock_fd: int | None = None
        self._data_fd: int | None = None
        # Every file is opened relative to this descriptor, checked once: what
        # the path leads to later (a swapped directory, a new link) is never used.
        self._dir_fd: int | None = _open_directory(self.directory)
        self._thread_lock = threading.Lock()

    def close(self) -> None:
        """Let go of the directory and the files. The ledger cannot be used after."""
        for name in ("_data_fd", "_lock_fd", "_dir_fd"):
            fd = getattr(self, name, None)
            setattr(self, name, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __del__(self) -> None:
        # A server makes one of these per request: descriptors must not pile up.
        # At interpreter exit, what close() uses may be gone already.
        with contextlib.suppress(Exception):
            self.close()

    def has_document(self) -> bool:
        """Whether there is a document yet, without creating one or following a link."""
        try:
            os.stat(LEDGER_FILE, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def transaction(self) -> Iterator[dict[str, Any]]:
        """The document, locked against every other process, written back on success."""
        # The stop button waits for the lock like everyone, but never lands
        # between reading the document and writing it back.
        with self._thread_lock, self._locked(fcntl.LOCK_EX), books_changing():
            state, before = self._load_for_update()
            yield state
            after = _dump(state)
            if after != before:
                self._write(after)

    def read(self) -> dict[str, Any]:
        """The document as it stands; a missing or broken one reads as empty."""
        with self._thread_lock, self._locked(fcntl.LOCK_SH):
            # Outside the try: a file that is not ours is refused, not read as empty.
            fd = self._document()
            try:
                return self._parse(self._read_text(fd), self.inventory)
            except (OSError, ValueError):
                return _empty_state(self.inventory)

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        if self._lock_fd is None:
            self._lock_fd = self._open(LOCK_FILE)
        try:
            # Inside the try: a stop that lands as the lock is taken leaves it free.
            fcntl.flock(self._lock_fd, how)
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _open(self, name: str) -> int:
        """A file of the ledger's, made if missing, refused unless it is ours alone."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        path = self.directory / name
        try:
            fd = os.open(name, flags, _FILE_MODE, dir_fd=self._dir_fd)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            fd, wrong = None, f"is a symbolic link. Fix it: remove it (`rm {path}`)"
        else:
            wrong = _untrusted_file(path, os.fstat(fd))
        if wrong is not None:
            if fd is not None:
                os.close(fd)
            raise UnsafeLedgerDir(
                f"fluksio_nb's ledger file {path} is not used: the books are kept only in "
                f"files this user alone can change, and it {wrong}. A missing file is made "
                "afresh, and kernels write their claims back into it."
            )
        return fd

    def _document(self) -> int:
        """The document's descriptor, reopened if the file was removed or replaced."""
        fd = self._data_fd
        if fd is not None:
            try:
                current = os.stat(LEDGER_FILE, dir_fd=self._dir_fd, follow_symlinks=False)
                opened = os.fstat(fd)
                if (opened.st_ino, opened.st_dev) == (current.st_ino, current.st_dev):
                    return fd
            except FileNotFoundError:
                pass
            self._data_fd = None
            os.close(fd)
        self._data_fd = self._open(LEDGER_FILE)
        return self._data_fd

    @staticmethod
    def _read_text(fd: int) -> str:
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0).decode() if size else ""

    def _load_for_update(self) -> tuple[dict[str, Any], str]:
        """The document to change, and its text as read, to tell whether it changed."""
        try:
            text = self._read_text(self._document())
        except UnicodeDecodeError:
            text = "\0"  # not a ledger: rebuilt below
        if not text:
            return _empty_state(self.inventory), ""
        try:
            # The kernel that wrote the inventory last describes the machine: a
            # restarted kernel with a new FLUKSIO_* setting means it.
            return self._parse(text, self.inventory), text
        except ValueError as error:
            aside = f"{LEDGER_FILE}.broken-{int(time.time())}"
            kept = self._keep_aside(aside, text)
            warnings.warn(
                f"fluksio_nb: the ledger {self.path} could not be read ({error}); "
                f"{kept}, and it was started afresh. Claims running in other kernels "
                "are written back as those kernels next look.",
                LedgerBroken,
                stacklevel=4,
            )
            fresh = _empty_state(self.inventory)
            # Numbering restarts above anything the lost document can have
            # handed out, so a ticket other kernels still hold is never reissued.
            fresh["next"] = int(time.time())
            return fresh, text

    def _keep_aside(self, name: str, text: str) -> str:
        """A copy of a broken document, for whoever wants to know what broke it.

        Made only as a new file: whatever is already there under that name,
        a link above all, is left as it is. Returns what became of the copy.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, _FILE_MODE, dir_fd=self._dir_fd)
        except FileExistsError:
            return f"no copy was kept, since {name} is already there"
        except OSError as error:
            return f"no copy was kept ({error.strerror})"
        try:
            os.write(fd, text.encode(errors="replace"))
        except OSError as error:
            return f"the copy {name} is incomplete ({error.strerror})"
        finally:
            os.close(fd)
        return f"a copy was kept as {name}"

    def _parse(self, text: str, inventory: dict[str, Any] | None) -> dict[str, Any]:
        """The document, with what cannot be trusted left out. ValueError if it is no ledger."""
        state = json.loads(text)
        if not isinstance(state, dict) or state.get("version") != VERSION:
            raise ValueError("not a fluksio_nb ledger of this version")
        try:
            _Document.model_validate(state)
        except ValidationError as error:
            raise ValueError(f"the document is incomplete: {explain(error)}") from None
        if inventory is not None:
            state["inventory"] = inventory
        state["tickets"], problems = _trusted(state["tickets"], state["inventory"])
        _warn_left_out(self.path, problems)
        # A ticket number is never handed out twice, whatever "next" said.
        state["next"] = max([state["next"], *(t["number"] + 1 for t in state["tickets"])])
        return state

    def _write(self, text: str) -> None:
        fd = self._document()
        data = text.encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))


class _Waker:
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


def identity() -> dict[str, Any]:
    """Who this kernel is, as the ledger records it."""
    pid = os.getpid()
    kernel_id = None
    with contextlib.suppress(Exception):
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).stem
        kernel_id = name.removeprefix("kernel-")
    return {
        "pid": pid,
        "started": process_started(pid) or 0.0,
        "kernel_id": kernel_id,
        # jupyter_server tells the kernels it starts which notebook they serve.
        "notebook": os.environ.get("JPY_SESSION_NAME"),
        # From the OS, not $USER or $LOGNAME, which say whatever they are set to.
        "uid": os.geteuid(),
        "user": user_name(os.geteuid()),
    }


def dispatch(state: dict[str, Any], checked: bool = False) -> list[str]:
    """Reap dead owners, leave out what cannot be trusted, and grant in order.

    Returns the addresses to wake. ``checked``: every entry was read through
    :class:`LedgerFile` or made by this module, so is not validated again.
    """
    inventory = state["inventory"]
    tickets, problems = _trusted(state["tickets"], inventory, checked)
    _warn_left_out(None, problems)
    state["tickets"] = tickets
    running = [t for t in tickets if t["state"] == "running"]
    held_gpus = {g for t in running for g in t["allocation"]["gpus"]}
    free_gpus = sorted(set(inventory["gpu_ids"]) - held_gpus)
    free_cores = _free_cores(inventory, running)
    node_of = {int(core): node for core, node in inventory.get("core_nodes", {}).items()}
    free = (
        inventory["cpus"] - sum(t["allocation"]["cpus"] for t in running),
        len(free_gpus),
        inventory["ram_bytes"] - sum(t["allocation"]["ram_bytes"] for t in running),
    )
    waiting = [t for t in tickets if t["state"] == "waiting"]
    needs = [(t["asked"]["cpus"], t["asked"]["gpus"], t["asked"]["ram_bytes"]) for t in waiting]
    woken = []
    for index in who_goes_next(needs, free):
        entry = waiting[index]
        cards, free_gpus = (
            free_gpus[: entry["asked"]["gpus"]],
            free_gpus[entry["asked"]["gpus"] :],
        )
        cores = pick_cores(free_cores, entry["asked"]["cpus"], node_of)
        free_cores = [core for core in free_cores if core not in cores]
        entry["state"] = "running"
        entry["allocation"] = {**entry["asked"], "gpus": cards, "cores": list(cores)}
        entry["granted_at"] = time.time()
        if entry.get("wake"):
            woken.append(entry["wake"])
    return woken


def _free_cores(inventory: dict[str, Any], running: list[dict[str, Any]]) -> list[int]:
    held = {c for t in running for c in t["allocation"].get("cores", ())}
    return sorted(set(inventory.get("core_ids", ())) - held)


def cancel_claim(ledger: LedgerFile, number: int, reason: str, user: str | None = None) -> bool:
    """Cancel a waiting claim, or mark a running one to be stopped by its kernel.

    ``user``, when given, must be the claim's owner, as its entry names them.
    False if there is no such claim (any more).
    """
    with ledger.transaction() as state:
        entry = next(
            (t for t in state["tickets"] if t["number"] == number and t["state"] != "cancelled"),
            None,
        )
        if entry is None:
            return False
        owner = entry["owner"].get("user")
        if user is not None and owner != user:
            raise NotYours(f"claim {number} belongs to {owner!r}; only they may cancel it")
        entry["cancel"] = reason
        woken = [entry["wake"]] if entry.get("wake") else []
        if entry["state"] == "waiting":
            # Kept, marked, until its owner lets go of it, so that the owner
            # learns why; it no longer takes a place in the queue.
            entry["state"] = "cancelled"
            woken += dispatch(state, checked=True)
    wake(woken)
    return True


def read_snapshot(directory: Path, shared: bool = False) -> dict[str, Any]:
    """The machine as its ledger describes it, read under the shared lock.

    For the server and the command line, which make no claims of their own:
    with no ledger yet, the machine is described as this process sees it.
    ``shared`` is ignored, as by :class:`LedgerFile`.
    """
    ledger = LedgerFile(directory)
    try:
        if ledger.has_document():
            state = ledger.read()
            return machine_snapshot(state, state["inventory"], checked=True)
    finally:
        ledger.close()
    return machine_as_found()


def machine_as_found(settings: Settings | None = None) -> dict[str, Any]:
    """A snapshot of books nobody has claimed from: the machine as this process finds it."""
    inventory = take_inventory(settings or load_settings()).for_books()
    return machine_snapshot(_empty_state(inventory), inventory)


class MachineQueue:
    """The kernel's accountant, keeping its books in the machine's ledger.

    It answers what :class:`~fluksio_nb.queue.ClaimQueue` answers, with the same
    rules; only where the books live differs.
    """

    def __init__(self, directory: Path, inventory: Inventory, shared: bool = False) -> None:
        # ``shared`` is ignored, as by :class:`LedgerFile`.
        self.books = ResourceAccountant.from_inventory(inventory)
        self.ledger = LedgerFile(
            directory,
            inventory.for_books(),
        )
        self.owner = identity()
        #: What holds claims made here to their share, per resource, as
        #: :func:`fluksio_nb.kernel.enforcement_in_force` says: in every snapshot.
        self.enforcement: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._mine: dict[int, Ticket] = {}
        self._wakers: dict[int, _Waker] = {}
        self._readings: dict[int, dict[str, Any]] = {}
        self._looker: threading.Thread | None = None

    # -- asking ---------------------------------------------------------------

    def fit_to_machine(self, wanted: Resources) -> Resources:
        return fit_to_capacity(wanted, self.books)

    def enqueue(self, wanted: Resources, label: str | None = None) -> Ticket:
        fitted = self.fit_to_machine(wanted)
        waker = None
        ticket: Ticket | None = None
        try:
            with self.ledger.transaction() as state:
                number = state["next"]
                state["next"] += 1
                ticket = Ticket(
                    number=number,
                    resources=fitted,
                    label=label or wanted.label or f"claim {number}",
                )
                self._restore_missing(state)
                entry = self._entry(ticket, None)
                state["tickets"].append(entry)
                woken = dispatch(state, checked=True)
                # Only a claim that has to wait needs waking: one granted on
                # the spot, as most are, opens no socket.
                if entry["state"] == "waiting":
                    waker = _Waker()
                    entry["wake"] = waker.address
            with self._lock:
                self._mine[number] = ticket
                if waker is not None:
                    self._wakers[number] = waker
            self._adopt(state)
            wake(woken)
        except BaseException:
            # The stop button may land after the ledger has the claim and
            # before the caller does: nobody would ever give it back.
            if ticket is not None:
                with contextlib.suppress(Exception):
                    self.release(ticket)
            if waker is not None:
                waker.close()
            raise
        return ticket

    def wait(self, ticket: Ticket, timeout: float | None = None) -> Allocation:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if ticket.allocation is not None:
                return ticket.allocation
            if ticket.cancelled is not None:
                raise ClaimCancelled(
                    f"{ticket.label} was cancelled while waiting: {ticket.cancelled}"
                )
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ClaimTimeout(self.timeout_message(ticket, timeout))
            waker = self._wakers.get(ticket.number)
            pause = LOOK_EVERY_S if left is None else min(left, LOOK_EVERY_S)
            if waker is not None:
                waker.sleep(pause)
            else:
                time.sleep(pause)
            self.look()

    def release(self, ticket: Ticket) -> None:
        if ticket.state == "done" and ticket.number not in self._mine:
            return
        with self.ledger.transaction() as state:
            self._restore_missing(state)
            state["tickets"] = [t for t in state["tickets"] if t["number"] != ticket.number]
            woken = dispatch(state, checked=True)
        ticket.state = "done"
        self._forget(ticket.number)
        self._adopt(state)
        wake(woken)

    def cancel(self, number: int, reason: str = "cancelled by the user") -> bool:
        """Cancel a waiting claim, or ask a running one to stop, in any kernel of this user."""
        found = cancel_claim(self.ledger, number, reason)
        self.look()
        return found

    # -- keeping up with the ledger -------------------------------------------

    def look(self) -> None:
        """Read the ledger, reap the dead, grant what can go, and learn our own news."""
        with self.ledger.transaction() as state:
            self._restore_missing(state)
            for entry in state["tickets"]:
                reading = self._readings.get(entry["number"])
                if reading is not None and entry["owner"]["pid"] == self.owner["pid"]:
                    entry["readings"] = reading
            woken = dispatch(state, checked=True)
        self._adopt(state)
        wake(woken)

    def report(self, ticket: Ticket, readings: dict[str, Any]) -> None:
        """The latest readings of a running claim, written on the next look.

        A claim reports a reading only when it is news (:func:`~fluksio_nb.sampler.is_news`),
        so a steady claim leaves the document alone and ``at`` is when its
        figures last moved.
        """
        self._readings[ticket.number] = readings

    def _adopt(self, state: dict[str, Any]) -> None:
        """Bring this kernel's tickets up to date with what the ledger says of them."""
        by_number = {t["number"]: t for t in state["tickets"]}
        stop = []
        with self._lock:
            for number, ticket in list(self._mine.items()):
                entry = by_number.get(number)
                if entry is None:
                    if ticket.state == "waiting" and ticket.cancelled is None:
                        ticket.cancelled = "cancelled from another process"
                    continue
                if entry["state"] == "running" and ticket.allocation is None:
                    ticket.allocation = Allocation.from_dict(entry["allocation"])
                    ticket.state, ticket.granted_at = "running", entry["granted_at"]
                    self._start_looking()
                if entry.get("cancel") and ticket.cancelled is None:
                    ticket.cancelled = entry["cancel"]
                    if ticket.state == "running" and ticket.on_cancel is not None:
                        stop.append((ticket.on_cancel, entry["cancel"]))
        for on_cancel, reason in stop:
            on_cancel(reason)

    def _restore_missing(self, state: dict[str, Any]) -> None:
        """Write back this kernel's running claims if the ledger lost them."""
        present = {t["number"] for t in state["tickets"]}
        with self._lock:
            for number, ticket in self._mine.items():
                if number not in present and ticket.state == "running":
                    state["tickets"].append(self._entry(ticket, None, restored=True))
                    state["next"] = max(state["next"], number + 1)
            state["tickets"].sort(key=lambda t: t["number"])

    def _entry(self, ticket: Ticket, wake_address: str | None, restored: bool = False):
        entry = {
            "number": ticket.number,
            "state": "waiting",
            "label": ticket.label,
            "asked": {
                "cpus": ticket.resources.cpus,
                "gpus": ticket.resources.gpus,
                "ram_bytes": ticket.resources.ram_bytes,
            },
            "allocation": None,
            "owner": self.owner,
            "since": ticket.since,
            "granted_at": None,
            "wake": wake_address,
            "cancel": None,
            "readings": None,
        }
        if restored and ticket.allocation is not None:
            entry["state"] = "running"
            entry["allocation"] = ticket.allocation.as_dict()
            entry["granted_at"] = ticket.granted_at
        return entry

    def _forget(self, number: int) -> None:
        with self._lock:
            self._mine.pop(number, None)
            self._readings.pop(number, None)
            waker = self._wakers.pop(number, None)
        if waker is not None:
            waker.close()

    def _start_looking(self) -> None:
        """While this kernel holds a share, look every half second. Lock held."""
        if self._looker is not None and self._looker.is_alive():
            return

        def keep_looking() -> None:
            while True:
                time.sleep(LOOK_EVERY_S)
                with self._lock:
                    if not any(t.state == "running" for t in self._mine.values()):
                        self._looker = None
                        return
                with contextlib.suppress(Exception):
                    self.look()

        self._looker = threading.Thread(target=keep_looking, name="fluksio-ledger", daemon=True)
        self._looker.start()

    # -- what is going on -----------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The machine: totals, free, every kernel's waiting and running claims."""
        state = self.ledger.read()
        shown = machine_snapshot(state, self.ledger.inventory, checked=True)
        return {**shown, "enforcement": self.enforcement}

    def position(self, ticket: Ticket) -> int | None:
        waiting = [t["number"] for t in self.ledger.read()["tickets"] if t["state"] == "waiting"]
        return waiting.index(ticket.number) + 1 if ticket.number in waiting else None

    def holders(self) -> list[Ticket]:
        holders = []
        for entry in self.ledger.read()["tickets"]:
            if entry["state"] != "running":
                continue
            held = entry["allocation"]
            ticket = Ticket(
                number=entry["number"],
                resources=Resources(cpus=max(1, held["cpus"]), gpus=len(held["gpus"])),
                label=entry["label"],
                since=entry["since"],
                pid=entry["owner"]["pid"],
                state="running",
                allocation=Allocation.from_dict(held),
            )
            holders.append(ticket)
        return holders

    def timeout_message(self, ticket: Ticket, timeout: float | None) -> str:
        return timeout_message(ticket, timeout, self.holders())


def machine_snapshot(
    state: dict[str, Any], inventory: dict[str, Any], checked: bool = False
) -> dict[str, Any]:
    """What a ledger document says, in the shape :meth:`ClaimQueue.snapshot` uses.

    Only what can be trusted is shown: the free figures are never below zero.
    ``checked`` as for :func:`dispatch`.
    """
    tickets, problems = _trusted(state.get("tickets", []), inventory, checked)
    _warn_left_out(None, problems)
    running = [t for t in tickets if t["state"] == "running"]
    waiting = [t for t in tickets if t["state"] == "waiting"]
    held_gpus = {g for t in running for g in t["allocation"]["gpus"]}
    free_ids = sorted(set(inventory["gpu_ids"]) - held_gpus)

    def who(entry: dict[str, Any]) -> dict[str, Any]:
        owner = entry["owner"]
        return {
            "ticket": entry["number"],
            "label": entry["label"],
            "since": entry["since"],
            "pid": owner["pid"],
            "kernel_id": owner.get("kernel_id"),
            "notebook": owner.get("notebook"),
            "user": owner.get("user"),
            #: A stop asked for and not yet carried out by the claim's kernel.
            "cancel": entry.get("cancel"),
        }

    return {
        "cpus": {
            "total": inventory["cpus"],
            "free": inventory["cpus"] - sum(t["allocation"]["cpus"] for t in running),
            "free_ids": _free_cores(inventory, running),
        },
        "gpus": {
            "total": len(inventory["gpu_ids"]),
            "free": len(free_ids),
            "free_ids": free_ids,
        },
        "ram_bytes": {
            "total": inventory["ram_bytes"],
            "free": inventory["ram_bytes"] - sum(t["allocation"]["ram_bytes"] for t in running),
        },
        "waiting": [
            {**who(t), "position": position, "asked": t["asked"]}
            for position, t in enumerate(waiting, start=1)
        ],
        "running": [
            {**who(t), "allocation": t["allocation"], "readings": t.get("readings")}
            for t in running
        ],
    }


def ledger_location(setting: str | None) -> tuple[Path, bool] | None:
    """Where the ledger lives for a setting; None for kernel-only books.

    The second item, once whether the ledger was a team's, is always False: a
    ledger is one user's books wherever it is (see the module's docstring).
    It stays until the callers that unpack it are updated.
    """
    if setting == "kernel":
        return None
    if setting:
        return Path(setting).expanduser(), False
    return default_ledger_dir(), False
