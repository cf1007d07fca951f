"""The shape of the Ray task that runs a claim: its resources, its environment, its cell.

A claim's ``cpus=``, ``gpus=`` and ``ram=`` become Ray's ``num_cpus``,
``num_gpus`` and ``memory``, and the environment a local claim's worker is
started with must reach the task's worker too. This module says what the
task is asked for, and refuses a claim before it is sent when no node could
hold it.

What this module decides:

- **The environment travels in ``runtime_env``.** Ray sets
  ``CUDA_VISIBLE_DEVICES`` for the cards it grants, and that value is kept.
  Every thread variable of :data:`fluksio_nb.env.THREAD_VARS` is set through
  ``runtime_env["env_vars"]``, ``OMP_NUM_THREADS`` included: Ray only sets that
  one when the worker's environment lacks it, so a raylet started from a shell
  that exported it would otherwise pass the shell's value on. A claim that got
  no card has the cards hidden, as locally (:mod:`.task_side`).
- **A task never runs twice.** Ray retries a task whose worker died; a cell is
  not idempotent, so ``max_retries=0``.
- **A claim no node can hold fails at once**, naming what the largest node
  has, because Ray would wait for such a node forever.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fluksio_nb.books import Allocation
from fluksio_nb.budget import human
from fluksio_nb.env import derive_env, fraction_env
from fluksio_nb.errors import BadClaim, ClaimTooBigForCluster
from fluksio_nb.ray.connection import Machine, _alive_nodes, ray_connection
from fluksio_nb.resources import Resources


def ray_env(wanted: Resources) -> dict[str, str]:
    """The variables set through ``runtime_env``: the derived env, less Ray's cards."""
    env = derive_env(wanted, Allocation(cpus=wanted.cpus, ram_bytes=wanted.ram_bytes))
    del env["CUDA_VISIBLE_DEVICES"]
    if isinstance(wanted.gpus, float):
        # Ray's card is its own to pick; the share of it is this claim's to say.
        env.update(fraction_env(wanted.gpus))
    return env


def task_options(wanted: Resources, label: str) -> dict[str, Any]:
    """Ray's options for the task that runs a claim."""
    options: dict[str, Any] = {
        "num_cpus": wanted.cpus,
        "num_gpus": ray_gpus(wanted),
        "runtime_env": {"env_vars": ray_env(wanted)},
        "max_retries": 0,
        "name": f"%%claim {label}",
    }
    if wanted.ram is not None:
        options["memory"] = wanted.ram_bytes
    return options


def ray_resources(wanted: Resources) -> dict[str, float]:
    """A claim in Ray's names: what a node must have, and what a placement group's bundle holds."""
    resources = {"CPU": float(wanted.cpus)}
    if ray_gpus(wanted):
        resources["GPU"] = float(ray_gpus(wanted))
    if wanted.ram is not None:
        resources["memory"] = float(wanted.ram_bytes)
    return resources


def ray_gpus(wanted: Resources) -> float:
    """Ray's ``num_gpus``: whole cards, or a fraction of one for a slice (``gpus=0.5``)."""
    if wanted.is_slice and not isinstance(wanted.gpus, float):
        raise BadClaim(
            f"{wanted.describe()}: Ray shares a card by fraction, not by memory; this "
            "slice is sized from the cluster's cards when the claim is sent "
            "(fluksio_nb.ray.card_memory), or ask for it as a fraction: gpus=0.5"
        )
    return wanted.gpus


def check_fits(wanted: Resources, nodes: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a claim no live node could ever hold, naming what the largest one has."""
    alive = [node.get("Resources", {}) for node in _alive_nodes(nodes)]
    asked = ray_resources(wanted)
    if any(all(have.get(key, 0) >= need for key, need in asked.items()) for have in alive):
        return
    if not alive:
        raise ClaimTooBigForCluster(
            f"{wanted.describe()} cannot run on this Ray cluster: it has no live node. "
            "Start one (ray start), or connect to another cluster."
        )
    largest = max(
        alive, key=lambda have: (have.get("CPU", 0), have.get("GPU", 0), have.get("memory", 0))
    )
    count = f" of {len(alive)}" if len(alive) > 1 else ""
    raise ClaimTooBigForCluster(
        f"{wanted.describe()} cannot run on this Ray cluster: its largest node{count} has "
        f"{_describe_node(largest)}, and a claim runs on one node. Ask for less."
    )


def _check_fits(ray: Any, job: str, wanted: Resources) -> None:
    """:func:`check_fits` against the cluster's nodes, read at most every few seconds.

    A claim that does not fit the nodes last read is checked again against
    the nodes as they are now, so a node that joined since is counted.
    """
    recent = ray_connection.recent_nodes(job)
    if recent is not None:
        with contextlib.suppress(ClaimTooBigForCluster):
            check_fits(wanted, recent)
            return
    check_fits(wanted, ray_connection.read_nodes(ray, job))


def _describe_node(resources: Mapping[str, float]) -> str:
    return (
        f"cpus={resources.get('CPU', 0):g} gpus={resources.get('GPU', 0):g} "
        f"memory={human(int(resources.get('memory', 0)))}"
    )


@dataclass(frozen=True)
class TaskCell:
    """What the task is told of its cell, beside the inputs: one argument rather than eight.

    Ray serialises every argument of a task on its own, and eight small ones
    were a fifth of what an empty cell's task cost over a bare one.
    """

    mailboxes: str
    box: str
    code: str
    outputs: list[str] | None
    ram_bytes: int | None
    #: Card memory each card may hold (``gpu_ram=``), held on the node as here.
    gpu_ram_bytes: int | None
    through_client: bool
    #: Inputs that come back too if the cell changed them in place.
    if_changed: list[str]
    #: The global random streams the cell draws from.
    random_state: dict[str, Any] | None
    #: The name of each input that follows, in order.
    names: list[str]
    #: The kernel's machine (:func:`~.connection.this_machine`) when every node
    #: of the cluster is that machine: the values then travel through its
    #: shared memory rather than the object store, both ways.
    machine: Machine | None = None
    #: The inputs, already in the kernel's shared memory, when ``machine`` is set.
    parcel: Any = None
