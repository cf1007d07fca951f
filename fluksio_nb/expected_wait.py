"""How long a queued claim may still wait, or why nobody can tell.

"Waiting" says nothing about whether to fetch a coffee or go home. The books
know what runs and since when, and the usage records how long the same work
took before; from those a rough figure can be given, and where they do not
reach, the honest answer is that nobody can tell, and why.

What it decides:

- **A claim's typical run is the median of its label's latest runs** (the
  usage records, :mod:`fluksio_nb.usage.recent`). A median, so one run left
  over a weekend does not move it.
- **The queue is played forward.** Each running claim ends after its
  typical run less its age (now, if it has outlasted it); each share freed
  goes to the next claim in the queue, which then holds it for its own
  typical run. A claim's wait is when a share first comes to it, so it
  rests on the past runs of what is ahead of it, never on its own: work
  run for the first time still gets a guess. This is how the queue moves
  when claims are alike; it is a guess, said as one.
- **A restarted books service holds every grant for a few seconds**, while
  kernels put back the claims that ran across the restart (its snapshot says
  until when, ``grants_resume_at``). A claim waiting then, with the machine
  free, says so, rather than "waits for room". Which claims go as the grace
  ends is the queue's own rule (:func:`~fluksio_nb.queue.who_goes_next`), so
  one that fits but takes what a claim ahead of it needs is not told it goes.
- **A label never run here falls back on its shape.** Where a running or
  queued claim's label has no past runs, the finished claims of the same
  shape (as many cpus and cards) stand in for them, and ``why`` says so.
- **Cannot tell is an answer, said with its subject.** Nothing running to
  wait for, a claim running or ahead that neither its label nor its shape
  has finished here, or one whose label is private: ``seconds`` is ``None``
  and ``why`` is a sentence that says who cannot tell and why
  (``nobody can tell when it starts: it waits for 'bg', and no claim
  labelled 'bg' or holding cpus=1 has finished here yet``).
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fluksio_nb.queue import who_goes_next

#: How every "cannot tell" begins: a sentence with a subject, not a bare clause.
CANNOT_TELL = "nobody can tell when it starts: "

#: A claim's shape: its cpus and how many cards. Past runs of the same shape
#: stand in for a label never run here.
Shape = tuple[int, int]


def typical(durations: Mapping[str, Sequence[float]], label: str | None) -> float | None:
    """The median of ``label``'s past runs, in seconds; ``None`` when there are none."""
    runs = durations.get(label or "") if label else None
    return statistics.median(runs) if runs else None


def shape_of(claim: Mapping[str, Any]) -> Shape | None:
    """A running claim's share, or a waiting one's ask, as ``(cpus, cards)``; None if unread."""
    held = claim.get("allocation")
    if isinstance(held, Mapping):
        cpus, cards = held.get("cpus"), held.get("gpus")
        cards = len(cards) if isinstance(cards, list) else None
    else:
        asked = claim.get("asked") or {}
        cpus, cards = asked.get("cpus"), asked.get("gpus", 0)
    if isinstance(cpus, int) and isinstance(cards, int):
        return (cpus, cards)
    return None


def shape_words(shape: Shape) -> str:
    """``cpus=1``, ``cpus=2 gpus=1``: a shape as the claim line says it."""
    return f"cpus={shape[0]}" + (f" gpus={shape[1]}" if shape[1] else "")


