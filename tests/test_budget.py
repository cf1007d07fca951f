"""The memory budget and the halt decision.

The failures guarded against: a claim that eats the machine's memory and is
never stopped, and a claim stopped with a reason that sends the user looking
in the wrong place (their own cell, when another process took the memory).
"""

from fluksio_nb.budget import (
    CGROUP_V1,
    SAMPLER,
    Budget,
    HaltReason,
    halt_decision,
    in_the_copy_back,
    memory_warning,
    over_budget,
    resolve_budget,
)
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


def test_the_halt_says_which_one_acted():
    """The same overrun reads differently when a half-second reading or the kernel caught it."""
    budget = Budget(2 * GIB, 2 * GIB)
    sampled = over_budget(3 * GIB, budget)
    capped = over_budget(2 * GIB, budget, CGROUP_V1)
    assert sampled == halt_decision(sample(rss=3 * GIB), budget)
    assert sampled.enforced_by == SAMPLER
    assert "halted by the sampler, which reads memory every 0.5 s" in sampled.message
    assert capped.enforced_by == CGROUP_V1
    assert "stopped by the kernel's memory cap (cgroup v1)" in capped.message
    for decision in (sampled, capped):
        assert decision.reason is HaltReason.OVER_BUDGET
        assert "memory budget of 2.1GB" in decision.message


def test_a_stop_during_the_copy_back_says_so_and_names_what_was_copied_and_how_big():
    """Guards against blaming the cell's code for the copy of its results: the user must read
    that the copy back crossed the line, which names were being copied, their sizes, and how
    to send less."""
    budget = Budget(500 * 10**6, 500 * 10**6)
    sending = {f"small{i}": 28 for i in range(5)} | {"text": 300 * 10**6}
    for stopped in (over_budget(600 * 10**6, budget), over_budget(500 * 10**6, budget, CGROUP_V1)):
        decision = in_the_copy_back(stopped, budget, sending)
        assert decision.reason is HaltReason.OVER_BUDGET
        assert decision.enforced_by == stopped.enforced_by
        assert decision.detail["sending"] == sending
        message = decision.message
        assert message.startswith("stopped while its results were copied back to the kernel")
        assert "copying text (about 300.0MB), small0 (about 28B), " in message
        assert "small3 (about 28B) and 1 more took the worker to" in message
        assert "over its memory budget of 500.0MB" in message
        assert "--out NAMES" in message and "del " in message and "ram=" in message
    assert (
        "the sampler, which reads memory every 0.5 s"
        in in_the_copy_back(over_budget(600 * 10**6, budget), budget, sending).message
    )


def test_code_that_went_past_the_budget_between_readings_is_still_blamed_during_the_copy():
    """Guards against putting on the copy back a stop the cell's code earned: 2 GB made in
    less than the sampler's half second is first seen while the results go back."""
    budget = Budget(300 * 10**6, 300 * 10**6)
    seen_late = over_budget(2 * GIB, budget)
    assert in_the_copy_back(seen_late, budget, {"block": 2 * GIB}, 2 * GIB) == seen_late
    assert (
        "copied back"
        in in_the_copy_back(seen_late, budget, {"block": 2 * GIB}, 200 * 10**6).message
    )


def test_a_host_short_of_memory_during_the_copy_back_is_still_the_hosts_doing():
    """Guards against a stop for the host's memory being put on the copy back, or the cell."""
    short = halt_decision(sample(rss=GIB, available=GIB // 4), Budget(2 * GIB, 2 * GIB))
    assert in_the_copy_back(short, Budget(2 * GIB, 2 * GIB), {"text": GIB}) == short


def test_under_the_kernels_cap_the_sampler_leaves_the_budget_to_it_but_watches_the_host():
    """Two judges of one budget disagree at the margin; only the exact one acts."""
    budget = Budget(2 * GIB, 2 * GIB)
    assert not halt_decision(sample(rss=3 * GIB), budget, capped=True).should_halt
    host_short = halt_decision(sample(rss=GIB, available=0), budget, capped=True)
    assert host_short.reason is HaltReason.HOST_SHORT


def test_the_budget_is_staged_warned_first_then_stopped():
    budget = resolve_budget(
        GIB, host_total_bytes=16 * GIB, host_available_bytes=12 * GIB, warn_at=0.5, halt_at=0.9
    )
    assert (budget.warn_bytes, budget.halt_bytes) == (GIB // 2, int(GIB * 0.9))
    assert not halt_decision(sample(rss=int(GIB * 0.85)), budget).should_halt
    halted = halt_decision(sample(rss=int(GIB * 0.95)), budget)
    assert halted.should_halt and "stopped at 90% of it" in halted.message
    line = memory_warning(int(GIB * 0.6), budget)
    assert line.count("\n") == 1 and "60% of its memory budget of 1.1GB" in line


def with_card(held, total=16 * GIB, index=1):
    from dataclasses import replace

    from fluksio_nb.sampler import CardShare

    card = CardShare(
        index=index, held_bytes=held, used_bytes=held, total_bytes=total, utilisation_percent=90.0
    )
    return replace(sample(GIB), cards=(card,))


def test_a_claim_over_its_card_memory_budget_is_halted_naming_the_card_and_the_numbers():
    budget = Budget(None, None, gpu_bytes=8 * 10**9)
    decision = halt_decision(with_card(9 * 10**9), budget)
    assert decision.should_halt and decision.reason is HaltReason.OVER_GPU_BUDGET
    assert decision.message.startswith(
        "the worker held 9.0GB of the card's 17.2GB on card 1, over its card memory "
        "budget of 8.0GB a card."
    )
    assert "gpu_ram=" in decision.message
    assert decision.detail == {"card": 1, "gpu_bytes": 9 * 10**9, "limit_bytes": 8 * 10**9}


def test_card_memory_within_the_budget_or_without_one_goes_on():
    assert not halt_decision(
        with_card(7 * 10**9), Budget(None, None, gpu_bytes=8 * 10**9)
    ).should_halt
    assert not halt_decision(with_card(15 * 10**9), Budget(None, None)).should_halt
