"""One machine's books, shared by every kernel on it.

A queue inside one kernel stops one notebook from oversubscribing the
machine. The real damage comes from several notebooks on one workstation or
JupyterHub node, each sure it owns the machine: two kernels that each grant
"GPU 0" to a cell of their own are the deadlock this project exists to
prevent. So by default every kernel keeps its books in one file, and every
grant is a transaction on that file.

What it decides:

- **A file and a lock, no daemon.** The state is one small JSON document,
  replaced atomically (write, then rename) under an exclusive ``flock`` on a
  separate lock file. That gives real transactions across processes with
  less code than SQLite, and a reader who only looks (the server's
  snapshot) never needs the lock: it sees the old document or the new one.
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
  document is moved aside with a warning and started afresh; this kernel's
  own claims are written back into it, and other kernels put back theirs
  the next time they look (their running claims check their entries every
  half second).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.inventory import Inventory
from fluksio_nb.queue import (
    ClaimCancelled,
    ClaimTimeout,
    Ticket,
    fit_to_capacity,
    timeout_message,
    who_goes_next,
)
from fluksio_nb.resources import Resources

LEDGER_FILE = "ledger.json"
LOCK_FILE = "ledger.lock"
VERSION = 1

#: How often a waiter or a running claim looks at the ledger when nobody wakes
#: it: the bound on how long a silently dead holder keeps its share.
LOOK_EVERY_S = 0.5


class LedgerBroken(UserWarning):
    """The ledger file could not be read and was started afresh."""


def default_ledger_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "fluksio"


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
    """

    def __init__(
        self, directory: Path, inventory: dict[str, Any] | None = None, shared: bool = False
    ):
        #: What this process says the machine has; ``None`` for a reader that
        #: takes the ledger's word for it (the server).
        self.directory = Path(directory)
        self.inventory = inventory
        # A team's shared ledger lives in a group-writable place; a user's own
        # is theirs alone, since it names their notebooks.
        self._dir_mode = 0o2770 if shared else 0o700
        self._file_mode = 0o660 if shared else 0o600
        self.directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):
            os.chmod(self.directory, self._dir_mode)
        self.path = self.directory / LEDGER_FILE
        self._lock_path = self.directory / LOCK_FILE
        self._thread_lock = threading.Lock()
        # Both opened once and kept: opening them per transaction was a
        # measurable part of one.
        self._lock_fd: int | None = None
        self._data_fd: int | None = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[dict[str, Any]]:
        """The document, locked against every other process, written back on success."""
        with self._thread_lock, self._locked(fcntl.LOCK_EX):
            state, before = self._load_for_update()
            yield state
            after = _dump(state)
            if after != before:
                self._write(after)

    def read(self) -> dict[str, Any]:
        """The document as it stands; a missing or broken one reads as empty."""
        with self._thread_lock, self._locked(fcntl.LOCK_SH):
            try:
                return self._parse(self._read_text())
            except (OSError, ValueError):
                return _empty_state(self.inventory)

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        if self._lock_fd is None:
            self._lock_fd = self._open(self._lock_path)
        fcntl.flock(self._lock_fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _open(self, path: Path) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, self._file_mode)
        with contextlib.suppress(PermissionError):
            os.fchmod(fd, self._file_mode)  # the umask must not make a team's file private
        return fd

    def _document(self) -> int:
        """The document's descriptor, reopened if the file was removed or replaced."""
        fd = self._data_fd
        if fd is not None:
            try:
                current = os.stat(self.path)
                if os.fstat(fd).st_ino == current.st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)
        self._data_fd = self._open(self.path)
        return self._data_fd

    def _read_text(self) -> str:
        fd = self._document()
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0).decode() if size else ""

    def _load_for_update(self) -> tuple[dict[str, Any], str]:
        """The document to change, and its text as read, to tell whether it changed."""
        try:
            text = self._read_text()
        except UnicodeDecodeError:
            text = "\0"  # not a ledger: rebuilt below
        if not text:
            return _empty_state(self.inventory), ""
        try:
            state = self._parse(text)
        except ValueError as error:
            aside = self.path.with_name(f"{LEDGER_FILE}.broken-{int(time.time())}")
            with contextlib.suppress(OSError):
                aside.write_text(text, errors="replace")
            warnings.warn(
                f"fluksio_nb: the machine's ledger {self.path} could not be read ({error}); "
                f"a copy was kept as {aside.name} and it was started afresh. Claims running "
                "in other kernels are written back as those kernels next look.",
                LedgerBroken,
                stacklevel=4,
            )
            fresh = _empty_state(self.inventory)
            # Numbering restarts above anything the lost document can have
            # handed out, so a ticket other kernels still hold is never reissued.
            fresh["next"] = int(time.time())
            return fresh, text
        # The kernel that wrote the inventory last describes the machine: a
        # restarted kernel with a new FLUKSIO_* setting means it.
        if self.inventory is not None:
            state["inventory"] = self.inventory
        return state, text

    @staticmethod
    def _parse(text: str) -> dict[str, Any]:
        state = json.loads(text)
        if not isinstance(state, dict) or state.get("version") != VERSION:
            raise ValueError("not a fluksio_nb ledger of this version")
        if not isinstance(state.get("tickets"), list) or not isinstance(state.get("next"), int):
            raise ValueError("the document is incomplete")
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
        "user": getpass.getuser(),
    }


