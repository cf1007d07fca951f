"""``fluksio-nb usage --json`` and ``--csv``: the report in a shape other programs rely on.

An admin's usage goes on into a spreadsheet, a billing script or a
dashboard, which break quietly when a field is renamed. So the JSON report
is a written-down schema, not whatever the summary happens to hold.

What it decides:

- **The JSON's shape is these pydantic models**, and the schema in
  ``docs/usage-report.schema.json`` is made from them
  (:func:`report_schema`); the suite checks that the file is up to date
  and that a real report validates against it. Fields are only ever added.
- **CSV is the table's rows, one per user and notebook**, without the
  per-user totals, which a spreadsheet adds up itself; figures are raw
  (hours, seconds, bytes), as ``sacct --parsable2`` gives them, and how
  the claims ended is one column of ``ending=count`` pairs. What could not
  be read goes to standard error, so the file holds only the rows.
- **A cell another user wrote is never a formula.** Notebook names and
  endings are their records' owners' words, and a spreadsheet runs a cell
  that begins ``=``, ``+``, ``-`` or ``@`` as one (CSV injection): such a
  cell is written with a leading ``'``, as OWASP advises.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Figures(BaseModel):
    model_config = ConfigDict(extra="forbid")

    claims: int = Field(ge=0, description="Claims counted.")
    core_hours: float = Field(ge=0, description="Cores held × hours held, summed.")
    card_hours: float = Field(ge=0, description="Cards held × hours held, summed.")
    peak_rss_bytes: int | None = Field(
        ge=0,
        description="The most memory any one claim's processes held; null where no claim's "
        "was known (a killed kernel's is not).",
    )
    peak_gpu_bytes: int | None = Field(
        ge=0, description="The most card memory any one claim held; null where no card was read."
    )
    waited_s: float = Field(ge=0, description="Seconds the claims waited for their share, summed.")
    ran_s: float = Field(ge=0, description="Seconds the claims held their share, summed.")
    endings: dict[str, int] = Field(
        description="How many claims ended each way: ok, error, halted, timed out, cancelled, "
        "kernel died, … ('(other)' past twenty ways for one user)."
    )


class UsageRow(_Figures):
    """One user's claims from one notebook."""

    user: str = Field(description="Login name, as the records' files' owner says; or a uid.")
    notebook: str | None = Field(
        description="The notebook's path as its kernel knew it; null for claims made outside one. "
        "'(other notebooks)' past a thousand notebooks for one user."
    )


class UserTotal(_Figures):
    """One user's claims from every notebook."""

    user: str
    notebooks: int = Field(ge=0, description="How many rows this total adds up.")


class UsageReport(BaseModel):
    """What ``fluksio-nb usage --json`` prints."""

    model_config = ConfigDict(extra="forbid", title="fluksio-nb usage --json")

    rows: list[UsageRow] = Field(description="Per user and notebook, by user then notebook.")
    users: list[UserTotal] = Field(description="Per user, by user.")
    skipped_files: int = Field(ge=0, description="Other users' files that were not read.")
    unreadable_files: int = Field(ge=0, description="Of those, the ones that could not be opened.")
    not_plain_files: int = Field(
        ge=0, description="Entries named like records that are not plain files (a link, a pipe)."
    )
    bad_lines: int = Field(ge=0, description="Lines skipped as not usage records.")
    bad_reasons: dict[str, int] = Field(description="Why those lines were skipped, counted.")
    files_cut: int = Field(ge=0, description="Files read only in part, for a limit on reading.")
    not_seen_by_service: int = Field(
        ge=0,
        description="Records of claims the machine's books service never saw, though it kept "
        "its account then: not counted.",
    )
    before_service: int = Field(
        ge=0, description="Claims from before the service's oldest account, counted on trust."
    )


def report_schema() -> dict[str, Any]:
    """The JSON Schema of :class:`UsageReport`, as ``docs/usage-report.schema.json`` holds it."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **UsageReport.model_json_schema(),
    }


def report_json(report: dict[str, Any]) -> str:
    """The report as JSON, checked against its schema before anyone reads it."""
    # Strict: a reader's JSON parser takes no NaN or Infinity.
    return json.dumps(
        UsageReport.model_validate(report).model_dump(mode="json"), indent=1, allow_nan=False
    )


#: The columns of ``--csv``, in order: a row's fields, and its endings as ``ending=count`` pairs.
CSV_COLUMNS = (
    "user",
    "notebook",
    "claims",
    "core_hours",
    "card_hours",
    "peak_rss_bytes",
    "peak_gpu_bytes",
    "waited_s",
    "ran_s",
    "endings",
)
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(round(value, 6))
    text = str(value)
    return "'" + text if text.startswith(_FORMULA_STARTS) else text


def report_csv(rows: list[dict[str, Any]]) -> str:
    """The rows as CSV with a header line, each cell safe to open in a spreadsheet."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        endings = ";".join(f"{ending}={count}" for ending, count in sorted(row["endings"].items()))
        writer.writerow(
            [_cell(row[name]) for name in CSV_COLUMNS[:-1]] + [_cell(endings) if endings else ""]
        )
    return out.getvalue()
