"""The ledger's document and its lock: every grant a transaction across processes.

Several kernels of one user change the same books at once, and each of them
may be stopped at any moment: by the stop button, or by SIGKILL halfway
through a write. Each must see the books whole, and leave them whole.

What it decides:

- **A file and a lock, no daemon.** The state is one small JSON document,
  rewritten under an exclusive ``flock`` on a separate lock file. That gives
  real transactions across processes with less code than SQLite, and readers
  take the lock shared, so they never see half a document.
- **A broken file is rebuilt, never fatal.** A truncated or corrupted
  document is copied aside with a warning and started afresh; this kernel's
  own claims are written back into it, and other kernels put back theirs
  the next time they look (their running claims check their entries every
  half second).
- **Only files of this user's alone.** Every file is opened through the
  checked directory (:mod:`fluksio_nb.ledger.directory`), and a file that is
  not this user's alone is refused, not repaired.
- **The transaction that drops a dead kernel's claim records it**, once the
  document without it is written: into this process's own usage records,
  which count against this same user, ending
  :data:`~fluksio_nb.records.KERNEL_DIED`. Only one transaction can drop
  an entry, and a kernel gives its claim back before it records it, so a
  claim is never recorded twice; killed between the two, it goes unrecorded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ByteSize, ValidationError

from fluksio_nb.ledger.directory import UnsafeLedgerDir, open_directory, untrusted_file
from fluksio_nb.ledger.document import (
    VERSION,
    Document,
    LedgerBroken,
    empty_state,
    trusted,
    warn_left_out,
)
from fluksio_nb.ledger.owner import last_seen, owner_alive
from fluksio_nb.records import (
    KERNEL_DIED,
    UsageNotRecorded,
    UsageRecord,
    default_usage_dir,
    process_log,
)
from fluksio_nb.resources import explain
from fluksio_nb.stop_button import stop_held_back

LEDGER_FILE = "ledger.json"
LOCK_FILE = "ledger.lock"
_FILE_MODE = 0o600


def _dump(state: dict[str, Any]) -> str:
    return json.dumps(state, separators=(",", ":"))


def _differences(theirs: dict[str, Any], mine: dict[str, Any]) -> str:
    """Where two descriptions of the machine differ: "cards [0, 1] there, none here"."""

    def said(key: str, value: Any) -> str:
        if key == "ram_bytes":
            return ByteSize(value).human_readable(decimal=True)
        if isinstance(value, dict):
            return str(dict(sorted(value.items()))) if value else "none"
        if isinstance(value, list):
            return str(sorted(value)) if value else "none"
        return str(value)

    names = {
        "cpus": "claimable cpus",
        "gpu_ids": "cards",
        "ram_bytes": "claimable RAM",
        "core_ids": "cores",
        "core_nodes": "NUMA nodes of the cores",
    }
    return "; ".join(
        f"{name} {said(key, theirs.get(key))} there, {said(key, mine.get(key))} here"
        for key, name in names.items()
        if theirs.get(key) != mine.get(key)
    )


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

    def __init__(self, directory: Path, inventory: dict[str, Any] | None = None):
        #: What this process says the machine has; ``None`` for a reader that
        #: takes the ledger's word for it (the server).
        self.inventory = inventory
        self.directory = Path(directory)
        self.path = self.directory / LEDGER_FILE
        self._lock_fd: int | None = None
        self._data_fd: int | None = None
        # Every file is opened relative to this descriptor, checked once: what
        # the path leads to later (a swapped directory, a new link) is never used.
        self._dir_fd: int | None = open_directory(self.directory)
        self._thread_lock = threading.Lock()
        #: The document as this process last wrote it, or last read it and
        #: found every entry sound. Read back unchanged, as it is on most
        #: transactions, it is not validated again: it passed once, and
        #: validating every entry on every transaction grows with the books.
        self._sound_text: str | None = None
        #: Set by each read when the books are kept over another description
        #: of the machine than this process's, which it cannot take over: why.
        self.disagreement: str | None = None
        #: Why the last :meth:`read` found no ledger it could use, if it did not.
        self.unreadable: str | None = None

    @property
    def directory_fd(self) -> int | None:
        """The checked directory, open: for files of the ledger's own, such as a waiter's socket."""
        return self._dir_fd

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
        with self._thread_lock, self._locked(fcntl.LOCK_EX), stop_held_back():
            # Looked up once: while the lock is held, no kernel of this user
            # replaces the file, and no other user can.
            fd = self._document()
            dead: list[dict[str, Any]] = []
            state, before = self._load_for_update(fd, dead)
            found = list(state["tickets"])
            yield state
            after = _dump(state)
            if after != before:
                self._write(fd, after)
            kept = {entry["number"] for entry in state["tickets"]}
            dead += [e for e in found if e["number"] not in kept and not owner_alive(e["owner"])]
            if dead:
                _record_the_dead(dead)

    def read(self) -> dict[str, Any]:
        """The document as it stands; a missing or broken one reads as empty."""
        with self._thread_lock, self._locked(fcntl.LOCK_SH):
            # Outside the try: a file that is not ours is refused, not read as empty.
            fd = self._document()
            self.disagreement = self.unreadable = None
            try:
                return self._parse(self._read_text(fd), self.inventory)
            except (OSError, ValueError) as error:
                self.unreadable = str(error) or type(error).__name__
                return empty_state(self.inventory)

    def _locked(self, how: int) -> _Flocked:
        if self._lock_fd is None:
            # Opened and kept as one step: a stop landing as it is opened
            # would leave it open with nothing holding its number.
            with stop_held_back():
                self._lock_fd = self._open(LOCK_FILE)
        return _Flocked(self._lock_fd, how)

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
            wrong = untrusted_file(path, os.fstat(fd))
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
        with stop_held_back():  # as the lock file is
            self._data_fd = self._open(LEDGER_FILE)
        return self._data_fd

    @staticmethod
    def _read_text(fd: int) -> str:
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0).decode() if size else ""

    def _load_for_update(self, fd: int, dead: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
        """The document to change, and its text as read, to tell whether it changed.

        ``dead`` gets the entries of kernels that are gone, left out of it.
        """
        self.disagreement = None
        try:
            text = self._read_text(fd)
        except UnicodeDecodeError:
            text = "\0"  # not a ledger: rebuilt below
        if not text:
            return empty_state(self.inventory), ""
        try:
            # This kernel's description of the machine is taken, unless it
            # would drop claims that others hold (_in_force).
            return self._parse(text, self.inventory, dead), text
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
            fresh = empty_state(self.inventory)
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

    def _parse(
        self,
        text: str,
        inventory: dict[str, Any] | None,
        dead: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The document, with what cannot be trusted left out. ValueError if it is no ledger.

        ``dead``, if given, gets the entries of kernels that are gone.
        """
        state = json.loads(text)
        sound = text == self._sound_text
        if not sound:
            if not isinstance(state, dict) or state.get("version") != VERSION:
                raise ValueError("not a fluksio_nb ledger of this version")
            try:
                Document.model_validate(state)
            except ValidationError as error:
                raise ValueError(f"the document is incomplete: {explain(error)}") from None
        if inventory is not None and inventory != state["inventory"]:
            state["inventory"], self.disagreement = self._in_force(state, inventory, sound)
        # Owners are looked at every time: a kernel that died since is reaped.
        state["tickets"], problems = trusted(
            state["tickets"], state["inventory"], checked=sound, dead=dead
        )
        warn_left_out(self.path, problems)
        if not problems:
            self._sound_text = text
        # A ticket number is never handed out twice, whatever "next" said.
        state["next"] = max([state["next"], *(t["number"] + 1 for t in state["tickets"])])
        return state

    def _in_force(
        self, state: dict[str, Any], mine: dict[str, Any], checked: bool
    ) -> tuple[dict[str, Any], str | None]:
        """Which description of the machine the books are kept over, and why not this one.

        A kernel restarted with a new ``FLUKSIO_*`` setting means it, so this
        process's description takes over, unless counting by it would drop
        claims that live kernels hold under the one written: two notebooks
        declaring different machines would otherwise each drop the other's
        claims as "not this machine's". Then the written one stays, and what
        differs is said, for this process's next claim to be refused with.
        """
        theirs = state["inventory"]
        kept_by_theirs, _ = trusted(state["tickets"], theirs, checked=checked)
        kept_by_mine, _ = trusted(state["tickets"], mine, checked=checked)
        kept = {entry["number"] for entry in kept_by_mine}
        dropped = [entry for entry in kept_by_theirs if entry["number"] not in kept]
        if not dropped:
            return mine, None
        kernels = sorted(
            {
                f"pid {entry['owner']['pid']}"
                + (f" ({entry['owner']['notebook']})" if entry["owner"].get("notebook") else "")
                for entry in dropped
            }
        )
        claims = f"{len(dropped)} claim{'s' if len(dropped) != 1 else ''}"
        whose = f"kernel{'s' if len(kernels) != 1 else ''} {', '.join(kernels)}"
        return theirs, (
            f"the books in {self.directory} are kept over another description of the "
            f"machine ({_differences(theirs, mine)}), and counting by this kernel's "
            f"description would drop {claims} held by the {whose}"
        )

    def _write(self, fd: int, text: str) -> None:
        data = text.encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        # Made of entries that were validated as they were read, or made here.
        self._sound_text = text


