"""Reading usage records back, from a directory where anyone may have left anything.

The report reads directories other users write into: a machine's shared
records directory holds every user's files, and any of them could have put
a link, a pipe or a gigabyte of garbage there in place of records.

What it decides:

- **A record is only as true as its file's owner.** The user a record is
  counted against is the owner of its file, as the kernel says (``fstat``),
  never a name written in it. Nobody can charge their claims to someone
  else, and a file of someone else's can only ever be counted against them.
- **Reading trusts nothing in the directory.** Links are not followed,
  pipes and devices not opened, lines that are not records skipped and
  counted, and what is read from one file is capped, so a hostile file can
  neither hang the report nor exhaust its memory. Another user's records
  are private to them (and root): they are counted as unreadable, not shown.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from fluksio_nb.identity import user_name
from fluksio_nb.usage.record import SUFFIX, UsageRecord

#: What is read of one records file at most. A kernel writes about 300 bytes
#: per claim, so this is some 200,000 claims from one process: more than any
#: real one makes, and little enough memory that a hostile file costs nothing.
READ_AT_MOST = 64 * 2**20


class UsageRows(list):
    """``(user, record)`` pairs read from records files, and what could not be read."""

    def __init__(self, rows: Iterable[tuple[str, UsageRecord]] = ()) -> None:
        super().__init__(rows)
        #: Files we may not open: another user's, private to them and root.
        self.unreadable_files = 0
        #: Entries named like records that are links, pipes or directories.
        self.not_plain_files = 0
        #: Lines that are not records: cut short by a crash, or written by hand.
        self.bad_lines = 0

    @property
    def skipped_files(self) -> int:
        return self.unreadable_files + self.not_plain_files

    def absorb(self, other: UsageRows) -> None:
        self.extend(other)
        self.unreadable_files += other.unreadable_files
        self.not_plain_files += other.not_plain_files
        self.bad_lines += other.bad_lines


def read_usage(directory: Path, since: float | None = None, user: str | None = None) -> UsageRows:
    """Every record in ``directory`` that ended at or after ``since``, of ``user`` if given.

    A directory that does not exist has no records. One that may not be
    listed raises :class:`PermissionError`.
    """
    rows = UsageRows()
    try:
        where = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return rows
    names: dict[int, str] = {}
    try:
        for name in sorted(os.listdir(where)):
            if not name.endswith(SUFFIX):
                continue
            try:
                found = os.stat(name, dir_fd=where, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(found.st_mode):
                rows.not_plain_files += 1
                continue
            if user is not None and _named(found.st_uid, names) != user:
                continue
            _read_file(where, name, since, user, names, rows)
    finally:
        os.close(where)
    return rows


def _named(uid: int, names: dict[int, str]) -> str:
    if uid not in names:
        names[uid] = user_name(uid)
    return names[uid]


def _read_file(
    where: int,
    name: str,
    since: float | None,
    user: str | None,
    names: dict[int, str],
    rows: UsageRows,
) -> None:
    try:
        # O_NONBLOCK: a pipe swapped in since the stat must not hang the report.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=where)
    except PermissionError:
        rows.unreadable_files += 1
        return
    except FileNotFoundError:
        return
    except OSError:
        # ELOOP: swapped for a link since the stat; ENXIO: a socket.
        rows.not_plain_files += 1
        return
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            rows.not_plain_files += 1
            return
        # The file as opened, not as first seen, says whose records these are.
        owner = _named(info.st_uid, names)
        if user is not None and owner != user:
            return
        data = bytearray()
        while len(data) < READ_AT_MOST:
            chunk = os.read(fd, min(2**20, READ_AT_MOST - len(data)))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    for line in bytes(data).splitlines():
        if not line.strip():
            continue
        try:
            record = UsageRecord.model_validate_json(line)
        except ValidationError:
            rows.bad_lines += 1
            continue
        if since is None or record.ended_at >= since:
            rows.append((owner, record))
