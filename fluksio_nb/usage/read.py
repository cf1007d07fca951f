"""Reading usage records back, from a directory where anyone may have left anything.

The report reads directories other users write into: a machine's shared
records directory holds every user's files, and any of them could have put
a link, a pipe or a gigabyte of garbage there in place of records.

What it decides:

- **A record is only as true as its file's owner.** The user a record is
  counted against is the owner of its file, as the kernel says (``fstat``),
  never a name written in it. Nobody can charge their claims to someone
  else, and a file of someone else's can only ever be counted against them.
  The one exception is a file root owns: the books service writes there
  the records of every user's killed kernels, each with its owner's uid
  (``uid``), which only root could have written. A ``uid`` in anyone
  else's file is the file owner's word, and ignored.
- **A file is read once, whatever its names.** A hard link to another
  user's file would count their claims twice.
- **Reading trusts nothing in the directory.** Links are not followed,
  pipes and devices not opened, lines that are not records skipped and
  counted by why (:attr:`UsageRows.bad_reasons`), so a hostile file can
  neither hang the report nor exhaust its memory. Another user's records
  are private to them (and root): they are counted as unreadable, not shown.
- **No line is left unread unless the reader asked for a budget.** A whole
  file is read however long, a piece at a time: a limit that silently
  dropped a file's end let one user's volume hide another's later records.
- **Records are handed on as they are read, never all held at once**
  (:func:`each_usage`): a file is read a piece at a time, and a line longer
  than any record is a bad line, so what is held while reading does not
  grow with the number or size of the files; whoever adds the records up
  keeps only the sums. :func:`read_usage` keeps them all, for the few that
  want a list.
- **A reader may ask for only its own files, and at most so many bytes**
  (``owner``, ``at_most``): the readers that run unasked, in every kernel
  and server, read no file another user could have planted, and the newest
  files first, the end of a file first, so what a budget leaves out is the
  oldest. What was left out is counted (``files_cut``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import ValidationError

from fluksio_nb.identity import user_name
from fluksio_nb.records import KERNEL_DIED, SUFFIX, UsageRecord
from fluksio_nb.stop_button import open_whole

#: The longest line read as a record. A real one is some 300 bytes, a few
#: KiB with the longest notebook path; a longer line is a bad one, never held.
LINE_AT_MOST = 64 * 2**10

#: How much of a file is read at a time.
_CHUNK = 2**18


class UsageRows(list):
    """``(user, record)`` pairs read from records files, and what could not be read."""

    def __init__(self, rows: Iterable[tuple[str, UsageRecord]] = ()) -> None:
        super().__init__(rows)
        #: Files we may not open: another user's, private to them and root.
        self.unreadable_files = 0
        #: Other users' files, not opened by a reader of its own (``owner``).
        self.others_files = 0
        #: Entries named like records that are links, pipes or directories.
        self.not_plain_files = 0
        #: Lines that are not records: cut short by a crash, or written by hand.
        self.bad_lines = 0
        #: Those lines by why they are not records (:func:`why_not_a_record`).
        self.bad_reasons: dict[str, int] = {}
        #: Files left unread, or read only in part, for a reader's byte budget.
        self.files_cut = 0
        #: Records of claims the books service kept no account of, though it kept
        #: them then: edited or made up by their owner (:func:`witnessed`).
        self.not_seen_by_service = 0
        #: Records from before the service's oldest account, counted on their owner's word.
        self.before_service = 0

    def bad_line(self, why: str) -> None:
        self.bad_lines += 1
        self.bad_reasons[why] = self.bad_reasons.get(why, 0) + 1

    @property
    def skipped_files(self) -> int:
        return self.unreadable_files + self.not_plain_files

    def absorb(self, other: UsageRows) -> None:
        self.extend(other)
        self.absorb_counts(other)

    def absorb_counts(self, other: UsageRows) -> None:
        """Add ``other``'s counts of what was not read, not its rows."""
        self.unreadable_files += other.unreadable_files
        self.not_plain_files += other.not_plain_files
        self.bad_lines += other.bad_lines
        for why, count in other.bad_reasons.items():
            self.bad_reasons[why] = self.bad_reasons.get(why, 0) + count
        self.others_files += other.others_files
        self.files_cut += other.files_cut
        self.not_seen_by_service += other.not_seen_by_service
        self.before_service += other.before_service


def read_usage(directory: Path, since: float | None = None, user: str | None = None) -> UsageRows:
    """Every record in ``directory`` that ended at or after ``since``, of ``user`` if given.

    A directory that does not exist has no records. One that may not be
    listed raises :class:`PermissionError`. All are kept: what adds them up
    as they are read uses :func:`each_usage`.
    """
    rows = UsageRows()
    rows.extend(each_usage(directory, rows, since=since, user=user))
    return rows


