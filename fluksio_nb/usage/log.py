"""Which file a kernel appends its claims' records to.

The record and the file (:class:`~fluksio_nb.records.UsageLog`) are
:mod:`fluksio_nb.records`'s, below the books, which write records for
killed kernels; what is this module's is which directory a kernel's
records go to: the machine's shared one, on books every user shares, or
the user's own.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from fluksio_nb.records import (
    UsageDirRefused,
    UsageLog,
    UsageNotRecorded,
    default_usage_dir,
    process_log,
)

__all__ = [
    "UsageDirRefused",
    "UsageLog",
    "UsageNotRecorded",
    "default_usage_dir",
    "kernel_usage_log",
]

_log_lock = threading.Lock()
_log: UsageLog | None = None
_log_key: tuple[Any, str | None] | None = None


def kernel_usage_log() -> UsageLog:
    """This process's log, in the machine's shared records directory if it has one."""
    import fluksio_nb.kernel

    global _log, _log_key
    books = fluksio_nb.kernel.accountant()
    # Finding the directory costs about 60 µs (jupyter_core); the same books
    # and the same data dir mean the same directory, so it is found once.
    key = (books, os.environ.get("JUPYTER_DATA_DIR"))
    with _log_lock:
        if _log is None or _log_key is None or _log_key[0] is not books or _log_key[1] != key[1]:
            shared = getattr(books, "records_dir", None)
            # The process's one log there: the records it writes for a kernel
            # of the user's it reaped go in the same file as its own.
            _log = process_log(Path(shared or default_usage_dir()), create=shared is None)
            _log_key = key
        return _log
