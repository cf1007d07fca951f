"""What one user may hold on a shared machine, as its admin capped it.

The admin's config (root's alone to write) can cap any user's cores, cards
and memory. The service refuses a claim over its user's cap; a kernel first
shrinks one to fit, as it shrinks a claim larger than the machine, or
refuses it when the claim is strict. Either way the message names the cap,
so a person knows it is the admin's limit and not the machine's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fluksio_nb.errors import ClaimTooLarge, ClampedWarning, warn_at_users_line
from fluksio_nb.resources import Resources

#: cpus, cards and bytes of RAM.
Need = tuple[int, int, int]


@dataclass(frozen=True)
class Cap:
    """The most one user may hold at once; ``None`` is no limit."""

    cpus: int | None = None
    gpus: int | None = None
    ram_bytes: int | None = None

    def room(self, held: Need) -> list[float]:
        return [
            math.inf if limit is None else limit - used
            for limit, used in zip((self.cpus, self.gpus, self.ram_bytes), held, strict=True)
        ]


def fit_to_cap(wanted: Resources, cap: Cap | None, user: str) -> Resources:
    """The claim shrunk to what its user may hold, or refused if strict; says which cap."""
    if cap is None:
        return wanted
    limits = {"cpus": cap.cpus, "gpus": cap.gpus, "ram": cap.ram_bytes}
    over = {
        name: limit
        for name, limit in limits.items()
        if limit is not None and (getattr(wanted, name) or 0) > limit
    }
    if not over:
        return wanted
    from fluksio_nb.budget import human

    said = " ".join(
        f"{name}={human(limit) if name == 'ram' else limit}" for name, limit in over.items()
    )
    where = f"the cap this machine's admin set for {user} ({said})"
    if wanted.strict:
        raise ClaimTooLarge(
            f"{wanted.describe()} asks for more than {where}; ask for less, or drop "
            "--strict to be given what the cap allows"
        )
    shrunk = Resources(**{**wanted.model_dump(exclude_unset=True), **over})
    warn_at_users_line(
        f"{wanted.describe()} is more than {where}; running with {shrunk.describe()} instead. "
        "Add --strict to refuse instead.",
        ClampedWarning,
    )
    return shrunk