def expected_waits(
    snapshot: Mapping[str, Any],
    durations: Mapping[str, Sequence[float]],
    now: float | None = None,
    shapes: Mapping[Shape, Sequence[float]] | None = None,
) -> list[dict[str, Any]]:
    """Each waiting claim's ``{"seconds", "why"}``, in queue order.

    ``snapshot`` has ``running`` (each with ``label`` and ``since``, when it
    was granted or asked) and ``waiting`` in queue order; ``durations`` maps a
    label to its past runs' seconds, and ``shapes`` a shape (:func:`shape_of`)
    to its past runs', for labels with none.
    """
    now = time.time() if now is None else now
    shapes = shapes or {}
    resume_at = snapshot.get("grants_resume_at")
    if isinstance(resume_at, (int, float)) and resume_at > now:
        return _after_the_restart(snapshot, durations, resume_at - now, resume_at, shapes)
    waiting = list(snapshot.get("waiting", ()))
    running = list(snapshot.get("running", ()))
    if not running:
        return [{"seconds": None, "why": NOTHING_RUNNING} for _ in waiting]
    ends: list[float] = []
    unknown: str | None = None
    rests_on: set[str | None] = set()
    #: The labels never run here whose shape's runs stood in, by label.
    shaped: dict[str, Shape] = {}
    for claim in running:
        label = claim.get("label")
        runs = _runs_of(claim, durations, shapes, shaped)
        if runs is None:
            unknown = _why_unknown(label, "running", shape_of(claim))
            break
        rests_on.add(label)
        age = max(0.0, now - float(claim.get("granted_at") or claim.get("since") or now))
        ends.append(max(0.0, runs - age))
    answers: list[dict[str, Any]] = []
    heapq.heapify(ends)
    for claim in waiting:
        if unknown is not None:
            answers.append({"seconds": None, "why": unknown})
            continue
        # When a share first comes to it: what runs and waits ahead decides
        # that, not how long it runs itself, so work never run here before
        # still gets its guess.
        start = heapq.heappop(ends)
        why = _why_known(rests_on, durations, shaped, shapes)
        answers.append({"seconds": round(start, 1), "why": why})
        label = claim.get("label")
        runs = _runs_of(claim, durations, shapes, shaped)
        if runs is None:
            # How long it holds its share is unknown, so is when those behind it start.
            unknown = _why_unknown(label, "ahead", shape_of(claim))
            continue
        heapq.heappush(ends, start + runs)
        rests_on.add(label)
    return answers


#: Why nothing can be said of a claim with nothing running ahead of it.
NOTHING_RUNNING = f"{CANNOT_TELL}nothing is running for it to wait for (it waits for room)"


def _runs_of(
    claim: Mapping[str, Any],
    durations: Mapping[str, Sequence[float]],
    shapes: Mapping[Shape, Sequence[float]],
    shaped: dict[str, Shape],
) -> float | None:
    """The typical run of ``claim``: its label's, else its shape's (noted in ``shaped``)."""
    label = claim.get("label")
    runs = typical(durations, label)
    if runs is not None or label is None:
        # Another user's claim, its label private, stays unknown: its reader could
        # not see what a guess from its shape would rest on.
        return runs
    shape = shape_of(claim)
    found = shapes.get(shape) if shape is not None else None
    if not found:
        return None
    shaped[label] = shape  # type: ignore[assignment]
    return statistics.median(found)


def _fit_as_it_stands(snapshot: Mapping[str, Any]) -> list[bool]:
    """Whether each waiting claim, in queue order, goes in what is free, by the queue's rule.

    Only while a restarted service holds its grants can a waiting claim fit:
    at any other time it would have been granted.
    """
    waiting = list(snapshot.get("waiting", ()))
    try:
        free = (snapshot["cpus"]["free"], snapshot["gpus"]["free"], snapshot["ram_bytes"]["free"])
    except (KeyError, TypeError):
        return [False for _ in waiting]
    # One whose asking cannot be read is not known to go, and holds nobody back.
    read = []
    for index, claim in enumerate(waiting):
        asked = claim.get("asked") or {}
        need = tuple(asked.get(key) for key in ("cpus", "gpus", "ram_bytes"))
        if all(isinstance(n, int) for n in need):
            read.append((index, need))
    going = {read[at][0] for at in who_goes_next([need for _, need in read], free)}
    return [index in going for index in range(len(waiting))]


