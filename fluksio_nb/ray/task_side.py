"""What runs inside the Ray task: the claimed cell, in a worker of its own.

A cell sent to the cluster should behave as it does on this machine. This
module is the task's side of a claim: it runs in a Ray worker process, on
whichever node Ray chose, and imports of it happen there (Ray pickles the
task's function by reference, so the nodes need fluksio_nb installed).

What this module decides:

- **The cell runs in the same worker as a local claim**, started inside the
  task (:mod:`fluksio_nb.worker`). It is an IPython shell in a process of its
  own, so displays, the last expression, magics, ``!cmd`` and tracebacks are
  the same as on this machine, and the same sampler
  (:class:`~fluksio_nb.sampler.Sampler` and
  :func:`~fluksio_nb.budget.halt_decision`) holds it to its ``ram=``, which Ray
  itself uses for placement only. Ray's worker process keeps the worker warm
  for the next claim of the same shape, as the kernel's pool does.
- **A stop from the kernel ends the cell, not the task.** ``ray.cancel``
  raises ``KeyboardInterrupt`` in the task, which stops its worker's cell as
  the stop button stops a local one, and returns what the cell had bound,
  marked stopped: a task that failed would lose it. Ray's processes hold
  SIGINT blocked, which their children inherit, so the worker unblocks it.
- **The worker is told Ray's cards, and only those.** A claim that got no
  card has the cards hidden, as locally.
- **On the kernel's machine, the values skip the object store**: the task's
  worker maps the inputs the kernel wrote into its shared memory, and leaves
  its outputs there for the kernel to map. The task checks that it really is
  on that machine before anything runs, and raises
  :class:`~.connection.ElsewhereThanTheKernel` if not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from fluksio_nb import segments, transfer
from fluksio_nb.budget import HaltDecision, human
from fluksio_nb.env import THREAD_VARS, card_memory_share
from fluksio_nb.errors import BadClaim, Interrupted
from fluksio_nb.gpu_usage import kernel_cards
from fluksio_nb.ray.connection import ElsewhereThanTheKernel, Machine, _machine_of
from fluksio_nb.ray.mailbox import Sampled, Started, _Outbox, _OutboxSink, _Sender
from fluksio_nb.ray.task import TaskCell
from fluksio_nb.ray.values import Frozen, freeze, portable
from fluksio_nb.stop_button import held_once_the_cell_is_over
from fluksio_nb.worker.client import Outcome

#: The variables the cell's worker is started with, as the task saw them.
_SHOWN_VARS = (*THREAD_VARS, "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES")


class _TaskProcess:
    """What a Ray worker process keeps from one claim's task to the next.

    Process-wide, as the kernel's :class:`~.connection.RayConnection` is, but
    in another process: Ray runs each task in a worker process of its own
    and keeps that process for the next task of the same shape, so what one
    task found or started there, the next need not again. There is one of
    these per such process, :data:`_task_process`; in the kernel it is unused.
    """

    def __init__(self) -> None:
        #: The thread that sends this process's output to the kernels' mailboxes.
        self.sender = _Sender()
        #: Whether this process has swept the shared memory of dead processes yet.
        self._swept = False
        #: The mailbox actors this process has looked up, by name.
        self._named: dict[str, Any] = {}
        #: The kernels' machines this process has found it is on.
        self._kernels_here: set[Machine] = set()

    def sweep_once(self) -> None:
        """Remove the shared memory dead processes left, the first time this process asks."""
        if not self._swept:
            # Parcels in flight when Ray killed their writer outright (ray.shutdown,
            # a forced cancel): nobody else sweeps a node no kernel runs on. Kept
            # files are memfds and go by themselves. Once per process, a scan.
            self._swept = True
            with contextlib.suppress(Exception):
                segments.sweep_orphans()

    def mailboxes_named(self, ray: Any, name: str) -> Any:
        """A kernel's mailbox actor, as a task finds it: looked up once per process."""
        handle = self._named.get(name)
        if handle is None:
            if len(self._named) >= 64:
                self._named.clear()
            handle = self._named[name] = ray.get_actor(name)
        return handle

    def on_the_kernels_machine(self, machine: Machine) -> bool:
        """Whether this task's process can map the shared memory of the kernel ``machine`` names.

        It must be on that machine, and run as the kernel's user: the files are
        the user's own, and another user's Ray cannot open them.
        """
        if machine not in self._kernels_here:
            if _machine_of(machine[1]) != tuple(machine) or os.geteuid() != machine[3]:
                return False
            self._kernels_here.add(machine)
        return True


