"""Claims that run on a Ray cluster: ``%%claim cpus=2 gpus=1 ram=8G --on ray``.

When one workstation is not enough, the same claim should go to a cluster
without a new vocabulary and without a scheduler of our own. Ray's resource
model (``num_cpus``, ``num_gpus``, ``memory``) is the shape of a claim, and Ray
already queues tasks, places them on nodes and hands out cards. So a claim
``--on ray`` is one Ray task with the matching resources, and Ray's queue is
the queue: nothing here waits in the kernel's own books. A ``with
claim(..., on="ray")`` block holds its share for the block, as a local one
does, in a Ray placement group of one bundle.

What this module decides:

- **The environment travels in ``runtime_env``.** Ray sets
  ``CUDA_VISIBLE_DEVICES`` for the cards it grants, and that value is kept.
  Every thread variable of :data:`fluksio_nb.env.THREAD_VARS` is set through
  ``runtime_env["env_vars"]``, ``OMP_NUM_THREADS`` included: Ray only sets that
  one when the worker's environment lacks it, so a raylet started from a shell
  that exported it would otherwise pass the shell's value on. A claim that got
  no card has the cards hidden, as locally.
- **The cell runs in the same worker as a local claim**, started inside the
  task (:mod:`fluksio_nb.worker`). It is an IPython shell in a process of its
  own, so displays, the last expression, magics, ``!cmd`` and tracebacks are
  the same as on this machine, and the same sampler
  (:class:`~fluksio_nb.sampler.Sampler` and
  :func:`~fluksio_nb.budget.halt_decision`) holds it to its ``ram=``, which Ray
  itself uses for placement only. Ray's worker process keeps the worker warm
  for the next claim of the same shape, as the kernel's pool does.
- **Output goes through a mailbox actor**, one per kernel, which the task
  writes to and the kernel reads from while it waits for the task. Ray's
  streaming generators would be lighter, but Ray Client (``ray://``) does not
  support them, and a mailbox works the same both ways. What the task has
  not sent when the cell ends comes back with its result, with the count of
  what it did send, so a short cell costs no actor call for its output.
- **Variables travel through Ray's object store**, each name pickled on its
  own, so that one value that cannot travel is reported by name, big buffers
  out of band. Arrays arrive writable, as they do from a local claim: the
  object store's are read-only, so they are copied once on arrival. Through
  Ray Client the buffers go in band (:func:`portable`), which costs a copy.
- **Except on the kernel's own machine.** When every node of the cluster is
  the machine the kernel runs on — a local Ray, the usual first step past one
  notebook — the object store is a detour: the kernel writes the inputs into
  its shared memory as it does for a local claim, the task's worker maps them,
  and the worker's outputs come back to be mapped by the kernel, writable,
  with no copy. 8 MB in and 8 MB out went from 1.4–1.5 times a bare task to
  0.9 times. The task checks that it really is on that machine before
  anything runs, and if not, the cell goes again by the object store.
- **A task never runs twice.** Ray retries a task whose worker died; a cell is
  not idempotent, so ``max_retries=0``.
- **A claim no node can hold fails at once**, naming what the largest node
  has, because Ray would wait for such a node forever.
- **The stop button cancels the task**, first as a local claim is stopped (the
  cell's whole process group, children included, ends), then by force if that
  was not enough (:func:`stop_task`). A ``--background`` claim's handle
  cancels it the same way.

Ray is an optional extra. Without it, ``--on ray`` says how to install it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psutil

from fluksio_nb import random_streams, transfer
from fluksio_nb.books import Allocation
from fluksio_nb.budget import HaltDecision, human
from fluksio_nb.context import SHOW_AFTER_S
from fluksio_nb.env import THREAD_VARS, derive_env, worker_environ
from fluksio_nb.relay import CellOutput
from fluksio_nb.resources import BadClaim, Resources
from fluksio_nb.sampler import Sample
from fluksio_nb.status import ClaimStatus, StatusView, TextView
from fluksio_nb.transfer import dumps, out_of_band
from fluksio_nb.watch import ensure_running
from fluksio_nb.worker.client import Outcome, Sink

INSTALL_HINT = (
    "--on ray needs Ray, which is not installed where this kernel runs: "
    "pip install 'fluksio_nb[ray]' (or pip install ray), then restart the kernel."
)

#: The least time between two sends of the task's output: a loop printing
#: thousands of lines costs fifty actor calls a second, not thousands.
SEND_EVERY_S = 0.02

#: How long the task holds its first output before sending it. A cell over
#: by then sends everything with its result: no actor call at all.
FIRST_SEND_AFTER_S = 0.05

#: The longest the kernel's thread blocks on Ray without looking for the stop
#: button: Python only runs signal handlers between calls into Ray.
_SIGNAL_CHECK_S = 0.1

#: How long a cancelled task gets to end its cell itself before Ray kills it:
#: the worker's ladder from SIGINT to SIGKILL takes under three seconds.
_GRACE_TO_STOP_S = 3.0

#: How long one read of the mailbox waits for output before asking again.
_TAKE_WAIT_S = 1.0

#: The variables the cell's worker is started with, as the task saw them.
_SHOWN_VARS = (*THREAD_VARS, "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES")

_RAY_ADDRESS = re.compile(r"^(ray://)?[A-Za-z0-9_.\-\[\]:]+:\d+$")


class RayMissing(BadClaim):
    """``--on ray`` was asked for where Ray is not installed."""


class ClaimTooBigForCluster(BadClaim):
    """No node of the cluster could ever hold the claim, so Ray would wait forever."""


class ElsewhereThanTheKernel(Exception):
    """A task sent its values through the kernel's shared memory ran on another machine."""


def import_ray() -> Any:
    """The ``ray`` module, or :class:`RayMissing` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayMissing(INSTALL_HINT) from None
    return ray


def parse_target(target: str) -> str | None:
    """The address ``--on`` names; ``None`` for plain ``ray``."""
    target = target.strip()
    if target == "ray":
        return None
    if _RAY_ADDRESS.match(target):
        return target
    raise BadClaim(
        f"--on {target!r} is not a Ray cluster: write --on ray for the cluster this kernel "
        "is connected to, or an address such as --on ray://head:10001."
    )


# -----------------------------------------------------------------------------
# What the task is asked for
# -----------------------------------------------------------------------------


def ray_env(wanted: Resources) -> dict[str, str]:
    """The variables set through ``runtime_env``: the derived env, less Ray's cards."""
    env = derive_env(wanted, Allocation(cpus=wanted.cpus, ram_bytes=wanted.ram_bytes))
    del env["CUDA_VISIBLE_DEVICES"]
    return env


