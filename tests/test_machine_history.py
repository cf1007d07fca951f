"""The machine's last ten minutes: what a point holds, how often, and how long it is kept.

The host's CPU is read for real (``/proc/stat``); only the wall clock a
point is stamped with is given, so that ten minutes need not pass.
"""

from __future__ import annotations

import itertools
import time

from fluksio_nb.machine_history import (
    INTERVAL_S,
    MachineHistory,
    claims_cpu_percent,
    take_point,
)

MEMORY = (16_000_000_000, 10_000_000_000)


def busy(seconds: float) -> None:
    """Spend some CPU, so the host's counters move between two points."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_first_reading_only_starts_the_counters_and_the_second_is_a_point():
    """Guards against a first point of 0% or 100% CPU measured over no time at all."""
    history = MachineHistory()
    assert history.add(claims_cpu=None, memory=MEMORY, cards=[], now=1000.0) is None
    busy(0.05)
    point = history.add(claims_cpu=0.0, memory=MEMORY, cards=[], now=1000.0 + INTERVAL_S)
    assert point is not None
    assert 0 < point["cpu_percent"] <= 100
    assert point["memory_used_bytes"] == 6_000_000_000
    assert point["memory_total_bytes"] == 16_000_000_000
    assert history.points(now=1000.0 + INTERVAL_S) == [point]


def test_points_come_no_closer_than_the_interval_and_older_ones_fall_off():
    """Guards against a history crowded by a fast ticker, or one that grows for ever."""
    history = MachineHistory(span_s=20.0, interval_s=2.0)
    history.add(claims_cpu=None, memory=MEMORY, cards=[], now=0.0)
    kept = 0
    for step in range(1, 60):
        busy(0.02)  # so that the host's counters have moved by a tick
        # Fed twice as often as a point is kept.
        if history.add(claims_cpu=None, memory=MEMORY, cards=[], now=float(step)) is not None:
            kept += 1
    assert kept == 29
    points = history.points(now=59.0)
    ats = [point["at"] for point in points]
    assert ats == sorted(ats), "oldest first"
    assert ats == [float(at) for at in range(40, 59, 2)], "the last 20 s, a point each 2 s"
    assert all(b - a >= 2.0 for a, b in itertools.pairwise(ats))


def test_cpu_outside_claims_is_the_host_less_the_claims_and_unknown_where_a_claim_is():
    """Guards against a guess shown as a measurement: one unread claim makes it unknown."""
    read = [{"readings": {"cpu_percent": 20.0}}, {"readings": {"cpu_percent": 5.5}}]
    assert claims_cpu_percent(read) == 25.5
    assert claims_cpu_percent([*read, {"readings": None}]) is None
    assert claims_cpu_percent([]) == 0.0

    history = MachineHistory()
    history.add(claims_cpu=None, memory=MEMORY, cards=[], now=0.0)
    busy(0.05)
    point = history.add(claims_cpu=1000.0, memory=MEMORY, cards=[], now=INTERVAL_S)
    assert point["cpu_outside_claims_percent"] == 0.0, "never below nothing"
    busy(0.05)
    point = history.add(claims_cpu=None, memory=MEMORY, cards=[], now=2 * INTERVAL_S)
    assert point["cpu_outside_claims_percent"] is None


def test_a_point_from_books_that_see_one_kernel_says_nothing_of_cpu_outside_claims():
    """Guards against counting other kernels' claims as load from outside any claim."""
    snapshot = {"running": [], "cards": [], "sees_every_claim": False}
    history = MachineHistory(interval_s=0.0)
    take_point(history, snapshot, MEMORY)
    busy(0.02)
    point = take_point(history, snapshot, MEMORY)
    assert point["cpu_outside_claims_percent"] is None
    busy(0.02)
    point = take_point(history, {**snapshot, "sees_every_claim": True}, MEMORY)
    assert point["cpu_outside_claims_percent"] == point["cpu_percent"]


def test_a_card_is_in_a_point_only_where_it_was_read():
    """Guards against an unread card drawn as an idle one."""
    card = {
        "index": 0,
        "uuid": "GPU-1",
        "utilisation_percent": 40.0,
        "used_bytes": 2_000_000_000,
        "total_bytes": 40_000_000_000,
        "tickets": [3],
        "text": "card 0: 40% busy",
    }
    history = MachineHistory(interval_s=0.0)
    take_point(history, {"running": [], "cards": []}, MEMORY)
    busy(0.02)
    assert take_point(history, {"running": [], "cards": []}, MEMORY)["cards"] == []
    busy(0.02)
    point = take_point(history, {"running": [], "cards": [card]}, MEMORY)
    assert point["cards"] == [
        {
            "index": 0,
            "used_bytes": 2_000_000_000,
            "total_bytes": 40_000_000_000,
            "utilisation_percent": 40.0,
        }
    ]
