"""The ledger as the server and the command line show it: who holds what, what is free.

The server and the command line make no claims of their own, but they show
the claims of every kernel of the user, and must show the figures the
kernels grant by.

What it decides:

- **One shape, whichever books.** A snapshot has the shape
  :meth:`~fluksio_nb.queue.ClaimQueue.snapshot` gives, so a view reads the
  user's ledger as it reads a kernel's own books.
- **Only what can be trusted is shown**, as the kernels grant by it: the
  free figures are never below zero.
- **No ledger yet is no claims**: the machine is described as this process
  sees it, and no document is made just to be read.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from fluksio_nb.inventory import take_inventory
from fluksio_nb.ledger.document import LedgerBroken, empty_state, trusted, warn_left_out
from fluksio_nb.ledger.file import LedgerFile
from fluksio_nb.ledger.rules import free_core_ids
from fluksio_nb.settings import Settings, load_settings


def read_snapshot(
    directory: Path, shared: bool = False, *, settings: Settings | None = None
) -> dict[str, Any]:
    """The machine as its ledger describes it, read under the shared lock.

    For the server and the command line, which make no claims of their own:
    with no ledger yet, the machine is described as this process sees it,
    with ``settings`` when the caller has read them already. ``shared`` is
    ignored, as by :class:`LedgerFile`.
    """
    ledger = LedgerFile(directory)
    try:
        if ledger.has_document():
            state = ledger.read()
            if ledger.unreadable is None:
                return machine_snapshot(state, state["inventory"], checked=True)
            # What a crash or a full disk leaves: read as empty, it described
            # a machine of nothing. The next claim rebuilds it.
            warnings.warn(
                f"fluksio_nb: the ledger {ledger.path} could not be read "
                f"({ledger.unreadable}); the machine is shown as found, and the next "
                "claim starts the ledger afresh.",
                LedgerBroken,
                stacklevel=2,
            )
    finally:
        ledger.close()
    return machine_as_found(settings)


def machine_as_found(settings: Settings | None = None) -> dict[str, Any]:
    """A snapshot of books nobody has claimed from: the machine as this process finds it."""
    inventory = take_inventory(settings or load_settings()).for_books()
    return machine_snapshot(empty_state(inventory), inventory)


def machine_snapshot(
    state: dict[str, Any], inventory: dict[str, Any], checked: bool = False
) -> dict[str, Any]:
    """What a ledger document says, in the shape :meth:`ClaimQueue.snapshot` uses.

    Only what can be trusted is shown: the free figures are never below zero.
    ``checked`` as for :func:`~fluksio_nb.ledger.rules.dispatch`.
    """
    tickets, problems = trusted(state.get("tickets", []), inventory, checked)
    warn_left_out(None, problems)
    running = [t for t in tickets if t["state"] == "running"]
    waiting = [t for t in tickets if t["state"] == "waiting"]
    held_gpus = {g for t in running for g in t["allocation"]["gpus"]}
    free_ids = sorted(set(inventory["gpu_ids"]) - held_gpus)

    def who(entry: dict[str, Any]) -> dict[str, Any]:
        owner = entry["owner"]
        return {
            "ticket": entry["number"],
            "label": entry["label"],
            "since": entry["since"],
            "pid": owner["pid"],
            "kernel_id": owner.get("kernel_id"),
            "notebook": owner.get("notebook"),
            "user": owner.get("user"),
            #: A stop asked for and not yet carried out by the claim's kernel.
            "cancel": entry.get("cancel"),
        }

    return {
        "cpus": {
            "total": inventory["cpus"],
            "free": inventory["cpus"] - sum(t["allocation"]["cpus"] for t in running),
            "free_ids": free_core_ids(inventory, running),
        },
        "gpus": {
            "total": len(inventory["gpu_ids"]),
            "free": len(free_ids),
            "free_ids": free_ids,
        },
        "ram_bytes": {
            "total": inventory["ram_bytes"],
            "free": inventory["ram_bytes"] - sum(t["allocation"]["ram_bytes"] for t in running),
        },
        "waiting": [
            {**who(t), "position": position, "asked": t["asked"]}
            for position, t in enumerate(waiting, start=1)
        ],
        "running": [
            {
                **who(t),
                "allocation": t["allocation"],
                "granted_at": t.get("granted_at"),
                "readings": t.get("readings"),
            }
            for t in running
        ],
    }