def task_options(wanted: Resources, label: str) -> dict[str, Any]:
    """Ray's options for the task that runs a claim."""
    options: dict[str, Any] = {
        "num_cpus": wanted.cpus,
        "num_gpus": wanted.gpus,
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
    if wanted.gpus:
        resources["GPU"] = float(wanted.gpus)
    if wanted.ram is not None:
        resources["memory"] = float(wanted.ram_bytes)
    return resources


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


def _alive_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The nodes Ray says are alive (``Alive`` from ``ray.nodes()``, ``alive`` elsewhere)."""
    return [node for node in nodes if node.get("Alive", node.get("alive"))]


def _describe_node(resources: Mapping[str, float]) -> str:
    return (
        f"cpus={resources.get('CPU', 0):g} gpus={resources.get('GPU', 0):g} "
        f"memory={human(int(resources.get('memory', 0)))}"
    )


# -----------------------------------------------------------------------------
# Values on their way through the object store
# -----------------------------------------------------------------------------

#: One value: its pickle, and its big buffers, which Ray stores out of band.
Frozen = tuple[bytes, list[pickle.PickleBuffer]]

#: A process as :func:`this_machine` describes it: boot id, pid, start time, user.
Machine = tuple[str, int, float, int]


@dataclass(frozen=True)
class Packed:
    """A cell's inputs, pickled before the claim is sent anywhere."""

    values: dict[str, Frozen] = field(default_factory=dict)
    #: Names that cannot travel, and why.
    failures: dict[str, str] = field(default_factory=dict)

    def discard(self) -> None:
        """Nothing to give back: unlike a local parcel's, these pickles hold no shared memory."""


def freeze(value: object) -> Frozen:
    """Pickle one value, handing its big buffers out of band for Ray to store as they are."""
    buffers: list[pickle.PickleBuffer] = []

    def spill(buffer: pickle.PickleBuffer) -> bool:
        if out_of_band(buffer) is None:
            return True
        buffers.append(buffer)
        return False

    return dumps(value, spill), buffers


def portable(frozen: Frozen) -> Frozen:
    """The same value with its buffers copied into the stream, for Ray Client.

    Ray Client carries objects between the kernel and the cluster in its own
    pickles, where an out-of-band buffer does not survive the trip: fetching
    one hangs. A bytearray is pickled in band, at the price of one copy.
    """
    data, buffers = frozen
    return data, [bytearray(buffer) for buffer in buffers]  # type: ignore[misc]


def thaw(frozen: Frozen, *, writable: bool) -> object:
    """Rebuild a value. ``writable`` copies each buffer out of the read-only object store."""
    data, buffers = frozen
    return pickle.loads(data, buffers=[bytearray(b) if writable else b for b in buffers])


def pack_inputs(values: Mapping[str, object]) -> Packed:
    """Pickle each input on its own, so one that cannot travel is named."""
    packed: dict[str, Frozen] = {}
    failures: dict[str, str] = {}
    for name, value in values.items():
        try:
            packed[name] = freeze(value)
        except Exception as error:
            failures[name] = str(error) or type(error).__name__
    return Packed(packed, failures)


# -----------------------------------------------------------------------------
# The task's side
# -----------------------------------------------------------------------------


class Mailboxes:
    """A Ray actor holding each running claim's output until the kernel takes it.

    Async, so a kernel waiting on one claim's box does not hold up another
    claim's writes. Writes from one task arrive in the order it made them:
    Ray runs one caller's actor calls in order, and :meth:`put` never awaits.
    """

    def __init__(self) -> None:
        import asyncio

        self._asyncio = asyncio
        self._boxes: dict[str, list[Any]] = {}
        self._arrived: dict[str, Any] = {}
        #: Boxes whose claim was given up on: a late write must not recreate them.
        self._forgotten: deque[str] = deque(maxlen=1024)

    def _event(self, box: str) -> Any:
        if box not in self._arrived:
            self._arrived[box] = self._asyncio.Event()
        return self._arrived[box]

    async def put(self, box: str, items: list[Any]) -> None:
        if box in self._forgotten:
            return
        self._boxes.setdefault(box, []).extend(items)
        self._event(box).set()

    async def take(self, box: str, wait_s: float) -> list[Any]:
        arrived = self._event(box)
        if not self._boxes.get(box) and wait_s > 0:
            with contextlib.suppress(self._asyncio.TimeoutError):
                await self._asyncio.wait_for(arrived.wait(), wait_s)
        arrived.clear()
        return self._boxes.pop(box, [])

    async def forget(self, box: str) -> list[Any]:
        """Drop the box and wake whoever waits on it; what was still in it."""
        self._forgotten.append(box)
        left = self._boxes.pop(box, [])
        arrived = self._arrived.pop(box, None)
        if arrived is not None:
            arrived.set()
        return left


class _Outbox:
    """Sends the task's output to its mailbox in batches, from the process's sending thread.

    What is still unsent when the cell ends goes back with the task's result
    instead (:meth:`close`), with the count of what was sent, so that the
    kernel knows when it has shown everything without another round trip.
    A cell that is over within :data:`FIRST_SEND_AFTER_S` sends nothing at all.
    """

    def __init__(self, mailboxes: Any, box: str) -> None:
        self._mailboxes, self._box = mailboxes, box
        self._pending: list[Any] = []
        self._closed = False
        #: A batch taken from ``_pending`` whose actor call is not made yet.
        self._sending = False
        self._last: Any = None
        # The first send waits a little: the output of a cell that is over
        # by then goes back with its result, and costs no actor call.
        self._sent_at = time.monotonic() - SEND_EVERY_S + FIRST_SEND_AFTER_S
        #: How many items have gone to the mailbox.
        self.sent = 0
        _sender.open(self)

    def put(self, item: Any) -> None:
        with _sender.changed:
            self._pending.append(item)
            _sender.changed.notify_all()

    def close(self) -> list[Any]:
        """Stop sending; what was never sent, for the task's result."""
        with _sender.changed:
            self._closed = True
            _sender.shut(self)
            # A batch already taken is sent before the count is read.
            while self._sending:
                _sender.changed.wait()
            unsent, self._pending = self._pending, []
        return unsent

    def flush(self) -> None:
        """Send what is left and wait until the mailbox has it: for a task about to fail."""
        unsent = self.close()
        if unsent:
            self._last = self._mailboxes.put.remote(self._box, unsent)
            self.sent += len(unsent)
        if self._last is not None:
            import ray

            ray.get(self._last)

    def _due_in(self, now: float) -> float | None:
        """Seconds until this outbox's next batch may go; ``None`` with nothing to send."""
        if self._closed or self._sending or not self._pending:
            return None
        # A lone line goes at once; a burst waits out the interval since the
        # last send and goes as one batch.
        return self._sent_at + SEND_EVERY_S - now

    def _send(self, items: list[Any]) -> None:
        try:
            self._last = self._mailboxes.put.remote(self._box, items)
        finally:
            with _sender.changed:
                self._sent_at = time.monotonic()
                self._sending = False
                _sender.changed.notify_all()


class _Sender:
    """The one thread of a Ray worker process that sends its tasks' output.

    Started with the first task and kept for the next ones, as the cell's
    worker is: starting and joining a thread per task cost about a tenth of
    a millisecond of every claimed cell, and a thread asleep costs nothing.
    """

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self._open: set[_Outbox] = set()
        self._thread: threading.Thread | None = None

    def open(self, outbox: _Outbox) -> None:
        with self.changed:
            self._open.add(outbox)
            self._thread = ensure_running(self._thread, self._loop, "fluksio-outbox")

    def shut(self, outbox: _Outbox) -> None:
        """Called with :attr:`changed` held."""
        self._open.discard(outbox)
        self.changed.notify_all()

    def _loop(self) -> None:
        while True:
            with self.changed:
                batch = None
                while batch is None:
                    now = time.monotonic()
                    soonest: float | None = None
                    for outbox in self._open:
                        due_in = outbox._due_in(now)
                        if due_in is None:
                            continue
                        if due_in <= 0:
                            batch = outbox
                            break
                        soonest = due_in if soonest is None else min(soonest, due_in)
                    if batch is None:
                        self.changed.wait(soonest)
                items, batch._pending = batch._pending, []
                # Counted before it goes: close() waits for the call to be
                # made before it reads the count.
                batch.sent += len(items)
                batch._sending = True
            batch._send(items)


_sender = _Sender()


class _OutboxSink(Sink):
    """What the cell shows, put in the outbox in the order it was shown."""

    def __init__(self, outbox: _Outbox) -> None:
        self._outbox = outbox

    def stdout(self, text: str) -> None:
        self._outbox.put(("stdout", text))

    def stderr(self, text: str) -> None:
        self._outbox.put(("stderr", text))

    def display(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        self._outbox.put(("display", data, metadata))

    def result(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        self._outbox.put(("result", data, metadata))

    def error(self, ename: str, evalue: str, traceback: list[str]) -> None:
        self._outbox.put(("error", ename, evalue, traceback))

    def clear_output(self, wait: bool) -> None:
        self._outbox.put(("clear_output", wait))


#: Whether this process has swept the shared memory of dead processes yet.
_swept = False


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
    through_client: bool
    #: Inputs that come back too if the cell changed them in place.
    if_changed: list[str]
    #: The global random streams the cell draws from.
    random_state: dict[str, Any] | None
    #: The name of each input that follows, in order.
    names: list[str]
    #: The kernel's machine (:func:`this_machine`) when every node of the
    #: cluster is that machine: the values then travel through its shared
    #: memory rather than the object store, both ways.
    machine: Machine | None = None
    #: The inputs, already in the kernel's shared memory, when ``machine`` is set.
    parcel: Any = None


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

    from fluksio_nb.budget import Budget, resolve_budget
    from fluksio_nb.inventory import host_memory
    from fluksio_nb.sampler import Sampler
    from fluksio_nb.watch import Watched, kernel_watch
    from fluksio_nb.worker.pool import kernel_pool

    global _swept
    if not _swept:
        # Parcels in flight when Ray killed their writer outright (ray.shutdown,
        # a forced cancel): nobody else sweeps a node no kernel runs on. Kept
        # files are memfds and go by themselves. Once per process, a scan.
        _swept = True
        with contextlib.suppress(Exception):
            transfer.sweep_orphans()
    here = cell.machine is not None
    if here and not _on_the_kernels_machine(cell.machine):
        # Before anything runs: the kernel sends the cell again, by the object store.
        raise ElsewhereThanTheKernel(
            f"this task's node is not the machine of the kernel (pid {cell.machine[1]})"
        )
    outbox = _Outbox(_mailboxes_named(ray, cell.mailboxes), cell.box)
    parcel = None
    try:
        parcel = cell.parcel if here else _inputs_as_parcel(cell.names, inputs)
        gpus = [str(gpu) for gpu in ray.get_gpu_ids()]
        derived = _worker_env(gpus)
        if cell.ram_bytes is None:
            # Reading the host's and the cgroup's memory is a dozen files, a
            # fifth of a millisecond: only a budget needs it.
            budget = Budget(None, None)
        else:
            total, available = host_memory()
            budget = resolve_budget(
                cell.ram_bytes, host_total_bytes=total, host_available_bytes=available
            )
        pool = kernel_pool()
        worker = pool.checkout(derived)
        halted: list[HaltDecision] = []

        def halt(decision: HaltDecision | None) -> None:
            if decision is not None:
                halted.append(decision)
                worker.kill()

        watched = kernel_watch().add(
            Watched(
                sampler=Sampler(worker.pid),
                budget=budget,
                on_sample=lambda sample: outbox.put(("sample", asdict(sample))),
                on_halt=halt,
            )
        )
        started = {
            "pid": worker.pid,
            "node": ray.get_runtime_context().get_node_id(),
            "gpus": gpus,
            "env": derived,
            "budget": budget,
        }
        outbox.put(("started", started))
        try:
            # On the kernel's machine, the outputs go to the kernel as the
            # worker packed them, and the kernel maps them. Elsewhere, they are
            # pickled into the object store as soon as they are here, so the
            # worker may write the next cell's into the same warm files: 8 MB
            # into a new one took 2.2 ms, into a warm one 1.0.
            outcome = worker.run(
                cell.code,
                inputs=parcel,
                outputs=cell.outputs,
                sink=_OutboxSink(outbox),
                keep_outputs=not here,
                forward_outputs=here,
                if_changed=cell.if_changed,
                random_state=cell.random_state,
                environ=worker_environ(derived),
            )
        finally:
            kernel_watch().discard(watched)
            if not worker.alive:
                # A halted or crashed worker cannot remove a parcel it was writing.
                with contextlib.suppress(Exception):
                    transfer.sweep_orphans(gone=worker.pid)
            pool.checkin(worker, derived)
        result = _task_result(outcome, halted[0] if halted else None, cell.through_client)
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
    }


# -----------------------------------------------------------------------------
# The kernel's side
# -----------------------------------------------------------------------------

_lock = threading.Lock()
#: Held while connecting, which can take seconds: apart from _lock, so that
#: the monitor's snapshot never waits for it.
_connecting = threading.Lock()
_remote: dict[str, Any] = {}
#: The mailbox actor of this kernel's current Ray connection: its job, name and handle.
_mailboxes: tuple[str, str, Any] | None = None
#: The task with each claim's options.
_shaped: dict[str, Any] = {}
#: The cluster's nodes as last read, with the job and the time they were read in.
_nodes_seen: tuple[str, float, list[Any]] | None = None
#: How long the nodes last read are trusted to say that a claim fits: a claim
#: refused by them is checked again at once, so only a node that went away
#: can make a claim wait in Ray's queue, as it can after any check.
_NODES_FRESH_S = 10.0
#: The address this module connected to, when it made the connection itself.
_connected_to: str | None = None
#: This kernel's claims on Ray that have not ended, for the monitor.
_live: dict[int, RayClaim] = {}


def connect(target: str) -> Any:
    """The ``ray`` module, connected to the cluster ``--on`` names."""
    global _connected_to
    address = parse_target(target)
    ray = import_ray()
    with _connecting:
        if ray.is_initialized():
            if address is None or address == _connected_to:
                return ray
            current = _connected_to or _gcs_address(ray) or "another address"
            if address == current:
                return ray
            raise BadClaim(
                f"--on {address}: this kernel is already connected to the Ray cluster at "
                f"{current}, and a process talks to one cluster at a time. Use --on ray for "
                "that one, or run ray.shutdown() first."
            )
        # Ray's own choice when no address is given: RAY_ADDRESS, a cluster
        # started on this machine with `ray start`, or a new local one.
        ray.init(address=address)
        _connected_to = address
    return ray


def _through_client(ray: Any) -> bool:
    """Whether this kernel reaches the cluster through Ray Client (``ray://``)."""
    try:
        return bool(ray.util.client.ray.is_connected())
    except AttributeError:
        return False


def _job_of(ray: Any) -> str:
    """The job this kernel is in on its cluster: a new one after each ``ray.init``."""
    return str(ray.get_runtime_context().get_job_id())


def _gcs_address(ray: Any) -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        return None


def _remote_functions(ray: Any) -> tuple[Any, Any]:
    with _lock:
        if not _remote:
            _remote["task"] = ray.remote(run_claimed_cell)
            _remote["mailboxes"] = ray.remote(Mailboxes)
        return _remote["task"], _remote["mailboxes"]


def _task_for(ray: Any, wanted: Resources, label: str) -> Any:
    """The task with a claim's options, made once per shape: making it costs more than the call."""
    options = task_options(wanted, label)
    key = repr(sorted(options.items()))
    task, _ = _remote_functions(ray)
    with _lock:
        shaped = _shaped.get(key)
        if shaped is None:
            if len(_shaped) >= 64:
                _shaped.clear()
            shaped = _shaped[key] = task.options(**options)
        return shaped


def _kernel_mailboxes(ray: Any, job: str) -> tuple[str, Any]:
    """This kernel's mailbox actor, by name and handle, made on first use for each job.

    Tasks are given its name, not its handle: a handle passed to a task costs
    the call about half a millisecond, and the task's process keeps the handle
    it looked up for the next claim (:func:`_mailboxes_named`).
    """
    global _mailboxes
    _, actor_class = _remote_functions(ray)
    with _lock:
        if _mailboxes is None or _mailboxes[0] != job:
            name = f"fluksio-mailboxes-{uuid.uuid4().hex}"
            # No CPU: it only holds text, and must never wait behind the claims it serves.
            handle = actor_class.options(num_cpus=0, name=name).remote()
            _mailboxes = (job, name, handle)
        return _mailboxes[1], _mailboxes[2]


def _forget_mailboxes() -> None:
    global _mailboxes
    with _lock:
        _mailboxes = None


#: The mailbox actors a task's process has looked up, by name.
_named: dict[str, Any] = {}


def _mailboxes_named(ray: Any, name: str) -> Any:
    """A kernel's mailbox actor, as a task finds it: looked up once per process."""
    handle = _named.get(name)
    if handle is None:
        if len(_named) >= 64:
            _named.clear()
        handle = _named[name] = ray.get_actor(name)
    return handle


def _check_fits(ray: Any, job: str, wanted: Resources) -> None:
    """:func:`check_fits` against the cluster's nodes, read at most every few seconds.

    A claim that does not fit the nodes last read is checked again against
    the nodes as they are now, so a node that joined since is counted.
    """
    global _nodes_seen
    now = time.monotonic()
    seen = _nodes_seen
    if seen is not None and seen[0] == job and now - seen[1] < _NODES_FRESH_S:
        with contextlib.suppress(ClaimTooBigForCluster):
            check_fits(wanted, seen[2])
            return
    nodes = ray.nodes()
    _nodes_seen = (job, now, nodes)
    check_fits(wanted, nodes)


#: The jobs whose tasks were found running off the kernel's machine although
#: every node said it was this one: they send their values by the object store.
_elsewhere: set[str] = set()

#: The kernels' machines a task's process has found it is on.
_kernels_here: set[Machine] = set()


@functools.cache
def this_machine() -> Machine | None:
    """This machine and this process, as any process on it sees them (:func:`_machine_of`)."""
    return _machine_of(os.getpid())


def _machine_of(pid: int) -> Machine | None:
    """The machine and one process on it, as seen from here: boot id, pid, start time, user.

    Two processes read the same for a pid only if they run under one kernel
    and see one process table, which is what it takes for one to map the
    other's shared-memory files (by ``/proc/<pid>/fd``, for a kept one).
    ``None`` where that cannot be read: then nothing is shared.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
        process = psutil.Process(pid)
        return boot, pid, process.create_time(), process.uids().effective
    except (OSError, psutil.Error):
        return None


def _on_the_kernels_machine(machine: Machine) -> bool:
    """Whether this task's process can map the shared memory of the kernel ``machine`` names.

    It must be on that machine, and run as the kernel's user: the files are
    the user's own, and another user's Ray cannot open them.
    """
    if machine not in _kernels_here:
        if _machine_of(machine[1]) != tuple(machine) or os.geteuid() != machine[3]:
            return False
        _kernels_here.add(machine)
    return True


def _cluster_machine(ray: Any, job: str) -> Machine | None:
    """The kernel's machine, if every live node of the cluster is it; otherwise ``None``.

    A driver always talks to the node on its own machine, so a cluster whose
    only live node is the driver's runs every task here. The nodes are those
    :func:`_check_fits` read last, a few seconds old at most; a node that
    joined since is caught by the task itself (:class:`ElsewhereThanTheKernel`).
    """
    seen = _nodes_seen
    if job in _elsewhere or seen is None or seen[0] != job:
        return None
    mine = ray.get_runtime_context().get_node_id()
    alive = [node.get("NodeID") for node in _alive_nodes(seen[2])]
    if not alive or any(node != mine for node in alive):
        return None
    return this_machine()


class RayClaim:
    """A claim whose work runs as Ray tasks: ``--on ray``'s :class:`~fluksio_nb.context.Claim`.

    A ``%%claim --on ray`` cell is one task, which Ray queues and gives its
    share. A ``with claim(..., on="ray")`` block (``hold=True``) holds its
    share from entry to exit, as a local block does: a placement group of one
    bundle on one node, reserved when the block is entered, in which every
    :meth:`run` starts without queueing again. Without it, each run would
    wait in Ray's queue for a share of its own, and another user could take
    the card between two runs of one block. ``allocation`` and ``env`` say
    what the last task was given: which cards Ray hands out is only known
    once a task has them.
    """

    def __init__(
        self,
        wanted: Resources,
        on: str = "ray",
        *,
        view: StatusView | None = None,
        show_after: float | None = SHOW_AFTER_S,
        hold: bool = False,
    ):
        from fluksio_nb.flavors import resolve_flavor
        from fluksio_nb.settings import load_settings

        self.target = on
        parse_target(on)
        # The settings alone, for the flavors: the kernel's accountant, and the
        # machine's ledger behind it, have no say over a cluster's share. Read
        # only for a claim that names a flavor: finding and reading the file
        # was a twentieth of an empty cell's time.
        if wanted.flavor is not None:
            wanted = resolve_flavor(wanted, load_settings())
        self.wanted = wanted
        if "CUDA_VISIBLE_DEVICES" in self.wanted.env:
            raise BadClaim(
                "CUDA_VISIBLE_DEVICES is Ray's to set on a cluster: it names the cards Ray "
                "granted. Ask for cards with gpus=N instead."
            )
        self.status = ClaimStatus(label=self.wanted.label or "claim on ray", asked=self.wanted)
        self.allocation: Allocation | None = None
        #: The variables the task's worker was started with; before a task, the planned ones.
        self.env: dict[str, str] = ray_env(self.wanted)
        #: The Ray node the last task ran on.
        self.node: str | None = None
        self._view = view
        #: As a local claim's (:data:`~fluksio_nb.context.SHOW_AFTER_S`): the
        #: live view only for a claim still waiting by then, or at its first
        #: reading; how it went is left as text of its own at the end.
        self._show_after = show_after
        self._shown = False
        self._summary: TextView | None = None
        self._ray: Any = None
        #: Why the last task was stopped for running out of time, if it was.
        self._timed_out: str | None = None
        #: Why the claim was cancelled from outside its thread, if it was.
        self._cancelled: str | None = None
        #: When the block's share was reserved, or else when the last task
        #: started on the cluster (``time.time()``).
        self.granted_at: float | None = None
        self._hold = hold
        #: The placement group holding a block's share, and the task shaped to run in it.
        self._held: Any = None
        self._held_task: Any = None
        #: A held block's deadline: its timeout counts from entry, waiting included.
        self._deadline: float | None = None

    @property
    def readings(self):
        """The latest, peak and mean readings of everything this claim ran."""
        return self.status.readings

    def acquire(self) -> RayClaim:
        """Connect, refuse a claim no node of the cluster can hold, and hold a block's share."""
        if self._ray is not None:
            return self
        ray = connect(self.target)
        _check_fits(ray, _job_of(ray), self.wanted)
        self._ray = ray
        with _lock:
            _live[id(self)] = self
        if self._view is not None:
            # Made now, in the cell that asked, as a local claim's.
            self._summary = TextView(CellOutput())
            if self._show_after is None:
                self._show()
        if self._hold:
            try:
                self._hold_share(ray)
            except BaseException as error:
                # A `with` whose __enter__ raised never reaches __exit__.
                self.release(error)
                raise
        return self

    def _hold_share(self, ray: Any) -> None:
        """Reserve the claim's share on one node until :meth:`release`, waiting visibly."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from fluksio_nb.queue import ClaimTimeout

        if self.wanted.timeout is not None:
            self._deadline = time.monotonic() + self.wanted.timeout
        self.status.phase, self.status.asked_at = "waiting", time.monotonic()
        group = placement_group([ray_resources(self.wanted)], strategy="STRICT_PACK")
        # Resolved by Ray itself when the group is placed: no task, no worker.
        ready = group.ready()
        try:
            while not ray.wait([ready], timeout=_SIGNAL_CHECK_S)[0]:
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    raise ClaimTimeout(
                        f"{self.status.label} waited {self.wanted.timeout:g} s for its share "
                        "on the Ray cluster and gave up: the cluster's nodes are busy. Raise "
                        "timeout=, or ask for less."
                    )
                self._raise_if_cancelled()
                if self._due_to_show():
                    self._show()
        except BaseException:
            remove_placement_group(group)
            raise
        self._held = group
        task, _ = _remote_functions(ray)
        self._held_task = task.options(
            **task_options(self.wanted, self.status.label),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
        )
        self.status.phase, self.status.started_at = "running", time.monotonic()
        self.granted_at = time.time()
        self._update_view()

    def release(self, error: BaseException | None = None) -> None:
        from fluksio_nb.context import _ending_of, _message_of

        with _lock:
            _live.pop(id(self), None)
        if self._held is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # the cluster may be gone already
                remove_placement_group(self._held)
            self._held = self._held_task = None
        if self.status.phase == "done":
            return
        if error is None:
            self._end("ok", "")
        else:
            self._end(_ending_of(error), _message_of(error))

    def __enter__(self) -> RayClaim:
        return self.acquire()

    def __exit__(self, kind, error, traceback) -> None:
        self.release(error)

    def cancel(self, reason: str) -> bool:
        """Stop the running task, or keep the next from starting. False once the claim ended.

        From any thread: the thread following the task notices within
        :data:`_SIGNAL_CHECK_S` and stops it as the stop button would.
        """
        if self.status.phase == "done":
            return False
        self._cancelled = reason
        return True

    def popen(self, *args: Any, **kwargs: Any) -> Any:
        raise BadClaim(
            "popen() starts a process on this machine, and this claim's share is on the "
            "Ray cluster: start the process inside c.run(...) with subprocess instead."
        )

    # -- running ---------------------------------------------------------------

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` in a Ray task holding this share; return its result."""
        from fluksio_nb.context import call_through

        return call_through(self.run_code, _relay_sink(), fn, args, kwargs)

    def run_code(
        self,
        code: str,
        inputs: Mapping[str, object] | Packed,
        outputs: Sequence[str] | None,
        sink: Any,
        *,
        if_changed: Sequence[str] = (),
        random_state: dict[str, Any] | None = None,
    ) -> Outcome:
        """Run notebook code as a Ray task holding this share; raise how it failed.

        ``if_changed`` names inputs to bring back too if the code changed them in
        place; ``random_state`` is the global random streams the code draws from.
        """
        from fluksio_nb.worker.client import UnsendableInput

        ray = self.acquire()._ray
        packed = inputs if isinstance(inputs, Packed) else pack_inputs(inputs)
        if packed.failures:
            name, reason = next(iter(packed.failures.items()))
            raise UnsendableInput(
                f"input '{name}' cannot be sent to the Ray cluster ({reason}) — "
                f"leave '{name}' out of the cell's inputs and create it inside the cell"
            )
        task = self._held_task or _task_for(ray, self.wanted, self.status.label)
        job = _job_of(ray)
        mailboxes_name, mailboxes = _kernel_mailboxes(ray, job)
        through_client = _through_client(ray)
        self._raise_if_cancelled()
        deadline = self._deadline
        if deadline is None and self.wanted.timeout is not None:
            deadline = time.monotonic() + self.wanted.timeout
        self._timed_out = None
        if self._held is None:
            # A held block runs in its own share, and has been running since entry.
            self.status.phase, self.status.asked_at = "waiting", time.monotonic()
            self.status.started_at = self.status.ended_at = None
            self._update_view()
        cell = TaskCell(
            mailboxes=mailboxes_name,
            box=uuid.uuid4().hex,
            code=code,
            outputs=None if outputs is None else list(outputs),
            ram_bytes=self.wanted.ram_bytes or None,
            through_client=through_client,
            if_changed=list(if_changed),
            random_state=random_state,
            names=list(packed.values),
        )
        machine = None if through_client else _cluster_machine(ray, job)
        if machine is not None:
            parcel = _inputs_as_parcel(list(packed.values), list(packed.values.values()))
            try:
                sharing = replace(cell, names=[], machine=machine, parcel=parcel)
                result = self._submit(ray, task, mailboxes, sharing, [], sink, deadline)
                return self._outcome(result)
            except ElsewhereThanTheKernel:
                # Nothing ran: the task checked where it was before anything else.
                _elsewhere.add(job)
                cell = replace(cell, box=uuid.uuid4().hex)
            finally:
                # After the outputs were unpacked: one may lie in a file of this
                # parcel, which is only written again once it is given back.
                parcel.discard()
        # Handed to the task as arguments, not put first and referred to: Ray
        # keeps a small one in the task's own message, and puts a big one in
        # the object store as it does a bare task's, with no reference to
        # lend the task and have it give back.
        values = [
            portable(frozen) if through_client else frozen for frozen in packed.values.values()
        ]
        return self._outcome(self._submit(ray, task, mailboxes, cell, values, sink, deadline))

    def _submit(
        self,
        ray: Any,
        task: Any,
        mailboxes: Any,
        cell: TaskCell,
        values: list[Frozen],
        sink: Any,
        deadline: float | None,
    ) -> dict[str, Any]:
        """Run the cell's task to its end, relaying its output; its result, or how it failed."""
        label = self.status.label
        running = task.remote(cell, *values)
        try:
            result = self._follow(ray, mailboxes, cell.box, running, sink, deadline)
        except KeyboardInterrupt:
            mailboxes.forget.remote(cell.box)
            stop_task(ray, running)
            raise
        except ray.exceptions.RayTaskError as error:
            if isinstance(getattr(error, "cause", None), ElsewhereThanTheKernel):
                raise error.cause from None
            raise _remote_error(error) from None
        except ray.exceptions.TaskCancelledError:
            from fluksio_nb.queue import ClaimCancelled

            raise ClaimCancelled(
                f"{label} was cancelled on the Ray cluster, from outside this cell."
            ) from None
        except ray.exceptions.RayError as error:
            # The worker crashed, its node went away, or Ray's own memory
            # monitor killed it: the cell did not end by itself.
            from fluksio_nb.context import WorkerDied

            if isinstance(error, ray.exceptions.RayActorError):
                _forget_mailboxes()  # the next claim makes a new one
            raise WorkerDied(
                f"the Ray worker running the cell ended: {_first_line(error)}. "
                "Its share was given back; run the cell again."
            ) from None
        if self._timed_out is not None:
            from fluksio_nb.queue import ClaimTimeout

            raise ClaimTimeout(self._timed_out)
        self._raise_if_cancelled()
        assert result is not None, "a task followed to its end has a result"
        return result

    def _raise_if_cancelled(self) -> None:
        if self._cancelled is not None:
            from fluksio_nb.queue import ClaimCancelled

            while_ = "while running" if self.status.phase == "running" else "while waiting"
            raise ClaimCancelled(f"{self.status.label} was cancelled {while_}: {self._cancelled}")

    def _follow(
        self, ray: Any, mailboxes: Any, box: str, running: Any, sink: Any, deadline: float | None
    ) -> dict[str, Any] | None:
        """Relay the task's output while it runs; its result once all of it is shown.

        ``None`` when the task ran out of time or was cancelled. The task's
        last output comes with its result, with the count of what went
        through the mailbox, so a task that has ended costs no wait on the
        mailbox unless some of that is still on its way. The mailbox is first
        read only once the task could have written to it
        (:data:`FIRST_SEND_AFTER_S` after it was sent): a cell over by then
        costs no actor call at all, where the read and the goodbye to the box
        were two, and kept the actor's process busy on a core the task needed.
        """
        submitted = time.monotonic()
        taking = None
        shown = 0
        while True:
            if taking is None and time.monotonic() - submitted >= FIRST_SEND_AFTER_S:
                taking = mailboxes.take.remote(box, _TAKE_WAIT_S)
            if taking is None:
                waiting_on = [running]
                wait_s = min(_SIGNAL_CHECK_S, submitted + FIRST_SEND_AFTER_S - time.monotonic())
            else:
                waiting_on, wait_s = [taking, running], _SIGNAL_CHECK_S
            ready, _ = ray.wait(waiting_on, num_returns=1, timeout=max(wait_s, 0.0))
            if deadline is not None and time.monotonic() >= deadline:
                self._timed_out = (
                    f"{self.status.label} ran past its {self.wanted.timeout:g} s timeout and "
                    "was stopped. Raise --timeout, or make the cell do less."
                )
            if self._timed_out is not None or self._cancelled is not None:
                mailboxes.forget.remote(box)
                stop_task(ray, running)
                return None
            if taking is not None and taking in ready:
                items = ray.get(taking)
                shown += len(items)
                self._take(items, sink)
                taking = mailboxes.take.remote(box, _TAKE_WAIT_S)
            elif running in ready:
                break
            elif self._due_to_show():
                self._show()
        try:
            result = ray.get(running)
        except ray.exceptions.RayError:
            # The task put all it had in the mailbox before it failed.
            leaving = mailboxes.forget.remote(box)
            if taking is not None:
                self._take(ray.get(taking), sink)
            self._take(ray.get(leaving), sink)
            raise
        if taking is None and shown < result["sent"]:
            taking = mailboxes.take.remote(box, _TAKE_WAIT_S)
        while shown < result["sent"]:
            # Sent before the task ended, and not here yet: it is on its way.
            if ray.wait([taking], timeout=_SIGNAL_CHECK_S)[0]:
                items = ray.get(taking)
                shown += len(items)
                self._take(items, sink)
                taking = mailboxes.take.remote(box, _TAKE_WAIT_S)
        if taking is not None:
            # Wakes the read still waiting, and keeps a late write from
            # making the box again. A box never read was never made.
            mailboxes.forget.remote(box)
        self._take(result["unsent"], sink)
        return result

    def _take(self, items: list[Any], sink: Any) -> None:
        """Show what the task sent."""
        for item in items:
            kind = item[0]
            if kind == "stdout":
                sink.stdout(item[1])
            elif kind == "stderr":
                sink.stderr(item[1])
            elif kind == "display":
                sink.display(item[1], item[2])
            elif kind == "result":
                sink.result(item[1], item[2])
            elif kind == "error":
                sink.error(item[1], item[2], item[3])
            elif kind == "clear_output":
                clear_output = getattr(sink, "clear_output", None)
                if clear_output is not None:
                    clear_output(item[1])
            elif kind == "sample":
                self.status.readings.add(Sample(**item[1]))
                # A running claim is shown at its first reading, as a local one is.
                self._show()
                self._update_view()
            elif kind == "started":
                self._started(item[1])

    def _started(self, facts: dict[str, Any]) -> None:
        self.node = facts["node"]
        self.env = dict(facts["env"])
        self.allocation = Allocation(
            cpus=self.wanted.cpus,
            gpus=tuple(int(gpu) if gpu.isdigit() else gpu for gpu in facts["gpus"]),
            ram_bytes=self.wanted.ram_bytes,
        )
        self.status.phase, self.status.allocation = "running", self.allocation
        self.status.budget = facts["budget"]
        if self._held is None:
            self.status.started_at, self.granted_at = time.monotonic(), time.time()
        self._update_view()

    def _outcome(self, result: dict[str, Any]) -> Outcome:
        from fluksio_nb.context import ClaimHalted, WorkerDied, cell_raised

        parcel = result.get("parcel")
        if result["halted"] is not None or result["died"] is not None:
            _discard_outputs(result)
        if result["halted"] is not None:
            raise ClaimHalted(result["halted"])
        if result["died"] is not None:
            raise WorkerDied(f"{result['died']}. Its share was given back; run the cell again.")
        values: dict[str, Any] = {}
        failed = dict(result["failed"])
        if parcel is not None:
            # On the kernel's machine: mapped where the worker wrote them,
            # writable, with no copy.
            unpacked, unreadable = transfer.unpack(parcel)
            values.update(unpacked)
            failed.update(unreadable)
        for name, frozen in result["outputs"].items():
            try:
                values[name] = thaw(frozen, writable=True)
            except Exception as error:
                failed[name] = str(error) or type(error).__name__
        outcome = Outcome(
            "ok" if result["error"] is None else "error",
            "the cell finished",
            values,
            failed,
            tuple(result.get("absent", ())),
            random_state=result.get("random_state"),
        )
        if result["error"] is not None:
            raise cell_raised(*result["error"], outcome)
        return outcome

    # -- showing ---------------------------------------------------------------

    def _due_to_show(self) -> bool:
        """Whether the claim has waited in Ray's queue long enough to be shown waiting."""
        if self._show_after is None or self.status.phase != "waiting":
            return False
        return time.monotonic() - self.status.asked_at >= self._show_after

    def _show(self) -> None:
        if self._view is not None and not self._shown:
            self._shown = True
            self._view.show(self.status)

    def _update_view(self) -> None:
        if self._view is not None and self._shown:
            self._view.update(self.status)

    def _end(self, ending: Any, message: str) -> None:
        self.status.phase, self.status.ending, self.status.message = "done", ending, message
        self.status.ended_at = time.monotonic()
        if self.status.started_at is None:
            self.status.started_at = self.status.ended_at
        self._update_view()
        if self._summary is not None:
            # What a saved notebook and nbval read, after the live view if
            # there was one (see Claim._end).
            self._shown = True
            self._summary.show(self.status)


def stop_task(ray: Any, running: Any) -> None:
    """Stop a claim's task, and with it the cell's process group; return once it is over.

    First as the stop button stops a local claim: Ray raises
    ``KeyboardInterrupt`` in the task, where the worker's own ladder (SIGINT,
    SIGTERM, SIGKILL to the cell's whole process group) ends the cell and
    whatever it started. Ray's forced cancel comes only if that did not end
    the task in time: it kills the task's process at once, and Ray then ends
    that process's children itself, but not the processes the cell started
    below them, which are in a group of their own.
    """
    ray.cancel(running, force=False)
    try:
        ended, _ = ray.wait([running], timeout=_GRACE_TO_STOP_S)
    except KeyboardInterrupt:
        ended = []  # a second press of the stop button: no more patience
    if not ended:
        ray.cancel(running, force=True)
        with contextlib.suppress(Exception):
            ray.wait([running], timeout=_GRACE_TO_STOP_S)
    # A task that finished just before it was stopped left its outputs in
    # shared memory on the kernel's machine, for a kernel that will not read them.
    with contextlib.suppress(Exception):
        if ray.wait([running], timeout=0)[0]:
            _discard_outputs(ray.get(running))


def _discard_outputs(result: Mapping[str, Any]) -> None:
    """Remove the shared-memory files of a task's outputs that will never be unpacked."""
    parcel = result.get("parcel")
    if parcel is not None:
        parcel.discard()


def _relay_sink() -> Any:
    from fluksio_nb.relay import CellOutput

    return CellOutput()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _remote_error(error: Any) -> Exception:
    """Ray's wrapper of an exception raised by the task's own code, as the cell's error."""
    from fluksio_nb.context import RemoteError

    cause = getattr(error, "cause", None)
    ename = type(cause).__name__ if cause is not None else type(error).__name__
    evalue = str(cause) if cause is not None else _first_line(error)
    if isinstance(cause, ModuleNotFoundError) and "fluksio_nb" in evalue:
        evalue += " on the Ray cluster's nodes: install fluksio_nb there too"
    return RemoteError(ename, evalue, str(error).splitlines())


def run_cell(
    shell: Any,
    parsed: Any,
    cell: str,
    inputs: Sequence[str],
    outputs: Sequence[str] | None,
    sink: Any,
    if_changed: Sequence[str] = (),
) -> Outcome:
    """``%%claim ... --on ray``: run the cell as a Ray task; how it went, names included.

    ``parsed`` is the cell's :class:`~fluksio_nb.claim_line.ClaimLine`. The
    caller binds the names that came back, as for a local claim.
    """
    claimed, packed = _prepare(shell, parsed, inputs)
    with claimed:  # connected already: only the release is left to the block
        return claimed.run_code(
            cell,
            packed,
            outputs,
            sink,
            if_changed=if_changed,
            random_state=random_streams.capture(),
        )


def start_job(
    shell: Any,
    parsed: Any,
    cell: str,
    inputs: Sequence[str],
    outputs: Sequence[str] | None,
    *,
    by_hand: bool,
    if_changed: Sequence[str] = (),
) -> Any:
    """``%%claim ... --on ray --background``: the task runs while the user goes on; its handle.

    The handle is a local background claim's (:class:`~fluksio_nb.jobs.Job`),
    with the same promises: output in the cell that started it, names on the
    handle. Connecting and refusing a claim no node can hold happen before it
    returns, as they do for a cell that waits.
    """
    from fluksio_nb.jobs import Job

    claimed, packed = _prepare(shell, parsed, inputs, show_at_once=True)
    return Job(claimed, cell, packed, outputs, by_hand, if_changed, shell.user_ns)


def _prepare(
    shell: Any, parsed: Any, inputs: Sequence[str], show_at_once: bool = False
) -> tuple[RayClaim, Packed]:
    """A claim connected to its cluster and the cell's inputs packed; bad input a UsageError."""
    from IPython.core.error import UsageError

    from fluksio_nb.status import new_view

    packed = pack_inputs({name: shell.user_ns[name] for name in inputs})
    if packed.failures:
        names = ", ".join(f"'{n}' ({reason})" for n, reason in sorted(packed.failures.items()))
        raise UsageError(
            f"%%claim: cannot send {names} to the Ray cluster. Create it inside the cell, "
            "or leave it out with --in."
        )
    try:
        # A background claim's status is shown at once, from this thread: it
        # belongs in the cell that started it, which is only the executing one now.
        claimed = RayClaim(
            parsed.resources,
            parsed.on,
            view=new_view(),
            show_after=None if show_at_once else SHOW_AFTER_S,
        )
        claimed.acquire()
    except BadClaim as error:
        raise UsageError(str(error)) from None
    return claimed, packed


# -----------------------------------------------------------------------------
# The monitor's view
# -----------------------------------------------------------------------------


def ray_snapshot() -> dict[str, Any] | None:
    """The Ray cluster this kernel is connected to, and this kernel's claims on it.

    ``None`` when Ray is not imported or not connected: asking never imports
    Ray nor connects, so a monitor can call this every second for free.
    """
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        total = ray.cluster_resources()
        available = ray.available_resources()
        nodes = len(_alive_nodes(ray.nodes()))
    except Exception:
        return None
    with _lock:
        live = list(_live.values())
    return {
        "address": _connected_to or _gcs_address(ray),
        "nodes": nodes,
        "total": _resources(total),
        "available": _resources(available),
        "claims": [_claim_facts(claimed) for claimed in live],
    }


def _resources(resources: Mapping[str, float]) -> dict[str, float | int]:
    return {
        "cpus": resources.get("CPU", 0.0),
        "gpus": resources.get("GPU", 0.0),
        "memory_bytes": int(resources.get("memory", 0)),
        "object_store_bytes": int(resources.get("object_store_memory", 0)),
    }


def _claim_facts(claimed: RayClaim) -> dict[str, Any]:
    status = claimed.status
    latest = status.readings.latest
    # Start times as the wall clock has them, for a monitor that counts the
    # seconds itself: an age would change on every read.
    now_wall, now_mono = time.time(), time.monotonic()
    started = status.started_at
    return {
        "label": status.label,
        "phase": status.phase,
        "asked": {
            "cpus": status.asked.cpus,
            "gpus": status.asked.gpus,
            "ram_bytes": status.asked.ram_bytes or None,
        },
        "node": claimed.node,
        "gpus": list(claimed.allocation.gpus) if claimed.allocation else [],
        "waited_s": round(status.waited_s, 1),
        "elapsed_s": round(status.elapsed_s, 1),
        "rss_bytes": latest.rss_bytes if latest else None,
        "peak_rss_bytes": status.readings.peak_rss_bytes,
        "cpu_percent": latest.cpu_percent if latest else None,
        "budget_bytes": status.budget.applied_bytes if status.budget else None,
        "since": round(now_wall - (now_mono - status.asked_at), 1),
        "started": None if started is None else round(now_wall - (now_mono - started), 1),
    }


def describe_ray(snapshot: Mapping[str, Any]) -> str:
    """:func:`ray_snapshot` as a few lines of text, the monitor's fallback beside the machine's."""
    total, free = snapshot["total"], snapshot["available"]
    nodes = snapshot["nodes"]
    lines = [
        f"ray   {snapshot['address'] or 'a cluster'}, {nodes} node{'s' if nodes != 1 else ''}",
        f"ray cpus    {free['cpus']:g}/{total['cpus']:g} free",
        f"ray gpus    {free['gpus']:g}/{total['gpus']:g} free",
        f"ray memory  {human(free['memory_bytes'])}/{human(total['memory_bytes'])} free",
    ]
    for claim in snapshot["claims"]:
        asked = claim["asked"]
        words = [f"cpus={asked['cpus']}", f"gpus={asked['gpus']}"]
        if asked["ram_bytes"]:
            words.append(f"ram={human(asked['ram_bytes'])}")
        line = f"ray {claim['phase']:<8} {claim['label']!s}: {' '.join(words)}"
        if claim["gpus"]:
            line += f", cards {','.join(map(str, claim['gpus']))}"
        if claim["rss_bytes"] is not None:
            budget = claim["budget_bytes"]
            line += f", RSS {human(claim['rss_bytes'])}"
            line += f" of {human(budget)}" if budget else ""
            line += f", CPU {claim['cpu_percent']:.0f}%"
        lines.append(line)
    return "\n".join(lines)
