"""The claims that ended lately, machine-wide, and how long each label's runs took.

JupyterLab's panel and the ``%claims`` monitor drop a claim the moment it
ends, and a queued claim's expected wait needs to know how long the same
work took before. Both come from the usage records (:mod:`.read`), which
every claim leaves behind however it ends.

What it decides:

- **Read again only what changed.** The panel asks every few seconds and a
  monitor's ticker every second; a directory is read again only when one of
  the user's records files in it changed size or time, so an idle machine
  costs a ``stat`` of each file.
- **The directories are those ``fluksio-nb usage`` reads**
  (:func:`~.report.usage_dirs`): the user's own, and the machine's shared one
  on books every user shares.
- **Only the user's own files are read, root's included.** This runs
  unasked, in every kernel while a claim waits and in the server, and
  anyone may leave files in the shared directory: a file another user
  made readable can only have been planted, as real records are private
  to their owner. A file is read only when its owner, as the kernel says
  of the file as opened (``fstat``), is the calling user; the others are
  counted (``unreadable_files``) and never opened where the directory
  already says whose they are. Root's panel shows root's claims;
  ``fluksio-nb usage`` is where root reads everyone's.
- **What is kept and read is bounded, whatever is in the directory.** Only
  what is shown is kept: the :data:`FINISHED` claims that ended last, and
  each label's :data:`RUNS_PER_LABEL` latest runs, for at most
  :data:`LABELS` labels, those run last. A directory is read, each time,
  up to :data:`READ_AT_MOST` bytes, its newest files and their ends first,
  so what is left out is the oldest; when something is, one warning per
  process and directory says so (:class:`RecentUsageCut`).
- **A record's user is its file's owner**, as everywhere records are read.
- **Claims whose kernel was killed are finished claims too.** On books
  every user shares, the service records them in a file only root may
  read, and is asked for the user's own once a minute at most
  (:func:`~.report.own_kernel_deaths`), never waited on when busy.
"""

from __future__ import annotations

import heapq
import os
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluksio_nb.budget import human
from fluksio_nb.records import SUFFIX, UsageRecord
from fluksio_nb.usage.read import UsageRows, each_usage
from fluksio_nb.vocabulary import mark_of

if TYPE_CHECKING:
    from fluksio_nb.metrics import Tally

#: How many finished claims are shown, and kept: ``finished(limit)`` gives no more.
FINISHED = 20

#: How many of a label's latest runs its typical duration is taken from.
RUNS_PER_LABEL = 20

#: How many labels' runs are kept: those run last. A waiting claim's label is
#: nearly always one of them, or one never run before.
LABELS = 1000

#: How much of a directory's records is read, each time it is read again.
#: Some 28,000 claims at about 300 bytes each: years of one user's work, and
#: well within what a kernel can parse while its claim waits.
READ_AT_MOST = 8 * 2**20

#: How long the list of directories is kept: finding the machine's asks its service.
DIRS_FOR_S = 60.0

#: How long the claims of the user's killed kernels are kept before the service is asked again.
DEATHS_FOR_S = 60.0


class RecentUsageCut(UserWarning):
    """Older usage records were left unread: past the bytes read each time."""


def finished_entry(user: str, record: UsageRecord) -> dict[str, Any]:
    """One finished claim as ``GET fluksio/api/finished`` gives it."""
    granted = record.granted_at is not None
    return {
        "ticket": record.ticket,
        "label": record.label,
        "user": user,
        "notebook": record.notebook,
        "ending": record.ending,
        # Its colour in every view: the same mark for the same ending.
        "mark": mark_of(record.ending),
        "asked_at": record.asked_at,
        "started_at": record.granted_at,
        "ended_at": record.ended_at,
        # The figures its kernel said in the cell's record, where it wrote them:
        # one figure for each time in every view (fluksio_nb.vocabulary).
        "waited_s": round(
            record.waited_s if record.waited_for_s is None else record.waited_for_s, 3
        ),
        "ran_s": (round(record.ran_s if record.ran_for_s is None else record.ran_for_s, 3))
        if granted
        else None,
        "cpus": record.cpus,
        "gpus": record.gpus,
        "ram_bytes": record.ram_bytes,
        # The user's own records only are read here: their error line reaches them alone.
        "error": record.error,
        # A claim that never got its share used nothing: no peak, not a peak of 0.
        "peak_rss_bytes": record.peak_rss_bytes if granted else None,
        "peak_gpu_bytes": record.peak_gpu_bytes,
    }