_task_process = _TaskProcess()


def run_claimed_cell(cell: TaskCell, *inputs: Frozen) -> dict[str, Any]:
    """The Ray task: run one cell in a worker holding the task's share, watched for memory.

    Runs inside a Ray worker process, which Ray started with the claim's
    ``runtime_env`` and, for a claim with cards, the ``CUDA_VISIBLE_DEVICES``
    of the cards it granted. The inputs are the task's own arguments, one per
    name in ``cell.names``, so Ray has them on the node before the task
    starts, as it has a bare task's; or, on the kernel's machine, the
    kernel's shared memory, in ``cell.parcel``.
    """
    import ray

    from fluksio_nb.budget import budget_here
    from fluksio_nb.sampler import Sampler
    from fluksio_nb.watch import Watched, kernel_watch
    from fluksio_nb.worker.pool import kernel_pool

    _task_process.sweep_once()
    here = cell.machine is not None
    if here and not _task_process.on_the_kernels_machine(cell.machine):
        # Before anything runs: the kernel sends the cell again, by the object store.
        raise ElsewhereThanTheKernel(
            f"this task's node is not the machine of the kernel (pid {cell.machine[1]})"
        )
    mailboxes = _task_process.mailboxes_named(ray, cell.mailboxes)
    outbox = _Outbox(mailboxes, cell.box, _task_process.sender)
    parcel = None
    try:
        parcel = cell.parcel if here else _inputs_as_parcel(cell.names, inputs)
        gpus = [str(gpu) for gpu in ray.get_gpu_ids()]
        cards = tuple(int(gpu) for gpu in gpus if gpu.isdigit())
        derived = {**_worker_env(gpus), **_card_budget_env(cell, cards)}
        # As a local claim's, from this node's memory as the cell starts.
        budget = budget_here(cell.ram_bytes, gpu_bytes=cell.gpu_ram_bytes)
        pool = kernel_pool()
        worker = pool.checkout(derived)
        halted: list[HaltDecision] = []

        def halt(decision: HaltDecision | None) -> None:
            if decision is not None:
                halted.append(decision)
                worker.kill()

        watched = kernel_watch().add(
            Watched(
                sampler=Sampler(worker.pid, gpus=cards),
                budget=budget,
                on_sample=lambda sample: outbox.put(Sampled(sample)),
                on_halt=halt,
            )
        )
        started = {
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": gpus,
            "env": derived,
            "budget": budget,
        }
        outbox.put(Started(started))
        # The kernel stops a task as its stop button stops a local claim, with
        # ray.cancel, which raises KeyboardInterrupt here. The cell then ends
        # as a local one does, with the names it had bound; and one stopped
        # once it was over, as its names started back, keeps them all. Either
        # way the task returns, marked stopped: failed, it would lose them.
        result: dict[str, Any] | None = None
        stopped = False
        try:
            with held_once_the_cell_is_over():
                try:
                    # On the kernel's machine, the outputs go to the kernel as
                    # the worker packed them, and the kernel maps them.
                    # Elsewhere, they are pickled into the object store as soon
                    # as they are here, so the worker may write the next cell's
                    # into the same warm files: 8 MB into a new one took 2.2
                    # ms, into a warm one 1.0.
                    outcome = worker.run(
                        cell.code,
                        inputs=parcel,
                        outputs=cell.outputs,
                        sink=_OutboxSink(outbox),
                        keep_outputs=not here,
                        forward_outputs=here,
                        if_changed=cell.if_changed,
                        random_state=cell.random_state,
                    )
                except Interrupted as stop:
                    if stop.outcome is None:
                        raise
                    outcome, stopped = stop.outcome, True
                finally:
                    kernel_watch().discard(watched)
                    if not worker.alive:
                        # A halted or crashed worker cannot remove a parcel it was writing.
                        with contextlib.suppress(Exception):
                            segments.sweep_orphans(gone=worker.pid)
                    pool.checkin(worker, derived)
                result = _task_result(outcome, halted[0] if halted else None, cell.through_client)
        except KeyboardInterrupt:
            # Held since the cell's end reached this task, and landed now.
            if result is None:
                raise
            stopped = True
        result["stopped"] = stopped
    except BaseException:
        # The kernel reads the mailbox once more when the task fails, so
        # everything must be in it first.
        outbox.flush()
        raise
    finally:
        # The kernel's own parcel is the kernel's to put back.
        if parcel is not None and not here:
            parcel.discard()
    # The rest of the output goes back with the result, and the count of what
    # went through the mailbox, which the kernel shows first.
    result["unsent"] = outbox.close()
    result["sent"] = outbox.sent
    return result


