"""What one user may hold on a shared machine, as its admin capped it.

The admin's config (root's alone to write) can cap any user's cores, cards
and memory. The service refuses a claim over its user's cap; a kernel first
shrinks one to fit, as it shrinks a claim larger than the machine, or
refuses it when the claim is strict. Either way the message names the cap,
so a person knows it is the admin's limit and not the machine's.

A cap may also hold a claim to a longest time (``max_hours``): the service
ends a claim that runs past it (:mod:`.time_limits`), and a kernel cuts a
``--timeout`` longer than it to it, with a warning, so the cell's own
timeout never promises more than the admin allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fluksio_nb.errors import ClaimTooLarge, ClampedWarning, warn_at_users_line
from fluksio_nb.machine.time_limits import time_limit_words
from fluksio_nb.resources import Resources

#: cpus, cards and bytes of RAM.
Need = tuple[int, int, int]


@dataclass(frozen=True)
class Cap:
    """The most one user may hold at once; ``None`` is no limit."""

    cpus: int | None = None
    gpus: int | None = None
    ram_bytes: int | None = None
    #: The longest one claim may run, from its grant, in hours.
    max_hours: float | None = None

    def welcome(self) -> dict[str, Any]:
        """The cap as the service's welcome says it, in two fields a kernel reads.

        ``max_hours`` goes beside ``cap``, not in it: a kernel of a release
        before time limits makes its :class:`Cap` of every field in ``cap``,
        and would refuse the welcome, and with it the machine's books.
        """
        return {
            "cap": {"cpus": self.cpus, "gpus": self.gpus, "ram_bytes": self.ram_bytes},
            "max_hours": self.max_hours,
        }

    @classmethod
    def welcomed(cls, welcome: dict[str, Any]) -> Cap | None:
        """The cap a welcome said, of the fields this release knows."""
        said = welcome.get("cap")
        if not said:
            return None
        known = {name: said.get(name) for name in ("cpus", "gpus", "ram_bytes")}
        return cls(**known, max_hours=welcome.get("max_hours"))

    def room(self, held: Need) -> list[float]:
        return [
            math.inf if limit is None else limit - used
            for limit, used in zip((self.cpus, self.gpus, self.ram_bytes), held, strict=True)
        ]


def fit_to_cap(wanted: Resources, cap: Cap | None, user: str) -> Resources:
    """The claim shrunk to what its user may hold, or refused if strict; says which cap."""
    if cap is None:
        return wanted
    wanted = _timeout_within(wanted, cap.max_hours)
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


def _timeout_within(wanted: Resources, max_hours: float | None) -> Resources:
    """A timeout longer than the admin's time limit cut to it, or refused if strict.

    Only one that was given: a claim without one is ended at the limit by
    the service, which says so then.
    """
    if max_hours is None or wanted.timeout is None or wanted.timeout <= max_hours * 3600:
        return wanted
    limit_s = max_hours * 3600
    said = f"a timeout of {wanted.timeout:g} s is longer than {time_limit_words(max_hours)}"
    if wanted.strict:
        raise ClaimTooLarge(
            f"{said}; give a timeout of at most {limit_s:g} s, or drop --strict to have it "
            "cut to the limit"
        )
    warn_at_users_line(
        f"{said}; it is cut to {limit_s:g} s. Add --strict to refuse instead.",
        ClampedWarning,
    )
    return Resources(**{**wanted.model_dump(exclude_unset=True), "timeout": limit_s})
