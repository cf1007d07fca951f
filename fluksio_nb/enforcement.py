"""What holds a claim to its share, per resource, as every view says it.

A share is enforced where the OS allows and asked for everywhere else, and
the two are not the same promise: a claim on cores of its own cannot slow
its neighbours whatever it starts, while one held by thread variables alone
is only as good as the libraries that read them. So the views (the claim's
widget and text, ``%claims``, ``fluksio-nb``, the panel) never show a share
without saying which of the two holds it.

Memory is decided in :mod:`fluksio_nb.memory_cap`, cards in
:mod:`fluksio_nb.card_devices` (a devices cgroup, or the variable only,
in the words of :func:`cards_held`); cores here, because the
answer is only which cores the books handed out and whether pinning is on,
and in :mod:`fluksio_nb.cpuset` whether a cpuset holds them or affinity only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fluksio_nb.budget import CGROUP_V2, SAMPLER

#: What holds a claim to its cores when the OS does.
AFFINITY = "affinity"
#: What holds it when a cpuset of its own does, which a cell cannot re-pin itself out of.
CPUSET = "cpuset"
#: What holds it when only the thread variables do.
THREAD_VARIABLES = "thread variables"
#: What holds a claim to its cards when no device cgroup does: CUDA reads it, nothing else.
CARD_VARIABLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Enforcement:
    """What holds a claim to one resource, as the package shows it."""

    #: What a person reads: ``"enforced (cgroup v1)"``, ``"own cores (affinity)"``.
    label: str
    #: What acts: ``"cgroup v1"``, ``"cpuset"``, ``"affinity"``, ``"sampler"``,
    #: ``"thread variables"``.
    by: str
    #: Why the OS does not enforce it, when it does not: for a tooltip.
    why: str = ""

    def __str__(self) -> str:
        return self.label

    @property
    def capped(self) -> bool:
        return self.by not in (SAMPLER, THREAD_VARIABLES, CARD_VARIABLE)

    def as_dict(self) -> dict[str, str]:
        return {"label": self.label, "by": self.by, "why": self.why}


def quota_enforcement(cpus: int, version: str, why: str) -> Enforcement:
    """A claim held to ``cpus`` cores' worth of time, where it has no cores of its own."""
    return Enforcement(f"quota of {cpus} core{'s' if cpus != 1 else ''} ({version})", version, why)


def cores_enforcement(
    cores: Sequence[int], pin_cores: bool, cpus: int | None = None
) -> Enforcement:
    """What holds a claim (or, with ``cores`` the books' ids, every claim) to its cores."""
    if not pin_cores:
        return Enforcement(
            THREAD_VARIABLES, THREAD_VARIABLES, "pinning is turned off (pin_cores in config)"
        )
    if not cores:
        why = "this machine has fewer cores than the cpus declared for claims"
        if cpus is not None:
            why = f"{cpus} cpus are declared for claims, more than the cores there are to pin"
        return Enforcement(THREAD_VARIABLES, THREAD_VARIABLES, why)
    return own_cores()


def own_cores(by: str = AFFINITY, why: str = "") -> Enforcement:
    """A claim on cores of its own, held there by ``by``: its affinity, or a cpuset.

    ``why`` says, for affinity, why no cpuset holds it: affinity is the
    process's own to change, so a cell may move itself onto another claim's core.
    """
    return Enforcement(f"own cores ({by})", by, why)


def cards_held(version: str | None, why: str = "") -> Enforcement:
    """A claim's cards held by a devices cgroup of ``version``, or, with none, by the variable only.

    The words every view shows, the same in each: the claim's share
    (``gpus=1 (card 0, devices cgroup v1)``) and every "held by" line
    (``cards: devices cgroup v1``); on cgroup v2, ``device program (cgroup v2)``.
    A claim held by the variable alone is only as good as every process of it
    honouring ``CUDA_VISIBLE_DEVICES``.
    """
    if version is None:
        return Enforcement(f"{CARD_VARIABLE} only", CARD_VARIABLE, why)
    if version == CGROUP_V2:
        # v2 has no devices controller: a BPF program attached to the cgroup holds them.
        return Enforcement(f"device program ({version})", f"device program ({version})", why)
    return Enforcement(f"devices {version}", f"devices {version}", why)
