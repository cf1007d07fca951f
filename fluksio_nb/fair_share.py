"""What a kernel that claimed nothing may use: the cores no claim holds, shared.

A cell without ``%%claim`` runs in the kernel itself. Left alone, its
``import numpy`` starts a thread per core, on the cores a claim beside it was
given, and every other kernel on the machine does the same. Declaring nothing
still changes nothing about *what* runs: such a kernel is never queued, held
or stopped. It is only told how many threads are fair when it starts, and
kept off the cores that claims hold while it lives
(:mod:`fluksio_nb.provisioner` does both).

The rule, decided here and nowhere else:

- **The cores** an unclaimed kernel runs on are the machine's, as the server
  that starts it may use them, less every core a running claim holds, in any
  kernel of any user on the same books. The reserve stays among them: it is
  kept back for exactly these kernels and the server. When claims hold every
  core, the kernel runs on all of them rather than on none, because it still
  has to answer its user.
- **The fair number** of threads is the count of those cores divided among
  the kernels the server runs, this one included, rounded down, and at least
  one. A running claim that names no core ids (books written before claims
  were given cores) takes its count off all the same.
- The number is fixed when the kernel starts, because that is when libraries
  read it. The cores follow the books for as long as the kernel lives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FairShare:
    """Where an unclaimed kernel's threads may run, and how many cores no claim holds."""

    cores: frozenset[int]
    #: What the fair number is reckoned from: can be 0 when claims hold everything.
    cpus: int


def held_cores(snapshot: Mapping[str, Any]) -> frozenset[int]:
    """The core ids the running claims in a books snapshot hold."""
    return frozenset(
        core
        for claim in snapshot.get("running", [])
        for core in (claim.get("allocation") or {}).get("cores") or ()
    )


def unclaimed(snapshot: Mapping[str, Any], machine: frozenset[int]) -> FairShare:
    """The share of ``machine`` (core ids) that the claims in ``snapshot`` leave over."""
    free = machine - held_cores(snapshot)
    counted_only = sum(
        (claim.get("allocation") or {}).get("cpus", 0)
        for claim in snapshot.get("running", [])
        if not (claim.get("allocation") or {}).get("cores")
    )
    return FairShare(cores=free or machine, cpus=max(0, len(free) - counted_only))
