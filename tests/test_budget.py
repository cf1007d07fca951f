"""The memory budget and the halt decision.

The failures guarded against: a claim that eats the machine's memory and is
never stopped, and a claim stopped with a reason that sends the user looking
in the wrong place (their own cell, when another process took the memory).
"""

from fluksio_nb.budget import Budget, HaltReason, halt_decision, resolve_budget
from fluksio_nb.sampler import Sample

GIB = 2**30


def sample(rss, total=16 * GIB, available=8 * GIB):
    return Sample(
        rss_bytes=rss,
        cpu_percent=50.0,
        cpu_cores=1.0,
        processes=1,
        host_total_bytes=total,
        host_available_bytes=available,
        at=0.0,
    )


def test_a_quiet_host_applies_the_whole_granted_budget():
    budget = resolve_budget(4 * GIB, host_total_bytes=16 * GIB, host_available_bytes=12 * GIB)
    assert budget == Budget(4 * GIB, 4 * GIB)
    assert not budget.limited_by_host


def test_a_busy_host_applies_less_than_was_granted():
    """Processes outside any claim hold memory the books never saw."""
    budget = resolve_budget(4 * GIB, host_total_bytes=16 * GIB, host_available_bytes=3 * GIB)
    # 3 GiB free less the 1.6 GiB headroom of a 16 GiB host.
    assert budget.applied_bytes == 3 * GIB - int(1.6 * GIB)
    assert budget.limited_by_host


def test_a_claim_without_ram_has_no_budget_of_its_own():
    assert resolve_budget(None, host_total_bytes=GIB, host_available_bytes=0) == Budget(None, None)
    assert not halt_decision(sample(rss=64 * GIB), Budget(None, None)).should_halt


def test_under_budget_with_a_healthy_host_carries_on():
    decision = halt_decision(sample(rss=GIB), Budget(2 * GIB, 2 * GIB))
    assert not decision.should_halt
    assert decision.reason is HaltReason.NONE


def test_over_its_own_budget_is_halted_with_the_numbers():
    decision = halt_decision(sample(rss=3 * GIB), Budget(2 * GIB, 2 * GIB))
    assert decision.should_halt
    assert decision.reason is HaltReason.OVER_BUDGET
    assert decision.detail == {"rss_bytes": 3 * GIB, "limit_bytes": 2 * GIB}
    assert "3.2GB, over its memory budget of 2.1GB" in decision.message


def test_a_host_short_of_headroom_is_halted_for_that_reason():
    """Another process took the memory; the message must not blame the cell's budget."""
    decision = halt_decision(sample(rss=GIB, available=GIB), Budget(8 * GIB, 8 * GIB))
    assert decision.should_halt
    assert decision.reason is HaltReason.HOST_SHORT
    assert decision.detail["headroom_bytes"] == int(1.6 * GIB)
    assert "the machine ran short of memory" in decision.message


def test_the_budget_is_checked_before_the_host():
    decision = halt_decision(sample(rss=3 * GIB, available=0), Budget(2 * GIB, 2 * GIB))
    assert decision.reason is HaltReason.OVER_BUDGET


def test_a_budget_lowered_by_the_host_says_so_when_it_halts():
    decision = halt_decision(sample(rss=2 * GIB), Budget(4 * GIB, GIB))
    assert "lowered to what the host had free" in decision.message