class _Flocked:
    """The ledger's lock file, locked for a ``with`` block.

    A class, not a generator: a generator's context manager takes the lock
    before it yields, and a stop landing as its ``__enter__`` returns leaves
    the lock held by a generator nobody resumes, for as long as the
    traceback lives, which in a kernel is until the next error: every other
    kernel of the user then waits for it. Here a stop that lands as the lock
    is taken lets it go, and none can land after.
    """

    def __init__(self, fd: int, how: int) -> None:
        self.fd, self.how = fd, how

    def __enter__(self) -> None:
        try:
            fcntl.flock(self.fd, self.how)
        except BaseException:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            raise

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def _record_the_dead(entries: list[dict[str, Any]]) -> None:
    """The usage records killed kernels of this user could not write, in this process's file."""
    try:
        log = process_log(default_usage_dir(), create=True)
        for entry in entries:
            log.write(_record_of_the_dead(entry))
    except Exception as error:
        # Accounting never fails a claim: this transaction is someone's claim.
        warnings.warn(
            f"fluksio_nb could not record the claims of a killed kernel: {error}",
            UsageNotRecorded,
            stacklevel=4,
        )


def _record_of_the_dead(entry: dict[str, Any]) -> UsageRecord:
    """A dead kernel's claim as its record: what the ledger knew, and no peak, which it did not."""
    held = entry["allocation"] if entry["state"] == "running" else None
    granted_at = entry["granted_at"] if held else None
    # Never past the last moment the claim is known to have held its share:
    # when this process saw its kernel end, or last found it alive, or the
    # kernel's own last reading, whichever came last.
    signs = [entry["since"], granted_at, last_seen(entry["owner"])]
    readings = entry.get("readings") or {}
    at = readings.get("at") if isinstance(readings, dict) else None
    if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at):
        signs.append(at)
    ended_at = min(max(sign for sign in signs if sign is not None), time.time())
    return UsageRecord(
        label=entry["label"],
        notebook=entry["owner"].get("notebook"),
        ticket=entry["number"],
        cpus=held["cpus"] if held else 0,
        gpus=list(held["gpus"]) if held else [],
        ram_bytes=held["ram_bytes"] if held else 0,
        asked_at=entry["since"],
        granted_at=granted_at,
        ended_at=ended_at,
        ending=KERNEL_DIED,
    )
