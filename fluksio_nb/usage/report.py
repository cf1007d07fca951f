"""``fluksio-nb usage``: the records added up per user and notebook, as a table, JSON or CSV.

The questions are a cluster's ``sacct``'s: who ran what, how many core-hours
and card-hours it took, how much memory it peaked at, and how long people
waited for their share. The report answers them from the records alone, in a
terminal, and makes no claims of its own.

What it decides:

- **One row per user and notebook**, with a total for each user who used
  several notebooks. Times and hours add up; peak memory, and peak card
  memory, is the largest any one claim reached.
- **What could not be read is said**, not silently left out: other users'
  files, entries that are not plain files, and lines that are not records.
- **By default, the user's own records and the machine's**: their own
  directory, and on a machine whose books every user shares, the records
  directory its service names, and the records the service wrote, in a
  file of root's, for the user's kernels that were killed, which it reads
  for them (:func:`own_kernel_deaths`).
- **Added up as they are read, in memory no user can grow at will.** No
  record is kept once counted. Notebook names and endings are written by
  the records' owner, so a user's rows are told apart by at most
  :data:`NOTEBOOKS_AT_MOST` notebooks (and their names by at most
  :data:`NOTEBOOK_NAMES_AT_MOST` bytes) and :data:`ENDINGS_AT_MOST` endings;
  the claims of any more are added up under ``(other notebooks)`` and
  ``(other)``, so root's report of everyone stays small whatever one user
  wrote, and still counts every claim.
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import sys
import time
import warnings
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fluksio_nb.budget import human
from fluksio_nb.identity import user_name
from fluksio_nb.records import UsageRecord, default_usage_dir
from fluksio_nb.shown import json_safe, shown
from fluksio_nb.usage.export import report_csv, report_json
from fluksio_nb.usage.read import UsageRows, witnessed

#: The most notebooks one user's rows are told apart by. A real user has
#: tens; the claims of any more are added up in one row, :data:`OTHER_NOTEBOOKS`.
NOTEBOOKS_AT_MOST = 1000
#: The most bytes of one user's notebook names kept, for the same reason.
NOTEBOOK_NAMES_AT_MOST = 2**20
OTHER_NOTEBOOKS = "(other notebooks)"
#: The most ways one user's claims are said to have ended: there are eight.
ENDINGS_AT_MOST = 20
OTHER_ENDING = "(other)"

# -- adding up -----------------------------------------------------------------


def _totals(**keys: Any) -> dict[str, Any]:
    return {
        **keys,
        "claims": 0,
        "core_hours": 0.0,
        "card_hours": 0.0,
        "peak_rss_bytes": None,
        "peak_gpu_bytes": None,
        "waited_s": 0.0,
        "ran_s": 0.0,
        "endings": {},
    }


def _add(into: dict[str, Any], part: dict[str, Any]) -> None:
    into["claims"] += part["claims"]
    for name in ("core_hours", "card_hours", "waited_s", "ran_s"):
        into[name] += part[name]
    # A peak nobody knew (a killed kernel's) is no peak, not a peak of 0.
    for name in ("peak_rss_bytes", "peak_gpu_bytes"):
        if part[name] is not None:
            into[name] = max(into[name] or 0, part[name])
    for ending, count in part["endings"].items():
        into["endings"][ending] = into["endings"].get(ending, 0) + count


def _one(record: UsageRecord) -> dict[str, Any]:
    return {
        "claims": 1,
        "core_hours": record.core_hours,
        "card_hours": record.card_hours,
        "peak_rss_bytes": record.peak_rss_bytes,
        "peak_gpu_bytes": record.peak_gpu_bytes,
        "waited_s": record.waited_s,
        "ran_s": record.ran_s,
        "endings": {record.ending: 1},
    }


def summarise(rows: Iterable[tuple[str, UsageRecord]]) -> list[dict[str, Any]]:
    """One row per user and notebook: claims, core- and card-hours, peak memory, time waited.

    Peak memory (and peak card memory) is the largest any one claim reached;
    times and hours add up. A row whose cards nobody read has no card peak,
    and one whose every claim's kernel was killed no peak memory.
    ``rows`` is read once, and none of it kept.
    """
    summary = _Summary()
    summary.add(rows)
    return summary.rows()


class _Summary:
    """The rows of :func:`summarise`, added to as records are read."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str | None], dict[str, Any]] = {}
        #: Per user: how many notebooks, and how many bytes of their names, are kept.
        self._notebooks: dict[str, list[int]] = {}
        #: Per user: the endings told apart.
        self._endings: dict[str, set[str]] = {}

    def add(self, rows: Iterable[tuple[str, UsageRecord]]) -> None:
        for user, record in rows:
            part = _one(record)
            part["endings"] = {self._ending(user, record.ending): 1}
            _add(self._row(user, record.notebook), part)

    def rows(self) -> list[dict[str, Any]]:
        return [self._groups[key] for key in sorted(self._groups, key=_by_user_then_notebook)]

    def _row(self, user: str, notebook: str | None) -> dict[str, Any]:
        row = self._groups.get((user, notebook))
        if row is not None:
            return row
        kept = self._notebooks.setdefault(user, [0, 0])
        size = len(notebook or "")
        if kept[0] >= NOTEBOOKS_AT_MOST or kept[1] + size > NOTEBOOK_NAMES_AT_MOST:
            notebook = OTHER_NOTEBOOKS
            row = self._groups.get((user, notebook))
            if row is not None:
                return row
        else:
            kept[0] += 1
            kept[1] += size
        row = self._groups[(user, notebook)] = _totals(user=user, notebook=notebook)
        return row

    def _ending(self, user: str, ending: str) -> str:
        kept = self._endings.setdefault(user, set())
        if ending not in kept:
            if len(kept) >= ENDINGS_AT_MOST:
                return OTHER_ENDING
            kept.add(ending)
        return ending


