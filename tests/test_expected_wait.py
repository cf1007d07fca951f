"""A queued claim's expected wait: played forward from the running claims' ages and past runs."""

from __future__ import annotations

from fluksio_nb.expected_wait import describe_wait, expected_waits, with_expected_waits

NOW = 10_000.0


def running(label: str | None, started_ago: float) -> dict:
    return {"label": label, "since": NOW - started_ago - 5, "granted_at": NOW - started_ago}


def waiting(label: str | None) -> dict:
    return {"label": label, "since": NOW - 1}


def asking(cpus: int) -> dict:
    return {**waiting("fit"), "asked": {"cpus": cpus, "gpus": 0, "ram_bytes": 0}}


def one_core_free_in_a_grace(queue: list[dict]) -> dict:
    """A restarted service's snapshot, 60 s of grace left: one claim put back runs on
    a core of two, and ``queue`` waits."""
    return {
        "running": [running("fit", 100)],
        "waiting": queue,
        "cpus": {"free": 1},
        "gpus": {"free": 0},
        "ram_bytes": {"free": 0},
        "grants_resume_at": NOW + 60,
    }


def test_the_next_claim_waits_for_the_running_claims_typical_run_less_its_age():
    """Guards against a guess that ignores how long the running claim has already run."""
    snapshot = {"running": [running("fit", 100)], "waiting": [waiting("fit")]}
    (guess,) = expected_waits(snapshot, {"fit": [300.0, 400.0, 500.0]}, now=NOW)
    assert guess == {
        "seconds": 300.0,
        "why": "from 3 past runs of 'fit' and the running claims' ages",
    }
    assert describe_wait(guess).startswith("expected to start in about 5 min (from 3 past runs")


def test_a_claim_further_back_waits_for_those_ahead_of_it_to_run_too():
    """Guards against every claim in the queue being told it starts as soon as the first."""
    snapshot = {
        "running": [running("fit", 0), running("prep", 50)],
        "waiting": [waiting("prep"), waiting("fit"), waiting("prep")],
    }
    durations = {"fit": [600.0], "prep": [60.0]}
    seconds = [g["seconds"] for g in expected_waits(snapshot, durations, now=NOW)]
    # prep frees a share at 10 s; the queued prep runs 10-70, the fit 70-670, the last prep
    # gets the first fit's share at 600.
    assert seconds == [10.0, 70.0, 600.0]


def test_an_overdue_running_claim_makes_it_any_moment_now():
    """Guards against negative waits when a claim outlasts its past runs."""
    snapshot = {"running": [running("fit", 900)], "waiting": [waiting("fit")]}
    (guess,) = expected_waits(snapshot, {"fit": [300.0]}, now=NOW)
    assert guess["seconds"] == 0.0
    assert describe_wait(guess).startswith("expected to start any moment now")


def test_work_never_run_here_learns_when_it_starts_but_those_behind_it_cannot():
    """Guards against a first run of anything being told "cannot tell": when it
    starts rests on what is ahead of it, only how long it holds its share on itself."""
    durations = {"fit": [300.0]}
    snapshot = {"running": [running("fit", 0)], "waiting": [waiting("new"), waiting("fit")]}
    first, second = expected_waits(snapshot, durations, now=NOW)
    assert first == {
        "seconds": 300.0,
        "why": "from 1 past run of 'fit' and the running claims' ages",
    }
    assert second == {
        "seconds": None,
        "why": "nobody can tell when it starts: 'new' is ahead of it, and no claim labelled "
        "'new' has finished here yet",
    }


def test_cannot_tell_says_why_and_passes_it_down_the_queue():
    """Guards against a number made up where nothing like the work has run here."""
    durations = {"fit": [300.0]}
    ahead_private = {"running": [running("fit", 0)], "waiting": [waiting(None), waiting("fit")]}
    _, behind = expected_waits(ahead_private, durations, now=NOW)
    assert behind == {
        "seconds": None,
        "why": "nobody can tell when it starts: a claim ahead of it keeps its label private, "
        "so how long it runs is unknown",
    }

    unknown_running = {"running": [running("mystery", 0)], "waiting": [waiting("fit")]}
    (guess,) = expected_waits(unknown_running, durations, now=NOW)
    assert guess["why"] == (
        "nobody can tell when it starts: it waits for 'mystery', and no claim labelled "
        "'mystery' has finished here yet"
    )

    private = {"running": [running(None, 0)], "waiting": [waiting("fit")]}
    (guess,) = expected_waits(private, durations, now=NOW)
    assert guess == {
        "seconds": None,
        "why": "nobody can tell when it starts: a running claim keeps its label private, "
        "so how long it runs is unknown",
    }
    assert describe_wait(guess) == guess["why"]

    nothing_running = {"running": [], "waiting": [waiting("fit")]}
    (guess,) = expected_waits(nothing_running, durations, now=NOW)
    assert guess["seconds"] is None and "nothing is running" in guess["why"]


