"""The queue's rules applied to a ledger document: who is granted what, and cancelling.

Whichever kernel of the user happens to run a transaction, the same claims
must be granted in the same order, and a crash in the middle of any of them
must leave books that still balance.

What it decides:

- **Nothing stored that can drift.** What is free is worked out from the
  inventory and the running claims on every transaction, never kept as a
  counter, so a crash in the middle of anything cannot unbalance the books.
- **FIFO by ticket, machine-wide.** Tickets are numbered by the ledger, and
  the same rule as the kernel's own queue (:func:`~fluksio_nb.queue.who_goes_next`)
  decides who goes next, whichever kernel asked.
- **A cancel is a mark, carried out by the claim's own kernel.** Any kernel
  of the user may cancel any of the user's claims (:func:`cancel_claim`), but
  only the kernel that holds a claim can stop what it runs.
"""

from __future__ import annotations

import time
from typing import Any

from fluksio_nb.books import pick_cores
from fluksio_nb.errors import NotYours
from fluksio_nb.ledger.document import trusted, warn_left_out
from fluksio_nb.ledger.file import LedgerFile
from fluksio_nb.ledger.wake import wake
from fluksio_nb.queue import who_goes_next


def dispatch(state: dict[str, Any], checked: bool = False) -> list[str]:
    """Reap dead owners, leave out what cannot be trusted, and grant in order.

    Returns the addresses to wake. ``checked``: every entry was read through
    :class:`~fluksio_nb.ledger.file.LedgerFile` or made by the ledger, so is
    not validated again.
    """
    inventory = state["inventory"]
    tickets, problems = trusted(state["tickets"], inventory, checked)
    warn_left_out(None, problems)
    state["tickets"] = tickets
    running = [t for t in tickets if t["state"] == "running"]
    held_gpus = {g for t in running for g in t["allocation"]["gpus"]}
    free_gpus = sorted(set(inventory["gpu_ids"]) - held_gpus)
    free_cores = free_core_ids(inventory, running)
    node_of = {int(core): node for core, node in inventory.get("core_nodes", {}).items()}
    free = (
        inventory["cpus"] - sum(t["allocation"]["cpus"] for t in running),
        len(free_gpus),
        inventory["ram_bytes"] - sum(t["allocation"]["ram_bytes"] for t in running),
    )
    waiting = [t for t in tickets if t["state"] == "waiting"]
    needs = [(t["asked"]["cpus"], t["asked"]["gpus"], t["asked"]["ram_bytes"]) for t in waiting]
    woken = []
    for index in who_goes_next(needs, free):
        entry = waiting[index]
        cards, free_gpus = (
            free_gpus[: entry["asked"]["gpus"]],
            free_gpus[entry["asked"]["gpus"] :],
        )
        cores = pick_cores(free_cores, entry["asked"]["cpus"], node_of)
        free_cores = [core for core in free_cores if core not in cores]
        entry["state"] = "running"
        entry["allocation"] = {**entry["asked"], "gpus": cards, "cores": list(cores)}
        entry["granted_at"] = time.time()
        if entry.get("wake"):
            woken.append(entry["wake"])
    return woken


def free_core_ids(inventory: dict[str, Any], running: list[dict[str, Any]]) -> list[int]:
    """The inventory's cores that no running claim holds, in order."""
    held = {c for t in running for c in t["allocation"].get("cores", ())}
    return sorted(set(inventory.get("core_ids", ())) - held)


def cancel_claim(ledger: LedgerFile, number: int, reason: str, user: str | None = None) -> bool:
    """Cancel a waiting claim, or mark a running one to be stopped by its kernel.

    ``user``, when given, must be the claim's owner, as its entry names them.
    False if there is no such claim (any more).
    """
    with ledger.transaction() as state:
        entry = next(
            (t for t in state["tickets"] if t["number"] == number and t["state"] != "cancelled"),
            None,
        )
        if entry is None:
            return False
        owner = entry["owner"].get("user")
        if user is not None and owner != user:
            raise NotYours(f"claim {number} belongs to {owner!r}; only they may cancel it")
        entry["cancel"] = reason
        woken = [entry["wake"]] if entry.get("wake") else []
        if entry["state"] == "waiting":
            # Kept, marked, until its owner lets go of it, so that the owner
            # learns why; it no longer takes a place in the queue.
            entry["state"] = "cancelled"
            woken += dispatch(state, checked=True)
    wake(ledger, woken)
    return True
