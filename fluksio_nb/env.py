"""What a claim's worker is told about the share it got.

The knobs that size a numerical library's thread pool, and the variable that
decides which GPUs CUDA can see, are read once, when the library is imported.
Setting them in a running kernel does nothing, which is why a claimed cell
runs in a fresh worker process: its environment is the only place a share can
be written where the libraries will read it.

Three layers, the later winning: the kernel's own environment, what the
allocation implies, and what the claim itself set. A claim's ``env`` is a
deliberate statement about that one cell and outranks the machine's default.

A claim granted cards also gets the switches that stop JAX and TensorFlow
from taking most of a card's memory the moment they start
(:data:`GPU_MEMORY_VARS`): the card is held by this claim, but its memory is
what a person reads when they look for who holds it, and a framework that
took 90% of it for a model of 1 GB says nothing true.

A claim with a card memory budget (``gpu_ram=``) also tells the frameworks
that take a cap: JAX through ``XLA_PYTHON_CLIENT_MEM_FRACTION``, torch through
:data:`GPU_FRACTION_VAR`, which the worker hands to
``torch.cuda.set_per_process_memory_fraction``. Both are a share of the card,
so they need its size; without a reading of the cards only the sampler holds
the budget.

``XLA_FLAGS`` and friends are deliberately not derived. They are composed
strings whose contents depend on the version installed, and writing one here
would silently replace what the author put there. They travel in the claim's
``env``, where they can be seen.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from fluksio_nb.card_compute import MPS_SHARE_VAR, mps_daemon_runs_now

if TYPE_CHECKING:
    from fluksio_nb.books import Allocation
    from fluksio_nb.resources import Resources

#: Every spelling of "how many threads may you use" that a scientific stack
#: reads at import: OpenMP (and torch), OpenBLAS, MKL, Apple's Accelerate,
#: numexpr, BLIS, numba, and joblib/loky's view of the core count. Set
#: together, because one process usually pulls in several of them.
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "LOKY_MAX_CPU_COUNT",
)


def differs_only_in_threads(one: Mapping[str, str], other: Mapping[str, str]) -> bool:
    """Whether two derived environments differ in nothing but their thread variables."""
    names = {*one, *other}.difference(THREAD_VARS)
    return all(one.get(name) == other.get(name) for name in names)


#: On a claim granted cards: allocate card memory as it is used, not up front.
GPU_MEMORY_VARS = {
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "TF_FORCE_GPU_ALLOW_GROWTH": "true",
}


#: The share of each card a claim's ``gpu_ram=`` is, for the worker to give torch.
GPU_FRACTION_VAR = "FLUKSIO_GPU_MEMORY_FRACTION"


def derive_env(
    wanted: Resources,
    allocation: Allocation,
    card_bytes: Mapping[int, int] | None = None,
    cuda_names: Mapping[int, str] | None = None,
) -> dict[str, str]:
    """The variables a worker holding this allocation is started with.

    A claim that asked for no GPU has the cards hidden rather than left all
    visible: a CPU cell that imports torch would otherwise create a context on
    card 0, which is someone else's. ``card_bytes`` is the size of each card,
    where known, for the share ``gpu_ram=`` is of the smallest of them.
    ``cuda_names`` is how CUDA names a card that is not its id: a MIG
    instance, by its UUID (:mod:`fluksio_nb.mig`).
    """
    env = {var: str(allocation.cpus) for var in THREAD_VARS}
    # CUDA numbers cards fastest-first by default; PCI order is NVML's order,
    # and NVML's indices are the ones the books hand out.
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    names = cuda_names or {}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(names.get(card, str(card)) for card in allocation.gpus)
    if allocation.gpus:
        env.update(GPU_MEMORY_VARS)
        if isinstance(wanted.gpus, float):
            # A slice of gpus=0.5 is that share of its card, whatever its size.
            env.update(fraction_env(wanted.gpus))
        else:
            budget = allocation.gpu_bytes or wanted.gpu_ram_bytes
            env.update(card_memory_share(budget, allocation.gpus, card_bytes))
        if allocation.gpu_bytes and mps_daemon_runs_now():
            # Where MPS shares the card's cores, a slice gets its share of them too.
            share = float(env.get(GPU_FRACTION_VAR) or wanted.gpus or 0)
            if share:
                env[MPS_SHARE_VAR] = str(max(1, round(share * 100)))
    env.update(wanted.env)
    return env


def card_memory_share(
    gpu_ram_bytes: int | None, cards: Iterable[int], card_bytes: Mapping[int, int] | None
) -> dict[str, str]:
    """JAX's and torch's cap for a claim's ``gpu_ram=``: a share of the smallest of its cards.

    Nothing where there is no budget, or a card's size is not known.
    """
    sizes = [(card_bytes or {}).get(index) for index in cards]
    if gpu_ram_bytes is None or not sizes or not all(sizes):
        return {}
    return fraction_env(min(1.0, gpu_ram_bytes / min(sizes)))  # type: ignore[type-var]


def fraction_env(share: float) -> dict[str, str]:
    """JAX's and torch's cap at ``share`` of each card: a budget's, or a slice's."""
    fraction = f"{share:.3f}"
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": fraction, GPU_FRACTION_VAR: fraction}


class EnvironMark:
    """Whether this process's environment moved since it was last marked, told cheaply.

    Compared as the bytes ``os.environ`` keeps for the C library: comparing
    ``os.environ`` itself decodes every name and value, which the kernel and
    the worker each paid on every claimed cell for an environment that seldom
    moves. Where there are no such bytes, it always says moved.
    """

    def __init__(self) -> None:
        self._seen: dict[bytes, bytes] | None = None

    def unmoved(self) -> bool:
        raw = getattr(os.environ, "_data", None)
        return raw is not None and raw == self._seen

    def mark(self) -> None:
        raw = getattr(os.environ, "_data", None)
        self._seen = dict(raw) if raw is not None else None

    def forget(self) -> None:
        self._seen = None


def worker_environ(
    derived: Mapping[str, str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of a worker: the kernel's, with the derived on top."""
    return {**(os.environ if base is None else base), **derived}


def fair_share_env(
    cpus: int, workers: int, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Thread caps for work that declared nothing but runs beside others.

    A pool of ``workers`` processes, all busy at once, each believing it owns
    the machine is the oversubscription this project is about. Only variables
    the user has not already set in ``environ`` (this process's environment
    unless given; a kernel's, when it is about to start one): an explicit
    ``OMP_NUM_THREADS`` there is an answer, and this is a default.
    """
    environ = os.environ if environ is None else environ
    fair = max(1, cpus // max(1, workers))
    return {var: str(fair) for var in THREAD_VARS if var not in environ}