def test_a_label_never_run_here_is_guessed_from_finished_claims_of_its_shape():
    """Guards against "cannot tell: nothing like the running claim 'bg' has finished here
    yet" when other cpus=1 claims have finished: their runs stand in, and the guess says so."""
    bg = {**running("bg", 0), "allocation": {"cpus": 1, "gpus": [], "ram_bytes": 0}}
    snapshot = {"running": [bg], "waiting": [waiting("fit")]}
    shapes = {(1, 0): [60.0, 100.0, 80.0], (2, 0): [999.0]}
    (guess,) = expected_waits(snapshot, {}, now=NOW, shapes=shapes)
    assert guess == {
        "seconds": 80.0,
        "why": "from 3 past runs of claims holding cpus=1 (none yet labelled 'bg') "
        "and the running claims' ages",
    }
    # With no claim of its shape finished either, the sentence says both were looked for.
    (guess,) = expected_waits(snapshot, {}, now=NOW, shapes={(2, 0): [999.0]})
    assert guess == {
        "seconds": None,
        "why": "nobody can tell when it starts: it waits for 'bg', and no claim labelled "
        "'bg' or holding cpus=1 has finished here yet",
    }


def test_the_guess_is_a_median_so_one_long_run_does_not_move_it():
    """Guards against one run left over a weekend making every later guess days long."""
    snapshot = {"running": [running("fit", 0)], "waiting": [waiting("fit")]}
    (guess,) = expected_waits(snapshot, {"fit": [100.0, 120.0, 200_000.0]}, now=NOW)
    assert guess["seconds"] == 120.0


def test_every_waiting_entry_gets_its_guess():
    snapshot = {"running": [running("fit", 0)], "waiting": [waiting("fit"), waiting("x")]}
    with_expected_waits(snapshot, {"fit": [10.0]})
    assert [set(w["expected_wait"]) for w in snapshot["waiting"]] == [{"seconds", "why"}] * 2


def test_a_restart_of_the_books_service_holds_the_queue_and_says_so():
    """Guards against a claim waiting out a restarted service's grace on a free machine
    told "nothing is running for it to wait for", and against guesses that forget
    the queue stands still until the grace ends."""
    alone = {"running": [], "waiting": [waiting(None)], "grants_resume_at": NOW + 2.4}
    (guess,) = expected_waits(alone, {}, now=NOW)
    assert guess == {
        "seconds": 2.4,
        "why": "the machine's books service has just restarted, and grants nothing for "
        "3 s more, while kernels put back the claims that ran across it",
    }
    assert describe_wait(guess).startswith("expected to start in under a minute (the machine's")

    # A claim put back runs on, holding one of two cores: the first in the queue fits
    # beside it and starts as the grace ends; the next waits for it from then.
    behind = one_core_free_in_a_grace([asking(1), asking(1)])
    fits, waits = expected_waits(behind, {"fit": [300.0]}, now=NOW)
    assert fits["seconds"] == 60 and fits["why"].startswith("the machine's books service has")
    assert waits["seconds"] == 60 + 300 - 160
    assert waits["why"].endswith("then from 1 past run of 'fit' and the running claims' ages")

    # Once the grace is over, the queue is as it always is.
    over = {**behind, "waiting": [asking(1)], "grants_resume_at": NOW - 1}
    (guess,) = expected_waits(over, {"fit": [300.0]}, now=NOW)
    assert guess == {
        "seconds": 200.0,
        "why": "from 1 past run of 'fit' and the running claims' ages",
    }


def test_a_claim_that_would_take_what_one_ahead_needs_is_not_told_it_goes_as_the_grace_ends():
    """Guards against the guess using its own fit, not the queue's rule: the claim of one core
    behind one of two was told it starts as the grace ends, where the rule sets that core
    aside for the claim ahead."""
    held = one_core_free_in_a_grace([asking(2), asking(1)])
    ahead, behind = expected_waits(held, {"fit": [300.0]}, now=NOW)
    assert ahead["seconds"] == 60 + 300 - 160
    assert behind["seconds"] > ahead["seconds"]