def _inputs_as_parcel(names: list[str], inputs: Sequence[Frozen]) -> Any:
    """The cell's inputs, into this process's shared memory for the worker.

    In the task, from the object store; in the kernel, from its own values,
    when the task runs on the kernel's machine and the object store is a
    detour. Each pickle goes on as the kernel made it, and its big buffers
    straight into shared memory: one copy, nothing unpickled here.
    The kernel pickled its own values, so the worker's arrays are writable
    exactly where the kernel's were, as a local claim's are. The copy goes
    into files this process keeps for its next parcels, as the kernel does
    for a local claim: 8 MB into a new file took about 2 ms, most of it the
    kernel finding fresh pages.
    """
    values: dict[str, Any] = {}
    try:
        for name, (data, buffers) in zip(names, inputs, strict=True):
            values[name] = transfer.pack_pickled(data, buffers, reuse=True)
    except BaseException:
        transfer.Parcel(values).discard()
        raise
    return transfer.Parcel(values)


def _worker_env(gpus: list[str]) -> dict[str, str]:
    """What the cell's worker is told: the task's thread variables and Ray's cards."""
    derived = {var: os.environ[var] for var in _SHOWN_VARS if var in os.environ}
    # Ray's value for the cards it granted. None granted, none visible: Ray
    # leaves the variable alone then, and a CPU cell importing torch would
    # otherwise open a context on card 0, which another task holds.
    derived["CUDA_VISIBLE_DEVICES"] = derived.get("CUDA_VISIBLE_DEVICES", "") if gpus else ""
    return derived


def _card_budget_env(cell: TaskCell, cards: tuple[int, ...]) -> dict[str, str]:
    """JAX's and torch's caps for ``gpu_ram=``, from this node's cards, as a local claim's.

    Refused where this node cannot read its cards: nothing would hold the budget.
    """
    if cell.gpu_ram_bytes is None or not cards:
        return {}
    reading = kernel_cards().read()
    if reading is None:
        raise BadClaim(
            f"gpu_ram={human(cell.gpu_ram_bytes)} cannot be held on this Ray node: nothing "
            "there reads the cards' memory (NVML's library could not be loaded and "
            "nvidia-smi is not on its PATH). Drop gpu_ram=, or run on a node with the driver."
        )
    sizes = {card.index: card.total_bytes for card in reading.cards if card.total_bytes}
    return card_memory_share(cell.gpu_ram_bytes, cards, sizes)


def _task_result(
    outcome: Outcome, halted: HaltDecision | None, through_client: bool
) -> dict[str, Any]:
    """What the kernel is sent back: how the cell ended, and its outputs.

    The outputs as the worker packed them when it was told to forward them
    (the kernel's machine); otherwise each name pickled for the object store.
    """
    shipped: dict[str, Frozen] = {}
    failed = dict(outcome.failed)
    for name, value in outcome.outputs.items():
        try:
            shipped[name] = portable(freeze(value)) if through_client else freeze(value)
        except Exception as error:
            failed[name] = str(error) or type(error).__name__
    error = outcome.error
    return {
        "error": None if error is None else (error.ename, error.evalue, error.traceback),
        "died": outcome.died,
        "halted": halted,
        "outputs": shipped,
        "parcel": outcome.parcel,
        "failed": failed,
        "absent": list(outcome.absent),
        "random_state": outcome.random_state,
        # Exact however short the cell, where the readings sent as it ran are not.
        "peak_bytes": outcome.peak_bytes,
    }
