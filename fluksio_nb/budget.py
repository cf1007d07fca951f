"""The memory a claim may use, and when it has to be stopped.

A claim's ``ram=`` is two numbers, not one. The *granted* budget is what the
books handed out; the *applied* budget is that, less whatever the rest of the
machine has already taken: processes outside any claim use memory the books
know nothing about, so on a busy host the same claim legitimately runs under
a lower ceiling. Both are shown, and only the applied one is enforced.

The halt decision looks at memory only, for two reasons:

- the claim's own process tree is over its applied budget, or
- the host is short of its headroom (a tenth of RAM or 1 GiB, whichever is
  more), whoever caused it.

The two call for different advice, so the decision carries which one it was
and the numbers. CPU is never a reason to halt. A thread-hungry cell is held
to its share by the thread variables, and a busy half-second between two
samples is a cell running slowly, not a cell to kill. Memory over budget, on
the other hand, stays over budget until something frees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pydantic import ByteSize

from fluksio_nb.inventory import system_headroom_bytes
from fluksio_nb.sampler import Sample


def human(n: int | None) -> str:
    """Bytes as a person reads them: ``1.2GB``."""
    return "-" if n is None else ByteSize(max(0, n)).human_readable(decimal=True)


@dataclass(frozen=True)
class Budget:
    """The memory ceiling one claim runs under."""

    #: What the books granted, or ``None`` for a claim that named no ``ram=``:
    #: such a claim has no ceiling of its own and is held only to the headroom.
    granted_bytes: int | None
    applied_bytes: int | None

    @property
    def limited_by_host(self) -> bool:
        return self.granted_bytes is not None and self.applied_bytes != self.granted_bytes


def resolve_budget(
    granted_bytes: int | None, *, host_total_bytes: int, host_available_bytes: int
) -> Budget:
    """The ceiling a claim runs under, given what the host has free as it starts."""
    if granted_bytes is None:
        return Budget(None, None)
    spare = max(0, host_available_bytes - system_headroom_bytes(host_total_bytes))
    return Budget(granted_bytes, min(granted_bytes, spare))


class HaltReason(str, Enum):
    """Why a running claim had to stop."""

    NONE = "none"
    OVER_BUDGET = "over_budget"
    HOST_SHORT = "host_short"


@dataclass(frozen=True)
class HaltDecision:
    should_halt: bool
    reason: HaltReason = HaltReason.NONE
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


_CONTINUE = HaltDecision(should_halt=False)


def halt_decision(sample: Sample, budget: Budget) -> HaltDecision:
    """Stop when the claim is over its own budget, or the host is short of headroom."""
    limit = budget.applied_bytes
    if limit is not None and sample.rss_bytes > limit:
        why = (
            f" (granted {human(budget.granted_bytes)}, lowered to what the host had free)"
            if budget.limited_by_host
            else ""
        )
        return HaltDecision(
            should_halt=True,
            reason=HaltReason.OVER_BUDGET,
            message=(
                f"halted: the worker used {human(sample.rss_bytes)}, over its memory budget "
                f"of {human(limit)}{why}. Ask for more with ram=, or use less."
            ),
            detail={"rss_bytes": sample.rss_bytes, "limit_bytes": limit},
        )

    headroom = system_headroom_bytes(sample.host_total_bytes)
    if sample.host_available_bytes < headroom:
        return HaltDecision(
            should_halt=True,
            reason=HaltReason.HOST_SHORT,
            message=(
                f"halted: the machine ran short of memory ({human(sample.host_available_bytes)} "
                f"free, under the {human(headroom)} kept for the host). The worker was using "
                f"{human(sample.rss_bytes)}; something else on the machine may be the cause."
            ),
            detail={
                "available_bytes": sample.host_available_bytes,
                "headroom_bytes": headroom,
                "rss_bytes": sample.rss_bytes,
            },
        )
    return _CONTINUE
