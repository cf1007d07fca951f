"""The Jupyter server's history of the machine, handed to the kernels it starts.

The server keeps the machine's last ten minutes from the moment it starts
(:mod:`fluksio_nb.machine_history`, fed by its extension). A kernel keeps a
ring too, but fed only while a ``%claims`` monitor is watched, so a
monitor opened in a fresh kernel would start with an empty chart while the
server, one process away, has ten minutes of it. This module hands the
server's ring over.

What it decides:

- **A file, not a request.** The server writes its points to one file in
  the user's Jupyter runtime directory (mode 0600, replaced whole, so a
  reader never sees half of one) after each point, and puts the file's path in its
  own environment, which every kernel it starts inherits
  (:data:`ENV`). A kernel needs no token and no URL to read it, and one
  started by anything else simply finds no path.
- **A kernel catches up when a view opens or refreshes**, and reads the
  file again only when it changed. Points older than the kernel's own
  oldest go before them, points newer than its newest after: the kernel's
  own points are never replaced.
- **What is read is checked** (pydantic), and a file too large or not what
  the server writes is ignored, with the monitor starting from the
  kernel's own points as before: a chart missing its past is no reason
  for a view to fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from fluksio_nb.machine_history import MachineHistory

#: The variable that tells a kernel where its server's history is.
ENV = "FLUKSIO_SERVER_HISTORY"

#: Far more than ten minutes of points with a few cards each ever take.
MOST_BYTES = 4 * 2**20


class _Card(BaseModel):
    model_config = ConfigDict(extra="ignore")
    index: int
    used_bytes: int | None = None
    total_bytes: int | None = None
    utilisation_percent: float | None = None


class _Point(BaseModel):
    model_config = ConfigDict(extra="ignore")
    at: float
    cpu_percent: float
    cpu_outside_claims_percent: float | None = None
    memory_used_bytes: int
    memory_total_bytes: int
    cards: list[_Card] = []


_POINTS = TypeAdapter(list[_Point])


def history_path() -> Path:
    """Where this server writes its history: one file per server process."""
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / f"fluksio-history-{os.getpid()}.json"


def publish(history: MachineHistory, path: Path) -> None:
    """Write ``history``'s points to ``path`` whole, readable by this user alone. Blocking."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(history.points(), out, separators=(",", ":"))
    os.replace(part, path)


def forget(path: Path) -> None:
    """Remove the file when the server stops: no kernel of a stopped server reads it."""
    with contextlib.suppress(OSError):
        path.unlink()


def read_points(path: Path) -> list[dict[str, Any]]:
    """The points in ``path``, oldest first; none if it is missing, too big or not points."""
    try:
        with path.open("rb") as file:
            raw = file.read(MOST_BYTES + 1)
    except OSError:
        return []
    if len(raw) > MOST_BYTES:
        return []
    try:
        points = _POINTS.validate_json(raw)
    except ValidationError:
        return []
    return sorted((point.model_dump() for point in points), key=lambda point: point["at"])


class _CatchUp:
    """Reads the server's file into a kernel's ring when it changed since the last time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None

    def __call__(self, history: MachineHistory, environ: Any = None) -> int:
        environ = os.environ if environ is None else environ
        where = environ.get(ENV)
        if not where or Path(where) == history_path():
            return 0  # no server said where, or this is the server itself
        path = Path(where)
        with self._lock:
            try:
                stat = path.stat()
            except OSError:
                return 0
            seen = (stat.st_mtime_ns, stat.st_size)
            if seen == self._seen:
                return 0
            self._seen = seen
            return history.merge(read_points(path))


catch_up = _CatchUp()
