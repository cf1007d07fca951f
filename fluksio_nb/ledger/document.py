"""What a ledger document may say, and which of its entries can be believed.

The ledger is a file, and whatever wrote it last (a kernel of another
version, a process killed halfway through a write, someone with an editor)
the books must still balance, and no cell may fail for it.

What it decides:

- **Every entry is checked, none is believed.** Entries are validated
  (:class:`LedgerEntry`) on every read; one that does not validate, or a running
  one holding a card the machine lacks, a card another claim holds, or more
  than is left, is dropped with a :class:`LedgerBroken` warning saying why
  (:func:`trusted`). Nothing read from the file can raise out of a
  transaction, and the books never show less than nothing free.
- **The dead are left out, not reported.** An entry whose kernel is gone
  (:func:`~fluksio_nb.ledger.owner.owner_alive`) is dropped quietly: that is
  how a share comes back, not a sign of a broken file.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fluksio_nb.ledger.owner import owner_alive
from fluksio_nb.resources import explain

VERSION = 1


class LedgerBroken(UserWarning):
    """The ledger file, or an entry in it, could not be used and was left out."""


class _Checked(BaseModel):
    # Strict: "2" where a count belongs is not something the ledger wrote,
    # and guessing what it meant is how the books stop balancing. Fields it
    # does not know are allowed: a later version may add some. Entries are
    # only checked against these models; the document keeps the dicts it was
    # read as, so nothing is lost on the way back to the file.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


Count = Annotated[int, Field(ge=0)]


class Asked(_Checked):
    """What a claim asked for."""

    cpus: Count
    gpus: Count
    ram_bytes: Count


class Held(_Checked):
    """What a running claim was granted: which cards and cores, not how many."""

    cpus: Count
    gpus: list[Count]
    ram_bytes: Count
    cores: list[Count] = Field(default_factory=list)


class Owner(_Checked):
    """The kernel that made a claim: its process, and whose it is."""

    pid: int = Field(gt=0)
    started: float
    kernel_id: str | None = None
    notebook: str | None = None
    user: str | None = None
    uid: Count | None = None


class LedgerEntry(_Checked):
    """One claim as the ledger records it."""

    number: int = Field(ge=1)
    state: Literal["waiting", "running", "cancelled"]
    label: str
    asked: Asked
    allocation: Held | None = None
    owner: Owner
    since: float
    granted_at: float | None = None
    # Only ever the name of one of the ledger's own sockets (wake.py), which is
    # reached in the ledger's checked directory: never a path to write to.
    wake: str | None = Field(default=None, pattern=r"^\x00fluksio-")
    cancel: str | None = None
    readings: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _running_says_what_it_holds(self) -> LedgerEntry:
        if self.state == "running" and (self.allocation is None or self.granted_at is None):
            raise ValueError("a running claim must say what it holds and since when")
        return self


class _MachineInventory(_Checked):
    cpus: Count
    gpu_ids: list[Count]
    ram_bytes: Count
    core_ids: list[Count] = Field(default_factory=list)
    core_nodes: dict[str, Count] = Field(default_factory=dict)


class Document(_Checked):
    """A whole ledger, as its top level must read; its entries are checked one by one."""

    version: Literal[1]
    next: int = Field(ge=1)
    tickets: list[Any]
    inventory: _MachineInventory


def trusted(
    entries: Any,
    inventory: dict[str, Any],
    checked: bool = False,
    dead: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """The entries that can be believed, of live owners, and what was wrong with the rest.

    Running claims are counted against the inventory in ticket order, so when
    the books do not balance it is the later claim that is left out.
    ``checked`` says each entry was validated already, or made by the ledger:
    validating every entry was the dearest part of a transaction, and once
    per transaction is enough. ``dead``, if given, gets the entries left out
    because their kernel is gone.
    """
    kept: list[dict[str, Any]] = []
    problems: list[str] = []
    if not isinstance(entries, list):
        return kept, ["the list of claims is not a list"]
    free_cpus, free_ram = inventory["cpus"], inventory["ram_bytes"]
    cards_here = set(inventory["gpu_ids"])
    free_cards = set(cards_here)
    free_cores = set(inventory.get("core_ids", ()))
    numbers: set[int] = set()
    for place, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict):
            problems.append(f"entry {place} is not an object")
            continue
        if not checked:
            try:
                LedgerEntry.model_validate(entry)
            except ValidationError as error:
                problems.append(f"entry {place}: {explain(error)}")
                continue
        number = entry["number"]
        if number in numbers:
            problems.append(f"claim {number} appears twice")
            continue
        numbers.add(number)
        if not owner_alive(entry["owner"]):
            if dead is not None:
                dead.append(entry)
            continue  # reaped, not broken
        if entry["state"] == "running":
            held = entry["allocation"]
            cards = held["gpus"]
            missing = sorted(set(cards) - cards_here)
            if missing:
                problems.append(f"claim {number} holds card(s) {missing}, not this machine's")
                continue
            if not set(cards) <= free_cards or len(set(cards)) != len(cards):
                problems.append(f"claim {number} holds card(s) {cards}, held already")
                continue
            cores = held.get("cores", [])
            if not set(cores) <= free_cores or len(set(cores)) != len(cores):
                problems.append(f"claim {number} holds core(s) {cores}, held already or not here")
                continue
            if held["cpus"] > free_cpus or held["ram_bytes"] > free_ram:
                problems.append(
                    f"claim {number} holds {held['cpus']} cpus and {held['ram_bytes']} bytes "
                    f"of RAM, more than was left ({free_cpus} cpus, {free_ram} bytes)"
                )
                continue
            free_cards -= set(cards)
            free_cores -= set(cores)
            free_cpus -= held["cpus"]
            free_ram -= held["ram_bytes"]
        kept.append(entry)
    return kept, problems


def warn_left_out(where: Path | None, problems: list[str]) -> None:
    """One :class:`LedgerBroken` warning for every entry :func:`trusted` left out, if any."""
    if problems:
        ledger = "the ledger" if where is None else f"the ledger {where}"
        warnings.warn(
            f"fluksio_nb: {ledger} had claims that cannot be trusted, and they were left "
            f"out: {'; '.join(problems)}",
            LedgerBroken,
            stacklevel=3,
        )


def empty_state(inventory: dict[str, Any] | None) -> dict[str, Any]:
    """A ledger with no claims: what a new or rebuilt one starts from."""
    inventory = inventory or {"cpus": 0, "gpu_ids": [], "ram_bytes": 0}
    return {"version": VERSION, "inventory": inventory, "next": 1, "tickets": []}
