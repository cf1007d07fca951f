"""fluksio_nb: claim a share of a shared machine from a notebook cell.

``%load_ext fluksio_nb`` registers ``%%claim`` and ``%claims``. A claimed cell
waits its turn for its cores, cards and memory, then runs in a worker process
whose environment was derived from its share. See ``README.md``, and
``docs/`` for the reference.

The public names are imported on first use. Every worker process imports this
package to reach its own module, and a worker that loaded pydantic and the
queue it never uses would start measurably slower.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "claim": "fluksio_nb.context",
    "Claim": "fluksio_nb.local_claim",
    "accountant": "fluksio_nb.kernel",
    "monitor": "fluksio_nb.widget",
    "Resources": "fluksio_nb.resources",
    "BadClaim": "fluksio_nb.errors",
    "Allocation": "fluksio_nb.books",
    "ResourceAccountant": "fluksio_nb.books",
    "THREAD_VARS": "fluksio_nb.env",
    "derive_env": "fluksio_nb.env",
    "fair_share_env": "fluksio_nb.env",
    "ClaimCancelled": "fluksio_nb.errors",
    "ClaimTimeout": "fluksio_nb.errors",
    "ClaimTooLarge": "fluksio_nb.errors",
    "ClampedWarning": "fluksio_nb.errors",
    "ClaimHalted": "fluksio_nb.errors",
    "RemoteError": "fluksio_nb.errors",
    "WorkerDied": "fluksio_nb.errors",
    "Job": "fluksio_nb.jobs",
}

__all__ = [*_PUBLIC, "load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'fluksio_nb' has no attribute {name!r}")


def load_ipython_extension(shell: Any) -> None:
    from fluksio_nb.magics import load_ipython_extension as load

    load(shell)


def unload_ipython_extension(shell: Any) -> None:
    from fluksio_nb.magics import unload_ipython_extension as unload

    unload(shell)


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    # The handlers live in their own module: jupyter_server is imported only
    # by a server, never by a kernel or a worker that imports this package.
    return [{"module": "fluksio_nb.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "fluksio-nb"}]