class RecentUsage:
    """The records of some directories, read again only when a file in them changed."""

    def __init__(
        self,
        directories: Callable[[], list[Path]] | None = None,
        deaths: Callable[[], list[tuple[str, UsageRecord]]] | None = None,
    ) -> None:
        self._directories = directories or _usage_dirs
        #: The claims of the user's killed kernels, where only the books service reads them.
        self._ask_deaths = deaths or (_service_deaths if directories is None else list)
        self._dirs: list[Path] = []
        self._dirs_at = -float("inf")
        self._deaths: list[tuple[str, UsageRecord]] = []
        self._deaths_at = -float("inf")
        self._read: dict[Path, tuple[Any, _Kept]] = {}
        self._lock = threading.Lock()
        #: Whether the records are added up for the metrics too: only once
        #: someone asks (the server), never in a kernel, which serves none.
        self._tallied = False

    def _kept(self) -> tuple[list[_Kept], int]:
        """What each directory's records leave, read again where a file changed. Blocking.

        And how many files of other users the directories hold, not read.
        """
        with self._lock:
            now = time.monotonic()
            if now - self._dirs_at >= DIRS_FOR_S:
                self._dirs, self._dirs_at = self._directories(), now
            kept: list[_Kept] = []
            others = 0
            for directory in self._dirs:
                seen, theirs = _signature(directory)
                others += theirs
                found = self._read.get(directory)
                if found is None or found[0] != seen:
                    found = self._read[directory] = (
                        seen,
                        _read_directory(directory, self._tallied),
                    )
                kept.append(found[1])
            return kept, others

    def finished(self, limit: int = FINISHED) -> dict[str, Any]:
        """The ``limit`` (at most :data:`FINISHED`) claims that ended last, newest first."""
        kept, others = self._kept()
        deaths = [
            (record.ended_at, -n, user, record) for n, (user, record) in enumerate(self._died())
        ]
        newest = heapq.nlargest(
            min(limit, FINISHED),
            [*(entry for one in kept for entry in one.finished), *deaths],
            key=lambda entry: entry[0],
        )
        return {
            "claims": [finished_entry(user, record) for _, _, user, record in newest],
            # Others' files as listed now, and any of the user's own that could not be opened.
            "unreadable_files": others + sum(one.counts.unreadable_files for one in kept),
        }

    def _died(self) -> list[tuple[str, UsageRecord]]:
        """The claims of the user's killed kernels, as last heard; asked again once a minute."""
        with self._lock:
            now = time.monotonic()
            if now - self._deaths_at >= DEATHS_FOR_S:
                self._deaths_at = now
                self._deaths = self._ask_deaths()
            return self._deaths

    def tally(self) -> Tally:
        """The user's claims that ended, added up for the metrics (:mod:`fluksio_nb.metrics`).

        From what :meth:`finished` reads: the user's own records, the newest
        :data:`READ_AT_MOST` of each directory, and their killed kernels' as
        the books service last said them.
        """
        from fluksio_nb.metrics import Tally

        with self._lock:
            if not self._tallied:
                # Read again, added up this time.
                self._tallied = True
                self._read.clear()
        total = Tally()
        for one in self._kept()[0]:
            if one.tally is not None:
                total.merge(one.tally)
        for user, record in self._died():
            total.add_record(user, record)
        return total

    def durations(self) -> dict[str, list[float]]:
        """How long each label's latest runs held their share, newest first."""
        return _newest_runs(one.runs for one in self._kept()[0])

    def shapes(self) -> dict[tuple[int, int], list[float]]:
        """How long the latest runs of each shape (cpus, cards) held their share, newest first.

        What an expected wait falls back on for a label never run here before.
        """
        return _newest_runs(one.shape_runs for one in self._kept()[0])

    def past_runs(self) -> tuple[dict[str, list[float]], dict[tuple[int, int], list[float]]]:
        """:meth:`durations` and :meth:`shapes` from one look at the directories."""
        kept = self._kept()[0]
        return _newest_runs(one.runs for one in kept), _newest_runs(one.shape_runs for one in kept)


def _newest_runs(
    maps: Iterable[Mapping[Any, list[tuple[float, float]]]],
) -> dict[Any, list[float]]:
    """Each key's :data:`RUNS_PER_LABEL` latest run times over every directory's map
    (by label, or by shape), newest first."""
    runs: dict[Any, list[tuple[float, float]]] = {}
    for one in maps:
        for key, found in one.items():
            runs.setdefault(key, []).extend(found)
    return {
        key: [ran for _, ran in sorted(found, reverse=True)[:RUNS_PER_LABEL]]
        for key, found in runs.items()
    }


