"""The claims that ended lately, machine-wide, and how long each label's runs took.

JupyterLab's panel and the ``%claims`` monitor drop a claim the moment it
ends, and a queued claim's expected wait needs to know how long the same
work took before. Both come from the usage records (:mod:`.read`), which
every claim leaves behind however it ends.

What it decides:

- **Read again only what changed.** The panel asks every few seconds and a
  monitor's ticker every second; a directory is read again only when one of
  its records files changed size or time, so an idle machine costs a
  ``stat`` of each file.
- **The directories are those ``fluksio-nb usage`` reads**
  (:func:`~.report.usage_dirs`): the user's own, and the machine's shared one
  on books every user shares. Another user's records file there is private
  to them and cannot be read: their claims are not shown, and the count of
  such files is said (``unreadable_files``).
- **A record's user is its file's owner**, as everywhere records are read.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fluksio_nb.usage.read import UsageRows, read_usage
from fluksio_nb.usage.record import SUFFIX, UsageRecord

#: How many finished claims are shown.
FINISHED = 20

#: How many of a label's latest runs its typical duration is taken from.
RUNS_PER_LABEL = 20

#: How long the list of directories is kept: finding the machine's asks its service.
DIRS_FOR_S = 60.0


def finished_entry(user: str, record: UsageRecord) -> dict[str, Any]:
    """One finished claim as ``GET fluksio/api/finished`` gives it."""
    granted = record.granted_at is not None
    return {
        "ticket": record.ticket,
        "label": record.label,
        "user": user,
        "notebook": record.notebook,
        "ending": record.ending,
        "asked_at": record.asked_at,
        "started_at": record.granted_at,
        "ended_at": record.ended_at,
        "waited_s": round(record.waited_s, 3),
        "ran_s": round(record.ran_s, 3) if granted else None,
        # A claim that never got its share used nothing: no peak, not a peak of 0.
        "peak_rss_bytes": record.peak_rss_bytes if granted else None,
        "peak_gpu_bytes": record.peak_gpu_bytes,
    }


class RecentUsage:
    """The records of some directories, read again only when a file in them changed."""

    def __init__(self, directories: Callable[[], list[Path]] | None = None) -> None:
        self._directories = directories or _usage_dirs
        self._dirs: list[Path] = []
        self._dirs_at = -float("inf")
        self._read: dict[Path, tuple[Any, UsageRows]] = {}
        self._lock = threading.Lock()

    def rows(self) -> UsageRows:
        """Every readable record, ``(user, record)``, in no particular order. Blocking."""
        with self._lock:
            now = time.monotonic()
            if now - self._dirs_at >= DIRS_FOR_S:
                self._dirs, self._dirs_at = self._directories(), now
            rows = UsageRows()
            for directory in self._dirs:
                seen = _signature(directory)
                kept = self._read.get(directory)
                if kept is None or kept[0] != seen:
                    try:
                        kept = (seen, read_usage(directory))
                    except OSError:
                        kept = (seen, UsageRows())  # not ours to list: nothing to show
                    self._read[directory] = kept
                rows.absorb(_copy(kept[1]))
            return rows

    def finished(self, limit: int = FINISHED) -> dict[str, Any]:
        """The ``limit`` claims that ended last, newest first, as the API answers."""
        rows = self.rows()
        newest = sorted(rows, key=lambda row: row[1].ended_at, reverse=True)[:limit]
        return {
            "claims": [finished_entry(user, record) for user, record in newest],
            "unreadable_files": rows.unreadable_files,
        }

    def durations(self) -> dict[str, list[float]]:
        """How long each label's latest runs held their share, newest first."""
        runs: dict[str, list[tuple[float, float]]] = {}
        for _, record in self.rows():
            if record.granted_at is not None:
                runs.setdefault(record.label, []).append((record.ended_at, record.ran_s))
        return {
            label: [ran for _, ran in sorted(found, reverse=True)[:RUNS_PER_LABEL]]
            for label, found in runs.items()
        }


def _copy(rows: UsageRows) -> UsageRows:
    copied = UsageRows(rows)
    copied.unreadable_files = rows.unreadable_files
    copied.not_plain_files = rows.not_plain_files
    copied.bad_lines = rows.bad_lines
    return copied


def _signature(directory: Path) -> Any:
    """What changes when a records file in ``directory`` is written, added or removed."""
    try:
        with os.scandir(directory) as entries:
            return sorted(
                (entry.name, info.st_size, info.st_mtime_ns)
                for entry in entries
                if entry.name.endswith(SUFFIX)
                for info in [entry.stat(follow_symlinks=False)]
            )
    except OSError:
        return None


def _usage_dirs() -> list[Path]:
    import warnings

    from fluksio_nb.usage.report import usage_dirs

    with warnings.catch_warnings():
        # A service that did not answer leaves the user's own records; the
        # panel asks again in a minute, and a warning here would go nowhere.
        warnings.simplefilter("ignore")
        return usage_dirs()


_recent: RecentUsage | None = None
_recent_lock = threading.Lock()


def process_recent_usage() -> RecentUsage:
    """This process's one reader of the recent records: the server's, or a kernel's."""
    global _recent
    with _recent_lock:
        if _recent is None:
            _recent = RecentUsage()
        return _recent