def _by_user_then_notebook(key: tuple[str, str | None]) -> tuple[str, bool, str]:
    user, notebook = key
    return (user, notebook is None, notebook or "")


def user_totals(summary: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary's rows added up per user, with how many notebooks each used."""
    users: dict[str, dict[str, Any]] = {}
    for row in summary:
        total = users.get(row["user"])
        if total is None:
            total = users[row["user"]] = _totals(user=row["user"], notebooks=0)
        total["notebooks"] += 1
        _add(total, row)
    return [users[name] for name in sorted(users)]


# -- telling -------------------------------------------------------------------


def _span(seconds: float) -> str:
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _endings(endings: dict[str, int]) -> str:
    return ", ".join(f"{count} {shown(ending)}" for ending, count in sorted(endings.items()))


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def describe_usage(summary: list[dict[str, Any]], skipped: int = 0, **unread: Any) -> str:
    """The summary as a table, a total for each user with several notebooks, and what was not read.

    ``skipped`` and ``unread`` say what was not read, as :func:`not_read` takes
    them. Names and endings are their records' owners' words,
    shown escaped (:func:`~fluksio_nb.shown.shown`): a newline in a notebook's
    name would otherwise print a row of its own.
    """
    lines: list[str] = []
    if summary:
        header = [
            "USER",
            "NOTEBOOK",
            "CLAIMS",
            "CORE-H",
            "CARD-H",
            "PEAK RSS",
            "PEAK GPU",
            "WAITED",
            "RAN",
            "ENDINGS",
        ]
        table = [header]
        totals = {total["user"]: total for total in user_totals(summary)}
        for index, row in enumerate(summary):
            table.append(_cells(row, row["user"], row["notebook"] or "-"))
            last_of_user = index + 1 == len(summary) or summary[index + 1]["user"] != row["user"]
            if last_of_user and totals[row["user"]]["notebooks"] > 1:
                table.append(_cells(totals[row["user"]], row["user"], "(all notebooks)"))
        widths = [max(len(cells[i]) for cells in table) for i in range(len(header))]
        for cells in table:
            # Names left, numbers right, how the claims ended last, as it is ragged.
            text = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
            text += [cell.rjust(width) for cell, width in zip(cells[2:9], widths[2:9], strict=True)]
            lines.append("  ".join(text + cells[9:]).rstrip())
    else:
        lines.append("No claims recorded.")
    lines += not_read(skipped, **unread)
    return "\n".join(lines)


def not_read(
    skipped: int = 0,
    *,
    not_plain: int = 0,
    bad_lines: int = 0,
    bad_reasons: dict[str, int] | None = None,
    files_cut: int = 0,
    not_seen_by_service: int = 0,
    before_service: int = 0,
) -> list[str]:
    """What the report did not count, and why, a sentence each.

    ``skipped`` counts other users' files that could not be read; ``bad_reasons``
    says why the ``bad_lines`` were skipped, ``files_cut`` how many files were
    read only in part.
    """
    lines: list[str] = []
    if skipped:
        lines.append(
            f"{_plural(skipped, 'file', 'files')} of other users "
            f"{'is' if skipped == 1 else 'are'} not readable: records are private to their "
            "owner and root."
        )
    if not_plain:
        lines.append(
            f"{_plural(not_plain, 'entry', 'entries')} named like records "
            f"{'is' if not_plain == 1 else 'are'} not a plain file (a link, a pipe) and "
            f"{'was' if not_plain == 1 else 'were'} not read."
        )
    if bad_lines:
        why = "; ".join(
            f"{count} {reason}"
            for reason, count in sorted((bad_reasons or {}).items(), key=lambda item: -item[1])
        )
        lines.append(
            f"{_plural(bad_lines, 'line', 'lines')} that {'is' if bad_lines == 1 else 'are'} "
            f"not a usage record {'was' if bad_lines == 1 else 'were'} skipped"
            + (f": {why}." if why else " (cut short by a crash, or not written by fluksio_nb).")
        )
    if files_cut:
        lines.append(
            f"{_plural(files_cut, 'file was', 'files were')} read only in part, or not at all, "
            "for a limit on how much is read: their oldest records are not counted."
        )
    if not_seen_by_service:
        lines.append(
            f"{_plural(not_seen_by_service, 'record', 'records')} of claims the books service "
            "never saw, though it kept its account then, "
            f"{'was' if not_seen_by_service == 1 else 'were'} not counted: edited or made up "
            "by their owner."
        )
    if before_service:
        lines.append(
            f"{_plural(before_service, 'claim', 'claims')} from before the books service's oldest "
            "account kept "
            + ("is" if before_service == 1 else "are")
            + " counted on their owner's word."
        )
    return lines


def _cells(row: dict[str, Any], user: str, notebook: str) -> list[str]:
    return [
        shown(user),
        shown(notebook),
        str(row["claims"]),
        f"{row['core_hours']:.2f}",
        f"{row['card_hours']:.2f}",
        human(row["peak_rss_bytes"]),
        human(row["peak_gpu_bytes"]),
        _span(row["waited_s"]),
        _span(row["ran_s"]),
        _endings(row["endings"]),
    ]


# -- the command ---------------------------------------------------------------


class BadSince(ValueError):
    """``--since`` is neither a date nor a span back from now."""


_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_SPAN_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """``--since`` as a ``time.time()``: an ISO date or time (local unless it says), or ``7d``."""
    span = _SPAN.match(text)
    if span:
        now = time.time() if now is None else now
        return now - float(span.group(1)) * _SPAN_SECONDS[span.group(2)]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise BadSince(
            f"--since {text!r} is neither a date nor a span: give a date or time like "
            "2026-11-30 or 2026-11-30T12:00, or a span back from now like 90m, 24h or 7d"
        ) from None


def usage_dirs() -> list[Path]:
    """The directories ``fluksio-nb usage`` reads when given no ``--dir``.

    The user's own, and on a machine whose books every user shares, the
    machine's records directory, as its service names it. No accountant is
    made: a terminal makes no claims.
    """
    from fluksio_nb.errors import ServiceUnavailable
    from fluksio_nb.kernel import books_in_force
    from fluksio_nb.machine.connection import ask_once
    from fluksio_nb.machine.setup import records_beside

    dirs = [default_usage_dir()]
    books = books_in_force()
    # A user's own service writes its records into the user's own directory.
    found = books.socket if books.mode == "machine" else None
    if found is not None:
        try:
            records = ask_once(found, {"op": "snapshot"})["welcome"].get("records")
        except (ServiceUnavailable, OSError) as error:
            # The records are files, there whether the service answers or not:
            # where `machine init` put them beside the run directory.
            records = records_beside(found)
            warnings.warn(
                f"the machine's books service does not answer ({error}); its usage records "
                + (f"were read from {records}" if records else "were not read")
                + (
                    ""
                    if os.geteuid() == 0
                    else ", but not those of your kernels that were killed, which only it may read"
                ),
                UsageServiceDown,
                stacklevel=2,
            )
        if records:
            dirs.insert(0, Path(records))
    return dirs


#: How long ``fluksio-nb usage`` waits for a books service busy reading records for others.
DEATHS_WAITED_AT_MOST_S = 10.0


def own_kernel_deaths(
    since: float | None, patience: float = DEATHS_WAITED_AT_MOST_S
) -> tuple[list[tuple[str, UsageRecord]], list[str]]:
    """This user's claims whose kernel was killed, as the machine's books service recorded them.

    The service writes those records into a file of root's, private like
    every records file, and reads a user's own for them. There are none
    where no service keeps the books; root reads them in the directory.
    A service busy reading for others is asked again for ``patience``
    seconds at most. Returns the rows, and what was left out, said.
    """
    from fluksio_nb.errors import ServiceUnavailable
    from fluksio_nb.kernel import books_in_force
    from fluksio_nb.machine.connection import ask_once

    books = books_in_force()
    # A user's own service records their killed kernels' claims in their own directory.
    found = books.socket if books.mode == "machine" else None
    if found is None or os.geteuid() == 0:
        return [], []
    not_counted = "the claims of your kernels that were killed are not counted"
    deadline = time.monotonic() + patience
    try:
        while True:
            answer = ask_once(found, {"op": "kernel_deaths", "since": since})
            # Busy reading for someone else: it says when to ask again.
            again = answer.get("retry_in")
            if not isinstance(again, (int, float)) or time.monotonic() + again > deadline:
                break
            time.sleep(max(again, 0.01))
    except (ServiceUnavailable, OSError, ValueError) as error:
        return [], [
            f"{not_counted}: only the books service may read them, and it did not ({error})"
        ]
    if answer.get("op") != "kernel_deaths":
        return [], [f"{not_counted}: the books service said {answer.get('message') or answer}"]
    me = str(answer["welcome"].get("user") or os.getuid())
    rows, left_out = [], []
    for raw in answer.get("records") or ():
        try:
            rows.append((me, UsageRecord.model_validate(raw)))
        except ValidationError:
            left_out.append(raw)
    said = []
    if left_out:
        said.append(f"{len(left_out)} of your killed kernels' records did not read as records")
    more = answer.get("more")
    if isinstance(more, int) and more > 0:
        said.append(
            f"{_plural(more, 'older claim', 'older claims')} of your killed kernels "
            f"{'is' if more == 1 else 'are'} not counted: the books service gives only the "
            f"newest {len(rows)} (--since asks for a shorter span)"
        )
    return rows, said


class UsageServiceDown(UserWarning):
    """The machine's books service did not answer while its usage records were looked for."""


def usage_main(argv: list[str]) -> int:
    """``fluksio-nb usage``: claims, core-hours, card-hours, peak memory and waits, per notebook."""
    parser = argparse.ArgumentParser(
        prog="fluksio-nb usage",
        description="What past claims used, per user and notebook, like Slurm's sacct.",
    )
    parser.add_argument(
        "--since", metavar="WHEN", help="claims ended since: 2026-11-30, 2026-11-30T12:00, 24h, 7d"
    )
    parser.add_argument("--user", metavar="NAME", help="only this user's claims")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument(
        "--json",
        action="store_true",
        help="print JSON instead of a table (its schema: docs/usage-report.schema.json)",
    )
    shape.add_argument(
        "--csv",
        action="store_true",
        help="print CSV instead of a table: a row per user and notebook, figures unrounded",
    )
    parser.add_argument(
        "--dir",
        metavar="DIR",
        action="append",
        type=Path,
        help="read the records in DIR (repeatable); by default, your own",
    )
    options = parser.parse_args(argv)
    try:
        since = None if options.since is None else parse_since(options.since)
    except BadSince as error:
        print(f"fluksio-nb usage: {error}", file=sys.stderr)
        return 2
    # A directory named on the line that is not there is a typo, not a machine
    # where nothing was claimed; the default ones appear with the first claim.
    missing = [str(directory) for directory in options.dir or () if not directory.is_dir()]
    if missing:
        print(f"fluksio-nb usage: no directory {', '.join(missing)}", file=sys.stderr)
        return 2
    if options.user is not None and not _is_a_user(options.user):
        print(
            f"fluksio-nb usage: there is no user {options.user!r} on this machine; "
            "give a login name, as `ls -l` shows it, or a uid",
            file=sys.stderr,
        )
        return 2
    # Counted as they are read: no record is kept, whatever is in the directories.
    rows = UsageRows()
    adding = _Summary()
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always", UsageServiceDown)
        directories = options.dir or usage_dirs()
    for warning in heard:
        print(f"fluksio-nb usage: {warning.message}", file=sys.stderr)
    for directory in directories:
        try:
            adding.add(witnessed(directory, rows, since=since, user=options.user))
        except OSError as error:
            print(
                f"fluksio-nb usage: cannot read the records in {directory}: "
                f"{error.strerror or error}",
                file=sys.stderr,
            )
            return 1
    me = (user_name(os.getuid()), str(os.getuid()))
    if options.dir is None and not heard and options.user in (None, *me):
        deaths, said = own_kernel_deaths(since)
        adding.add(deaths)
        for line in said:
            print(f"fluksio-nb usage: {line}", file=sys.stderr)
    summary = adding.rows()
    unread = {
        "not_plain": rows.not_plain_files,
        "bad_lines": rows.bad_lines,
        "bad_reasons": rows.bad_reasons,
        "files_cut": rows.files_cut,
        "not_seen_by_service": rows.not_seen_by_service,
        "before_service": rows.before_service,
    }
    if options.json:
        report = {
            "rows": summary,
            "users": user_totals(summary),
            "skipped_files": rows.skipped_files,
            "unreadable_files": rows.unreadable_files,
            "not_plain_files": rows.not_plain_files,
            "bad_lines": rows.bad_lines,
            "bad_reasons": rows.bad_reasons,
            "files_cut": rows.files_cut,
            "not_seen_by_service": rows.not_seen_by_service,
            "before_service": rows.before_service,
        }
        print(report_json(json_safe(report)))
    elif options.csv:
        sys.stdout.write(report_csv(summary))
        # The file holds the rows alone; what was not read is said beside it.
        for line in not_read(rows.unreadable_files, **unread):
            print(f"fluksio-nb usage: {line}", file=sys.stderr)
    else:
        print(describe_usage(summary, rows.unreadable_files, **unread))
    return 0


def _is_a_user(name: str) -> bool:
    """A login name, or a uid: the records of a user with no entry are told by the uid."""
    if name.isdigit():
        return True
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
