"""The memory a claim may use, and when it has to be stopped.

A claim's ``ram=`` is two numbers, not one. The *granted* budget is what the
books handed out; the *applied* budget is that, less whatever the rest of the
machine has already taken: processes outside any claim use memory the books
know nothing about, so on a busy host the same claim legitimately runs under
a lower ceiling. Both are shown, and only the applied one is enforced.

The halt decision looks at memory only, for three reasons:

- the claim's own process tree is over its applied budget, or
- over its card memory budget (``gpu_ram=``) on one of its cards, or
- the host is short of its headroom (a tenth of RAM or 1 GiB, whichever is
  more), whoever caused it.

The two call for different advice, so the decision carries which one it was
and the numbers. The budget is staged (:attr:`Budget.warn_bytes`,
:attr:`Budget.halt_bytes`): a claim is warned once at the first stage and
stopped at the second, shares of the applied budget set in the config.

Two things can stop a claim over its own budget: the sampler, reading every
half second, and, where a cgroup could be made, the kernel's own memory cap
(:mod:`fluksio_nb.memory_cap`). The paragraph the user reads is written in one
place, :func:`over_budget`, and says which of the two acted: the numbers mean
different things (a reading taken up to half a second late, or the most the
kernel let the claim have), and so does the advice about how far over a fast
allocation can get. A stop while the results were being copied back, after
the cell's code had run, says so and names what was being copied
(:func:`in_the_copy_back`): the cell's code did not cross the line, and
sending less is the fix. CPU is never a reason to halt. A thread-hungry cell is held
to its share by the thread variables, and a busy half-second between two
samples is a cell running slowly, not a cell to kill. Memory over budget, on
the other hand, stays over budget until something frees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from pydantic import ByteSize

from fluksio_nb.gpu_usage import GPU_INTERVAL_S
from fluksio_nb.inventory import host_memory, system_headroom_bytes
from fluksio_nb.sampler import SAMPLE_INTERVAL_S, CardShare, Sample


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
    #: Shares of the applied budget: warned at the first, stopped at the second
    #: (``memory_warn_at`` and ``memory_halt_at`` in the settings).
    warn_at: float = 0.8
    halt_at: float = 1.0
    #: Card memory each of the claim's cards may hold (``gpu_ram=``), or ``None``.
    gpu_bytes: int | None = None

    @property
    def limited_by_host(self) -> bool:
        return self.granted_bytes is not None and self.applied_bytes != self.granted_bytes

    @property
    def warn_bytes(self) -> int | None:
        """The memory at which the claim is warned, once; ``None`` without a budget."""
        return None if self.applied_bytes is None else int(self.applied_bytes * self.warn_at)

    @property
    def halt_bytes(self) -> int | None:
        """The memory past which the claim is stopped; ``None`` without a budget."""
        return None if self.applied_bytes is None else int(self.applied_bytes * self.halt_at)


def resolve_budget(
    granted_bytes: int | None,
    *,
    host_total_bytes: int,
    host_available_bytes: int,
    warn_at: float = 0.8,
    halt_at: float = 1.0,
) -> Budget:
    """The ceiling a claim runs under, given what the host has free as it starts."""
    if granted_bytes is None:
        return Budget(None, None, warn_at, halt_at)
    spare = max(0, host_available_bytes - system_headroom_bytes(host_total_bytes))
    return Budget(granted_bytes, min(granted_bytes, spare), warn_at, halt_at)


def budget_here(
    granted_bytes: int | None,
    *,
    warn_at: float = 0.8,
    halt_at: float = 1.0,
    gpu_bytes: int | None = None,
) -> Budget:
    """:func:`resolve_budget` with this host's memory as it is now, where the claim starts.

    Called where the work runs: in the kernel for a claim on its machine, in
    the task on a Ray node for one there, since the spare memory that matters
    is the host's that runs it.
    """
    if not granted_bytes:
        # Reading the host's and the cgroup's memory is a dozen files, a fifth
        # of a millisecond: only a budget needs it.
        return Budget(None, None, warn_at, halt_at, gpu_bytes)
    total, available = host_memory()
    budget = resolve_budget(
        granted_bytes,
        host_total_bytes=total,
        host_available_bytes=available,
        warn_at=warn_at,
        halt_at=halt_at,
    )
    return replace(budget, gpu_bytes=gpu_bytes)


class HaltReason(StrEnum):
    """Why a running claim had to stop."""

    NONE = "none"
    OVER_BUDGET = "over_budget"
    OVER_GPU_BUDGET = "over_gpu_budget"
    HOST_SHORT = "host_short"


#: Who stopped a claim for memory: the sampler, or the kernel's cap in one
#: cgroup version or the other.
SAMPLER = "sampler"
CGROUP_V1 = "cgroup v1"
CGROUP_V2 = "cgroup v2"


@dataclass(frozen=True)
class HaltDecision:
    should_halt: bool
    reason: HaltReason = HaltReason.NONE
    message: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    #: Which one acted: :data:`SAMPLER`, :data:`CGROUP_V1` or :data:`CGROUP_V2`.
    enforced_by: str = SAMPLER


_CONTINUE = HaltDecision(should_halt=False)


def over_budget(
    used_bytes: int,
    budget: Budget,
    enforced_by: str = SAMPLER,
    sending: Mapping[str, int] | None = None,
) -> HaltDecision:
    """The stop of a claim over its own budget, in the one paragraph the user reads.

    ``used_bytes`` is the sampler's reading that crossed the line, or, for the
    kernel's cap, the most the claim's processes held (the cgroup's peak).
    ``sending`` is what was being copied back when it was stopped, if it
    was: each name, and about how many bytes it holds.
    """
    limit = budget.halt_bytes
    assert budget.applied_bytes is not None and limit is not None, "no budget, nothing to be over"
    why = (
        f", granted {human(budget.granted_bytes)} and lowered to what the host had free"
        if budget.limited_by_host
        else ""
    )
    stage = f", stopped at {budget.halt_at:.0%} of it" if budget.halt_at < 1 else ""
    if sending is not None:
        by = (
            f"the sampler, which reads memory every {SAMPLE_INTERVAL_S:g} s"
            if enforced_by == SAMPLER
            else f"the kernel's memory cap ({enforced_by})"
        )
        message = (
            f"stopped while its results were copied back to the kernel, after the cell's "
            f"code had run: copying {_names_and_sizes(sending)} took the worker to "
            f"{human(used_bytes)}, over its memory budget of {human(budget.applied_bytes)}"
            f"{why}{stage}, and it was stopped by {by}. Bytes, bytearrays and numpy arrays "
            "go back without a copy; text and other objects are copied as they are "
            "pickled, and that copy counts. Bring back only what the kernel needs "
            "(--out NAMES), del the rest before the cell ends, or ask for more with ram=."
        )
    elif enforced_by == SAMPLER:
        message = (
            f"the worker used {human(used_bytes)}, over its memory budget of "
            f"{human(budget.applied_bytes)}{why}{stage}. It was halted by the sampler, which "
            f"reads memory every {SAMPLE_INTERVAL_S:g} s, so a fast allocation can get "
            "further before it is seen. Ask for more with ram=, or use less."
        )
    else:
        message = (
            f"the claim's processes reached {human(used_bytes)}, all that its memory "
            f"budget of {human(budget.applied_bytes)}{why}{stage} allows, and were stopped by "
            f"the kernel's memory cap ({enforced_by}), which no allocation gets past. "
            "Ask for more with ram=, or use less."
        )
    detail: dict[str, Any] = {"rss_bytes": used_bytes, "limit_bytes": limit}
    if sending is not None:
        detail["sending"] = dict(sending)
    return HaltDecision(
        should_halt=True,
        reason=HaltReason.OVER_BUDGET,
        message=message,
        detail=detail,
        enforced_by=enforced_by,
    )


def in_the_copy_back(
    decision: HaltDecision, budget: Budget, sending: Mapping[str, int], code_peak_bytes: int = 0
) -> HaltDecision:
    """``decision`` as the stop of a claim whose results were being copied back as it came.

    Only a stop over the claim's own budget changes, and only if the cell's
    code kept within it (``code_peak_bytes``, the worker's own peak while the
    code ran): a code that went past it between two readings is seen only
    once it is over, and is still to blame. The host running short, or a
    card over its budget, is no more the copy's doing than the cell's.
    """
    over = budget.halt_bytes is not None and code_peak_bytes > budget.halt_bytes
    if decision.reason != HaltReason.OVER_BUDGET or "sending" in decision.detail or over:
        return decision
    return over_budget(decision.detail["rss_bytes"], budget, decision.enforced_by, sending)


#: Names listed by size in a stop during the copy back; the rest are counted.
_NAMES_LISTED = 5


def _names_and_sizes(sending: Mapping[str, int]) -> str:
    """``chunks (about 320.0MB) and total (about 28B)``: the biggest first."""
    by_size = sorted(sending.items(), key=lambda item: -item[1])
    listed = [f"{name} (about {human(size)})" for name, size in by_size[:_NAMES_LISTED]]
    if len(by_size) > _NAMES_LISTED:
        listed.append(f"{len(by_size) - _NAMES_LISTED} more")
    if not listed:
        return "its results"
    return listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]


def over_budget_before_it_ran(held_bytes: int, budget: Budget, enforced_by: str) -> HaltDecision:
    """The stop of a claim whose worker, as it came in, already held more than its budget.

    The kernel's cap charges a claim only for what its processes allocate once
    they are in it, so it cannot hold such a claim to its budget: it is
    stopped before its code runs, as the sampler would stop it at its first
    reading.
    """
    limit = budget.halt_bytes
    assert budget.applied_bytes is not None and limit is not None, "no budget, nothing to be over"
    return HaltDecision(
        should_halt=True,
        reason=HaltReason.OVER_BUDGET,
        message=(
            f"stopped before it ran: its worker alone holds {human(held_bytes)} (Python, "
            "IPython and what earlier cells imported), over the claim's memory budget of "
            f"{human(budget.applied_bytes)}. Ask for more with ram=."
        ),
        detail={"rss_bytes": held_bytes, "limit_bytes": limit},
        enforced_by=enforced_by,
    )


def over_gpu_budget(card: CardShare, budget: Budget) -> HaltDecision:
    """The stop of a claim holding more of one of its cards than its ``gpu_ram=``."""
    assert budget.gpu_bytes is not None, "no card budget, nothing to be over"
    of_card = f" of the card's {human(card.total_bytes)}" if card.total_bytes is not None else ""
    return HaltDecision(
        should_halt=True,
        reason=HaltReason.OVER_GPU_BUDGET,
        message=(
            f"the worker held {human(card.held_bytes)}{of_card} on card {card.index}, "
            f"over its card memory budget of {human(budget.gpu_bytes)} a card. It was halted "
            f"by the sampler, which reads the cards every {GPU_INTERVAL_S:g} s, so a fast "
            "allocation can get further before it is seen. Ask for more with gpu_ram=, "
            "or use less."
        ),
        detail={"card": card.index, "gpu_bytes": card.held_bytes, "limit_bytes": budget.gpu_bytes},
    )


def memory_warning(used_bytes: int, budget: Budget, enforced_by: str = SAMPLER) -> str:
    """The one line a claim is told, once, when it reaches the warning stage."""
    assert budget.applied_bytes is not None, "no budget, nothing to warn of"
    by = (
        "by the sampler"
        if enforced_by == SAMPLER
        else f"by the kernel's memory cap ({enforced_by})"
    )
    return (
        f"fluksio_nb: the worker is using {human(used_bytes)}, "
        f"{used_bytes / budget.applied_bytes:.0%} of its memory budget of "
        f"{human(budget.applied_bytes)}; at {budget.halt_at:.0%} it is stopped {by}. "
        "Free what the cell no longer needs, or ask for more with ram=.\n"
    )


def halt_decision(sample: Sample, budget: Budget, *, capped: bool = False) -> HaltDecision:
    """Stop when the claim is over its own budget, or the host is short of headroom.

    ``capped`` says the kernel holds the claim to its budget already: the
    sampler then leaves that to it and watches the host only. The two would
    not agree at the margin (a resident set counts shared library pages the
    cgroup charged to whoever loaded them first), and the one that is exact
    should be the one that acts.
    """
    limit = budget.halt_bytes
    if not capped and limit is not None and sample.rss_bytes > limit:
        return over_budget(sample.rss_bytes, budget)
    if budget.gpu_bytes is not None:
        for card in sample.cards:
            if card.held_bytes > budget.gpu_bytes:
                return over_gpu_budget(card, budget)

    headroom = system_headroom_bytes(sample.host_total_bytes)
    if sample.host_available_bytes < headroom:
        return HaltDecision(
            should_halt=True,
            reason=HaltReason.HOST_SHORT,
            message=(
                f"the machine ran short of memory ({human(sample.host_available_bytes)} "
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