def each_usage(
    directory: Path,
    counts: UsageRows,
    *,
    since: float | None = None,
    user: str | None = None,
    owner: int | None = None,
    at_most: int | None = None,
    written_for: int | None = None,
) -> Iterator[tuple[str, UsageRecord]]:
    """The records of :func:`read_usage`, one at a time; what was not read goes in ``counts``.

    ``owner``: read only the files of this uid; others' are counted
    (``others_files``), unopened where the directory already says whose
    they are. Of root's files, only root's own records, unless
    ``written_for`` names the user whose records root wrote are wanted.
    ``at_most``: read no more than this many bytes in all, newest files
    first and each file's end first; the files are sorted, so it goes with
    ``owner``, which keeps that list to one user's.

    A directory that does not exist has no records. One that may not be
    listed raises :class:`PermissionError`, before the first record.
    """
    where: int | None = None
    names: dict[int, str] = {}
    read: set[tuple[int, int]] = set()
    try:
        try:
            where = open_whole(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        found: Iterable[tuple[int, str]] = _records_files(where, counts, user, owner, names)
        if at_most is not None:
            # The newest first: what a budget leaves out is the oldest.
            found = sorted(found, reverse=True)
        left = at_most
        for _, name in found:
            if left is not None and left <= 0:
                counts.files_cut += 1
                continue
            file = _File(where, name, since, user, owner, names, counts, left, read, written_for)
            yield from file.records()
            if left is not None:
                left -= file.read
    finally:
        if where is not None:
            os.close(where)


#: ``written_for``: root's files' records of every user, not only root's own.
EVERY_UID = -1


def witnessed(
    directory: Path, counts: UsageRows, *, since: float | None = None, user: str | None = None
) -> Iterator[tuple[str, UsageRecord]]:
    """Each claim in ``directory``, counted as the books service saw it, where it kept an account.

    The service's account (root's files, :mod:`fluksio_nb.machine.accounts`)
    says who held what and when; a kernel's own record of the same claim
    (the same user, ticket and time asked) adds its label, notebook, peaks
    and how its cell ended, and nothing else. So a user who deletes or edits
    their records changes at most those: a record of theirs the service has
    no account of, from the time it kept accounts, is not counted
    (``not_seen_by_service``); one from before is counted on their word, and
    said (``before_service``). A reader who may not read root's files (any
    user but root) reads every record as :func:`each_usage` does.

    Reads the directory twice, and holds the service's accounts (bounded per
    user by their rotation) while it does.
    """
    seen: dict[tuple[str, int | None, float], UsageRecord] = {}
    covered_from = float("inf")
    for name, record in each_usage(
        directory, UsageRows(), since=since, user=user, owner=0, written_for=EVERY_UID
    ):
        if record.by_service:
            seen[(name, record.ticket, record.asked_at)] = record
            covered_from = min(covered_from, record.asked_at)
    for name, record in each_usage(directory, counts, since=since, user=user):
        if record.by_service:
            continue
        account = seen.pop((name, record.ticket, record.asked_at), None)
        if account is not None:
            said = {"label": record.label, "ending": record.ending}
            said.update(peak_rss_bytes=record.peak_rss_bytes, peak_gpu_bytes=record.peak_gpu_bytes)
            if record.notebook is not None:
                said["notebook"] = record.notebook
            yield name, account.model_copy(update=said)
        elif record.asked_at >= covered_from:
            counts.not_seen_by_service += 1
        else:
            if seen or covered_from != float("inf"):
                counts.before_service += 1
            yield name, record
    for (name, _, _), record in seen.items():
        yield name, record


#: The most the books service reads of its files for one user's killed kernels.
DEATHS_READ_AT_MOST = 16 * 2**20


def kernel_deaths(
    directory: Path, uid: int, since: float | None = None, most: int = 1000
) -> tuple[list[UsageRecord], int]:
    """The records the books service wrote for ``uid``'s killed kernels: the newest ``most``.

    Read by the service, which alone may read its files, for that user to
    see their own. Only root's files are opened; the newest are read first,
    16 MiB at most. Returns the records, newest first, and how many more
    there were.
    """
    rows = UsageRows()
    found = [
        record
        # Root's files hold every claim the service saw end; the killed are asked for.
        for _, record in each_usage(
            directory,
            rows,
            since=since,
            owner=0,
            at_most=DEATHS_READ_AT_MOST,
            written_for=uid,
        )
        if record.ending == KERNEL_DIED
    ]
    found.sort(key=lambda record: record.ended_at, reverse=True)
    return found[:most], max(0, len(found) - most)


def _records_files(
    where: int, counts: UsageRows, user: str | None, owner: int | None, names: dict[int, str]
) -> Iterator[tuple[int, str]]:
    """``(mtime, name)`` of each plain file named like records, as the directory is listed.

    Listed as it goes, never all at once: a directory of a million empty
    files costs a ``stat`` of each, not a list of their names.
    """
    with os.scandir(where) as entries:
        for entry in entries:
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                seen = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(seen.st_mode):
                counts.not_plain_files += 1
                continue
            if owner is not None and seen.st_uid != owner:
                counts.others_files += 1
                continue
            # Root's file may hold anyone's records: whose, each record says.
            if user is not None and seen.st_uid != 0 and _named(seen.st_uid, names) != user:
                continue
            yield seen.st_mtime_ns, entry.name


def _named(uid: int, names: dict[int, str]) -> str:
    if uid not in names:
        names[uid] = user_name(uid)
    return names[uid]


class _File:
    """One records file, opened and read a piece at a time; ``read`` is the bytes it read."""

    def __init__(
        self,
        where: int,
        name: str,
        since: float | None,
        user: str | None,
        owner: int | None,
        names: dict[int, str],
        counts: UsageRows,
        left: int | None,
        files_read: set[tuple[int, int]],
        written_for: int | None = None,
    ) -> None:
        self.where, self.name, self.since, self.user, self.owner = where, name, since, user, owner
        self.names, self.counts, self.left = names, counts, left
        self.files_read = files_read
        self.read = 0
        #: In root's files, whose records root wrote are wanted; by default, the owner's.
        self.written_for = written_for

    def records(self) -> Iterator[tuple[str, UsageRecord]]:
        counts = self.counts
        fd: int | None = None
        try:
            try:
                # O_NONBLOCK: a pipe swapped in since the stat must not hang the report.
                fd = open_whole(
                    self.name,
                    os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                    dir_fd=self.where,
                )
            except PermissionError:
                counts.unreadable_files += 1
                return
            except FileNotFoundError:
                return
            except OSError:
                # ELOOP: swapped for a link since the stat; ENXIO: a socket.
                counts.not_plain_files += 1
                return
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                counts.not_plain_files += 1
                return
            if (info.st_dev, info.st_ino) in self.files_read:
                return
            self.files_read.add((info.st_dev, info.st_ino))
            # The file as opened, not as first seen, says whose records these are.
            if self.owner is not None and info.st_uid != self.owner:
                counts.others_files += 1
                return
            theirs = info.st_uid != 0 and self.user is not None
            if theirs and _named(info.st_uid, self.names) != self.user:
                return
            for line in self._lines(fd, info.st_size):
                record = _parsed(line, counts)
                if record is None or (self.since is not None and record.ended_at < self.since):
                    continue
                if bool(record.by_service) != (info.st_uid == 0 and record.uid is not None):
                    # Only the service writes root's records of users' claims, and
                    # nobody else's word that the service saw a claim is believed.
                    record = record.model_copy(update={"by_service": not record.by_service})
                whose = _whose(record, info.st_uid)
                wanted = self.owner if self.written_for is None else self.written_for
                if self.written_for == EVERY_UID:
                    wanted = None
                if info.st_uid == 0 and wanted is not None and whose != wanted:
                    continue
                owner = _named(whose, self.names)
                if self.user is None or owner == self.user:
                    yield owner, record
        finally:
            if fd is not None:
                os.close(fd)

    def _lines(self, fd: int, size: int) -> Iterator[bytes]:
        """The file's lines, never one longer than :data:`LINE_AT_MOST` held."""
        # No budget, no limit: read a piece at a time, a file of any length
        # costs no more memory than a short one. To its length when opened: a
        # file its owner keeps appending to cannot keep the report reading.
        budget = size if self.left is None else self.left
        offset = 0
        if size > budget:
            # More than the budget leaves: its end, where the newest records are.
            offset = size - budget
            self.counts.files_cut += 1
        partial = b""
        # Begun mid-line, the first line is the end of one not read: not a record.
        skipping = offset > 0 and os.pread(fd, 1, offset - 1) != b"\n"
        while self.read < budget:
            chunk = os.pread(fd, min(_CHUNK, budget - self.read), offset + self.read)
            if not chunk:
                break
            self.read += len(chunk)
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                if skipping:
                    skipping = False
                    continue
                if len(line) > LINE_AT_MOST:
                    self.counts.bad_line(TOO_LONG)
                elif line.strip():
                    yield line
            if len(partial) > LINE_AT_MOST:
                # Too long to be a record: dropped, and the rest of it with it.
                if not skipping:
                    self.counts.bad_line(TOO_LONG)
                skipping = True
                partial = b""
        if partial.strip() and not skipping:
            yield partial


def _whose(record: UsageRecord, file_owner: int) -> int:
    """The uid a record counts against: its file's owner, unless root wrote it for someone."""
    if file_owner == 0 and record.uid is not None:
        return record.uid
    return file_owner


#: Why a line is not a record, as the report says it.
TOO_LONG = "longer than any record"
NOT_JSON = "not a JSON object (cut short by a crash, or not written by fluksio_nb)"
OUT_OF_RANGE = "a figure out of range (a time no clock shows, more than a machine has)"
MISSING = "a field a record must have is missing"
WRONG_TYPE = "a field of the wrong type"


def why_not_a_record(error: ValidationError) -> str:
    """The first thing wrong with a line, in the report's words."""
    kind = error.errors(include_url=False)[0]["type"]
    if kind.startswith("json") or kind == "model_type":
        return NOT_JSON
    if kind == "missing":
        return MISSING
    if kind in ("less_than_equal", "greater_than_equal", "finite_number", "too_long"):
        return OUT_OF_RANGE
    return WRONG_TYPE


def _parsed(line: bytes, counts: UsageRows) -> UsageRecord | None:
    try:
        return UsageRecord.model_validate_json(line)
    except ValidationError as error:
        counts.bad_line(why_not_a_record(error))
        return None