def _after_the_restart(
    snapshot: Mapping[str, Any],
    durations: Mapping[str, Sequence[float]],
    held_s: float,
    resume_at: float,
    shapes: Mapping[Shape, Sequence[float]],
) -> list[dict[str, Any]]:
    """The waits while a restarted service holds its grants, until ``resume_at``.

    What fits then starts then; the queue is played forward from that
    moment for the rest, with those counted as running.
    """
    why = (
        f"the machine's books service has just restarted, and grants nothing for "
        f"{math.ceil(held_s)} s more, while kernels put back the claims that ran across it"
    )
    waiting = list(snapshot.get("waiting", ()))
    fits = _fit_as_it_stands(snapshot)
    paired = list(zip(waiting, fits, strict=True))
    starting = [{**claim, "granted_at": resume_at} for claim, fit in paired if fit]
    later = iter(
        expected_waits(
            {
                "running": [*snapshot.get("running", ()), *starting],
                "waiting": [claim for claim, fit in paired if not fit],
            },
            durations,
            now=resume_at,
            shapes=shapes,
        )
    )
    answers = []
    for fit in fits:
        guess = None if fit else next(later)
        if guess is None or guess["why"] == NOTHING_RUNNING:
            # It fits, or nothing runs (or has come back yet): it starts as the grace ends.
            answers.append({"seconds": round(held_s, 1), "why": why})
        elif guess["seconds"] is None:
            answers.append({"seconds": None, "why": f"{guess['why']}; and {why}"})
        else:
            seconds = round(held_s + guess["seconds"], 1)
            answers.append({"seconds": seconds, "why": f"{why}; then {guess['why']}"})
    return answers


def _why_unknown(label: str | None, where: str, shape: Shape | None) -> str:
    """Why nobody can tell, as a sentence: whose run is unknown, and that nothing like it ran."""
    if label is None:
        whose = {"running": "a running claim", "ahead": "a claim ahead of it"}[where]
        return f"{CANNOT_TELL}{whose} keeps its label private, so how long it runs is unknown"
    subject = {"running": f"it waits for {label!r}", "ahead": f"{label!r} is ahead of it"}[where]
    alike = f" or holding {shape_words(shape)}" if shape is not None else ""
    return f"{CANNOT_TELL}{subject}, and no claim labelled {label!r}{alike} has finished here yet"


def _why_known(
    labels: set[str | None],
    durations: Mapping[str, Sequence[float]],
    shaped: Mapping[str, Shape] | None = None,
    shapes: Mapping[Shape, Sequence[float]] | None = None,
) -> str:
    """What a guess rests on: the past runs of the labels, or shapes, that run or wait ahead."""
    shaped, shapes = shaped or {}, shapes or {}
    named = sorted(label for label in labels if label and label not in shaped)
    runs = sum(len(durations.get(label, ())) for label in named)
    parts = []
    if named:
        parts.append(
            f"{runs} past run{'s' if runs != 1 else ''} of {' and '.join(map(repr, named))}"
        )
    for label in sorted(label for label in labels if label in shaped):
        shape = shaped[label]
        n = len(shapes.get(shape, ()))
        parts.append(
            f"{n} past run{'s' if n != 1 else ''} of claims holding {shape_words(shape)} "
            f"(none yet labelled {label!r})"
        )
    return f"from {', '.join(parts)} and the running claims' ages"


def with_expected_waits(
    snapshot: dict[str, Any],
    durations: Mapping[str, Sequence[float]],
    shapes: Mapping[Shape, Sequence[float]] | None = None,
) -> dict[str, Any]:
    """The snapshot with ``expected_wait`` in each waiting entry."""
    for claim, guess in zip(
        snapshot.get("waiting", ()),
        expected_waits(snapshot, durations, shapes=shapes),
        strict=True,
    ):
        claim["expected_wait"] = guess
    return snapshot


def describe_span(seconds: float) -> str:
    """A rough length of time: ``under a minute``, ``about 4 min``, ``about 1 h 20 min``."""
    if seconds < 60:
        return "under a minute"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"about {minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"about {hours} h" + (f" {minutes} min" if minutes else "")


def describe_wait(guess: Mapping[str, Any]) -> str:
    """A waiting claim's ``expected_wait`` in words: a guess and what it is from, or why not."""
    if guess.get("seconds") is None:
        return str(guess["why"])
    seconds = float(guess["seconds"])
    when = "any moment now" if seconds < 1 else f"in {describe_span(seconds)}"
    return f"expected to start {when} ({guess['why']})"
