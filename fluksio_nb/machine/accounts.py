"""The books service's own account of every claim it saw end: a file per user, rotated.

A kernel writes its claims' records into files of its user's own, which
that user may edit or delete: deleting two files once took a user's claims
in root's report from 3 to 0. The service sees every claim itself (who
asked, by ``SO_PEERCRED``; what it granted; when it was asked for, granted
and given back), so it writes that down, in files of root's that no user
may read or touch. Root's report counts each claim from these
(:mod:`fluksio_nb.usage.report`); a kernel's own record adds only what the
service cannot know: the claim's label, notebook, peaks and how its cell
ended.

What it decides:

- **A file per user** (``0-books-<uid>-<opened>-<random>.jsonl``): one
  user's volume fills their own files only, and cannot push anyone else's
  records out. Each file is created afresh (``O_EXCL``, never through a
  link) in the sticky records directory, so no file another user planted
  there under a likely name is ever written to.
- **Rotated by size and age**: a user's file is closed once it holds
  :data:`ROTATE_BYTES` or is :data:`ROTATE_AGE_S` old, and a new one begun;
  of the closed ones the newest :data:`KEPT` are kept. What one user may
  make root keep is bounded, and a report reads every file kept.
- **Never raises into the service's loop**: a record that cannot be
  written is a warning in the service's log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from fluksio_nb.records import SUFFIX, UsageRecord, open_records_directory

log = logging.getLogger("fluksio_nb.machine")

#: A user's file is closed, and a new one begun, past this size or age.
ROTATE_BYTES = 4 * 2**20
ROTATE_AGE_S = 7 * 86400.0
#: How many of a user's closed files are kept: with the open one, some 20 MiB
#: (about 60,000 claims) per user at most.
KEPT = 4
#: How an account's file is named, before its user's uid.
PREFIX = "0-books-"


class _Open:
    def __init__(self, fd: int, name: str, opened: float) -> None:
        self.fd, self.name, self.opened, self.size = fd, name, opened, 0


class BooksAccounts:
    """Where the service writes the record of each claim it saw end, a file per user."""

    def __init__(
        self,
        directory: Path,
        *,
        rotate_bytes: int = ROTATE_BYTES,
        rotate_age_s: float = ROTATE_AGE_S,
        kept: int = KEPT,
    ) -> None:
        self.directory = Path(directory)
        self.rotate_bytes, self.rotate_age_s, self.kept = rotate_bytes, rotate_age_s, kept
        self._open: dict[int, _Open] = {}

    def write(self, record: UsageRecord) -> None:
        """Append ``record`` to its user's file. Never raises."""
        assert record.uid is not None
        line = (record.model_dump_json(exclude_none=True) + "\n").encode()
        try:
            current = self._file(record.uid)
            while line:
                written = os.write(current.fd, line)
                current.size += written
                line = line[written:]
        except OSError as error:
            log.warning("a claim of uid %s was not recorded: %s", record.uid, error)

    def close(self) -> None:
        for current in self._open.values():
            with contextlib.suppress(OSError):
                os.close(current.fd)
        self._open.clear()

    def _file(self, uid: int) -> _Open:
        current = self._open.get(uid)
        now = time.time()
        if current is not None and (
            current.size >= self.rotate_bytes or now - current.opened >= self.rotate_age_s
        ):
            os.close(current.fd)
            del self._open[uid]
            current = None
        if current is not None:
            return current
        directory = open_records_directory(self.directory)
        try:
            name = f"{PREFIX}{uid}-{time.time_ns()}-{secrets.token_hex(4)}{SUFFIX}"
            fd = os.open(
                name,
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=directory,
            )
            self._prune(directory, uid, keep=name)
        finally:
            os.close(directory)
        current = self._open[uid] = _Open(fd, name, now)
        return current

    def _prune(self, directory: int, uid: int, keep: str) -> None:
        """Remove all but the newest :attr:`kept` of ``uid``'s closed files, root's only."""
        mine = f"{PREFIX}{uid}-"
        closed = []
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.startswith(mine) or entry.name == keep:
                    continue
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode) and info.st_uid == 0:
                        closed.append(entry.name)

        def opened(name: str) -> int:
            # Named when opened: ``0-books-<uid>-<time_ns>-<random>.jsonl``.
            with contextlib.suppress(ValueError, IndexError):
                return int(name[len(mine) :].split("-", 1)[0])
            return 0

        closed.sort(key=opened)
        for name in closed[: max(0, len(closed) - self.kept)]:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=directory)