class _Kept:
    """What one directory's records leave that is shown: the last finished, each label's runs."""

    def __init__(self, tallied: bool = False) -> None:
        #: The :data:`FINISHED` that ended last: ``(ended_at, n, user, record)``, a heap.
        self.finished: list[tuple[float, int, str, UsageRecord]] = []
        #: Each label's :data:`RUNS_PER_LABEL` latest runs: ``(ended_at, ran_s)``, a heap.
        self.runs: dict[str, list[tuple[float, float]]] = {}
        #: The same of each shape, ``(cpus, cards)``, for at most :data:`LABELS` shapes.
        self.shape_runs: dict[tuple[int, int], list[tuple[float, float]]] = {}
        #: What was not read, and why.
        self.counts = UsageRows()
        #: Every record read, added up for the metrics, if asked.
        self.tally: Tally | None = None
        if tallied:
            from fluksio_nb.metrics import Tally

            self.tally = Tally()
        self._n = 0

    def __len__(self) -> int:
        """How many records are kept."""
        return len(self.finished) + sum(len(found) for found in self.runs.values())

    def add(self, user: str, record: UsageRecord) -> None:
        self._n += 1
        if self.tally is not None:
            self.tally.add_record(user, record)
        _keep(self.finished, (record.ended_at, self._n, user, record), FINISHED)
        if record.granted_at is not None:
            _keep(
                self.runs.setdefault(record.label, []),
                (record.ended_at, record.ran_s),
                RUNS_PER_LABEL,
            )
            if len(self.runs) > 2 * LABELS:
                self.trim()
            shape = (record.cpus, len(record.gpus))
            if shape in self.shape_runs or len(self.shape_runs) < LABELS:
                _keep(
                    self.shape_runs.setdefault(shape, []),
                    (record.ended_at, record.ran_s),
                    RUNS_PER_LABEL,
                )

    def trim(self) -> None:
        """Keep the :data:`LABELS` labels run last."""
        if len(self.runs) > LABELS:
            last = heapq.nlargest(LABELS, self.runs, key=lambda label: max(self.runs[label]))
            self.runs = {label: self.runs[label] for label in last}


def _keep(heap: list, entry: Any, most: int) -> None:
    """Add ``entry`` to the min-heap ``heap``, which keeps its ``most`` largest."""
    if len(heap) < most:
        heapq.heappush(heap, entry)
    else:
        heapq.heappushpop(heap, entry)


#: The directories a warning was given for, in this process.
_warned: set[Path] = set()


def _read_directory(directory: Path, tallied: bool = False) -> _Kept:
    kept = _Kept(tallied)
    try:
        for user, record in each_usage(
            directory, kept.counts, owner=os.geteuid(), at_most=READ_AT_MOST
        ):
            kept.add(user, record)
    except OSError:
        return _Kept()  # not ours to list: nothing to show
    kept.trim()
    if kept.counts.files_cut and directory not in _warned:
        _warned.add(directory)
        warnings.warn(
            f"fluksio_nb read only the newest {human(READ_AT_MOST)} of your usage "
            f"records in {directory}; older claims are left out of the finished claims and "
            "the expected waits. `fluksio-nb usage` still counts them all.",
            RecentUsageCut,
            stacklevel=2,
        )
    return kept


def _signature(directory: Path) -> tuple[Any, int]:
    """What changes when one of the user's records files is written, added or removed.

    And how many files of other users there are, not read: whatever happens
    to those changes nothing that is shown but their number.
    """
    me = os.geteuid()
    mine: list[tuple[str, int, int]] = []
    others = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if not entry.name.endswith(SUFFIX):
                    continue
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == me:
                    mine.append((entry.name, info.st_size, info.st_mtime_ns))
                elif stat.S_ISREG(info.st_mode):
                    others += 1
    except OSError:
        return None, 0
    return sorted(mine), others


def _usage_dirs() -> list[Path]:
    import warnings

    from fluksio_nb.usage.report import usage_dirs

    with warnings.catch_warnings():
        # A service that did not answer leaves the user's own records; the
        # panel asks again in a minute, and a warning here would go nowhere.
        warnings.simplefilter("ignore")
        return usage_dirs()


def _service_deaths() -> list[tuple[str, UsageRecord]]:
    from fluksio_nb.usage.report import own_kernel_deaths

    try:
        # Not waited for: the panel asks again in a minute.
        return own_kernel_deaths(None, patience=0)[0]
    except Exception:
        # What the service could not say is left out; the panel never fails for it.
        return []


_recent: RecentUsage | None = None
_recent_lock = threading.Lock()


def process_recent_usage() -> RecentUsage:
    """This process's one reader of the recent records: the server's, or a kernel's."""
    global _recent
    with _recent_lock:
        if _recent is None:
            _recent = RecentUsage()
        return _recent