def dispatch(state: dict[str, Any]) -> list[str]:
    """Reap dead owners and grant in order. Returns the addresses to wake."""
    tickets = state["tickets"]
    tickets[:] = [t for t in tickets if _owner_alive(t["owner"])]
    inventory = state["inventory"]
    running = [t for t in tickets if t["state"] == "running"]
    held_gpus = {g for t in running for g in t["allocation"]["gpus"]}
    free_gpus = sorted(set(inventory["gpu_ids"]) - held_gpus)
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
        entry["state"] = "running"
        entry["allocation"] = {**entry["asked"], "gpus": cards}
        entry["granted_at"] = time.time()
        if entry.get("wake"):
            woken.append(entry["wake"])
    return woken


class NotYours(PermissionError):
    """A claim may only be cancelled by the user who made it."""


def cancel_claim(ledger: LedgerFile, number: int, reason: str, user: str | None = None) -> bool:
    """Cancel a waiting claim, or mark a running one to be stopped by its kernel.

    ``user``, when given, must be the claim's owner: on a team's shared ledger
    a user may stop their own work and nobody else's. False if there is no
    such claim (any more).
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
            woken += dispatch(state)
    wake(woken)
    return True


def read_snapshot(directory: Path, shared: bool = False) -> dict[str, Any]:
    """The machine as its ledger describes it, read without taking the lock.

    For the server and the command line, which make no claims of their own:
    with no ledger yet, the machine is described as this process sees it.
    """
    ledger = LedgerFile(directory, shared=shared)
    if ledger.path.exists():
        state = ledger.read()
        return machine_snapshot(state, state["inventory"])
    from fluksio_nb.inventory import take_inventory
    from fluksio_nb.settings import load_settings

    found = take_inventory(load_settings())
    inventory = {"cpus": found.cpus, "gpu_ids": list(found.gpu_ids), "ram_bytes": found.ram_bytes}
    return machine_snapshot(_empty_state(inventory), inventory)


class MachineQueue:
    """The kernel's accountant, keeping its books in the machine's ledger.

    It answers what :class:`~fluksio_nb.queue.ClaimQueue` answers, with the same
    rules; only where the books live differs.
    """

    def __init__(self, directory: Path, inventory: Inventory, shared: bool = False) -> None:
        self.books = ResourceAccountant(
            cpus=inventory.cpus, gpus=inventory.gpu_ids, ram_bytes=inventory.ram_bytes
        )
        self.ledger = LedgerFile(
            directory,
            {
                "cpus": inventory.cpus,
                "gpu_ids": list(inventory.gpu_ids),
                "ram_bytes": inventory.ram_bytes,
            },
            shared=shared,
        )
        self.owner = identity()
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
                woken = dispatch(state)
                # Only a claim that has to wait needs waking: one granted on
                # the spot, as most are, opens no socket.
                if entry["state"] == "waiting":
                    waker = _Waker()
                    entry["wake"] = waker.address
        except BaseException:
            if waker is not None:
                waker.close()
            raise
        with self._lock:
            self._mine[number] = ticket
            if waker is not None:
                self._wakers[number] = waker
        self._adopt(state)
        wake(woken)
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
            woken = dispatch(state)
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
            woken = dispatch(state)
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
                    held = entry["allocation"]
                    ticket.allocation = Allocation(
                        cpus=held["cpus"], gpus=tuple(held["gpus"]), ram_bytes=held["ram_bytes"]
                    )
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
        return machine_snapshot(state, self.ledger.inventory)

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
                allocation=Allocation(held["cpus"], tuple(held["gpus"]), held["ram_bytes"]),
            )
            holders.append(ticket)
        return holders

    def timeout_message(self, ticket: Ticket, timeout: float | None) -> str:
        return timeout_message(ticket, timeout, self.holders())


def machine_snapshot(state: dict[str, Any], inventory: dict[str, Any]) -> dict[str, Any]:
    """What a ledger document says, in the shape :meth:`ClaimQueue.snapshot` uses."""
    tickets = [t for t in state.get("tickets", []) if _owner_alive(t["owner"])]
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
    """Where the ledger lives for a setting, and whether it is shared; None for kernel-only."""
    if setting == "kernel":
        return None
    if setting:
        path = Path(setting).expanduser()
        # A location somebody chose, other than the user's own runtime dir,
        # is for a team: make what is created there group-writable.
        return path, True
    return default_ledger_dir(), False
