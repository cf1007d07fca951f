"""Who used how much of the machine: one record per claim, and ``fluksio-nb usage``.

A shared box raises the questions a cluster's ``sacct`` answers: who ran
what, how many core-hours and card-hours it took, how much memory it
peaked at, and how long people waited for their share. The books only know
what is held now, so every claim, however it ends (ok, an error, the stop
button, halted, timed out, a dead worker, cancelled, even while still
waiting), leaves one record behind when it ends. A claim whose kernel was
killed outright is recorded by the books service that saw its connection
close: the machine's, or the user's own.

The record and the file it is appended to are :mod:`fluksio_nb.records`'s,
below the books that write records for the dead. The modules here, from the
bottom up; each imports only those before it:

- :mod:`.log`: which file a kernel writes its records to: the machine's
  shared directory, or the user's own.
- :mod:`.read`: reading back, trusting nothing in the directory: a record is
  counted against its file's owner, never a name written in it, unless
  root owns the file: the books service's, which says whose each record is.
- :mod:`.report`: ``fluksio-nb usage``, the records added up per user and
  notebook, as a table or JSON.

What is imported from here is what the rest of fluksio_nb and its tests have
always imported from ``fluksio_nb.usage``.
"""

from fluksio_nb.records import (
    KERNEL_DIED,
    UsageDirRefused,
    UsageLog,
    UsageNotRecorded,
    UsageRecord,
    default_usage_dir,
)
from fluksio_nb.usage.log import kernel_usage_log
from fluksio_nb.usage.read import read_usage
from fluksio_nb.usage.report import (
    describe_usage,
    parse_since,
    summarise,
    usage_main,
    user_totals,
)

__all__ = [
    "KERNEL_DIED",
    "UsageDirRefused",
    "UsageLog",
    "UsageNotRecorded",
    "UsageRecord",
    "default_usage_dir",
    "describe_usage",
    "kernel_usage_log",
    "parse_since",
    "read_usage",
    "summarise",
    "usage_main",
    "user_totals",
]
