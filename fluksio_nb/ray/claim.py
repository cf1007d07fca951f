"""The kernel's side of a claim on Ray: send the task, follow it to its end, stop it.

A claim ``--on ray`` must keep a local claim's promises — its status in the
cell, its output as it comes, its names back, its timeout, its stop button —
while Ray does the queueing and the placing. :class:`RayClaim` is that
claim, for ``%%claim ... --on ray`` and ``with claim(..., on="ray")`` alike.

What this module decides:

- **A cell is one task, a block one placement group.** A ``%%claim`` cell's
  task waits in Ray's queue as any task does; a ``with claim(..., on="ray")``
  block reserves one bundle on one node when it is entered, and every run in
  the block starts in it without queueing again.
- **On the kernel's own machine, values skip the object store.** When every
  node of the cluster is the machine the kernel runs on
  (:meth:`~.connection.RayConnection.cluster_machine`), the kernel writes the
  inputs into its shared memory as it does for a local claim, the task's
  worker maps them, and the worker's outputs come back to be mapped by the
  kernel, writable, with no copy. 8 MB in and 8 MB out went from 1.4–1.5
  times a bare task to 0.9 times. A task that finds itself elsewhere ran
  nothing, and the cell goes again by the object store.
- **The stop button cancels the task**, first as a local claim is stopped (the
  cell's whole process group, children included, ends), then by force if that
  was not enough (:func:`stop_task`). A cell stopped so keeps the names it had
  bound, as a local one does: the task returns them, marked stopped. A
  ``--background`` claim's handle cancels it the same way.
- **How a task failed is said as a local claim's failure would be**: the
  cell's own error as the cell's, a worker or node that died as
  :class:`~fluksio_nb.context.WorkerDied`, a cancel from outside as
  :class:`~fluksio_nb.queue.ClaimCancelled`.
- **A task's cards are held by the variable only**, and its share line says
  so, as a local claim's says what holds it: Ray sets ``CUDA_VISIBLE_DEVICES``
  and makes no cgroup on the node.

It is long because a claim on Ray keeps every promise a local claim keeps,
each through Ray's own calls: queueing, output, names, timeout and stop.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from fluksio_nb.books import Allocation
from fluksio_nb.card_compute import claim_compute_words
from fluksio_nb.enforcement import cards_held
from fluksio_nb.errors import (
    BadClaim,
    ClaimCancelled,
    ClaimHalted,
    ClaimTimeout,
    Interrupted,
    RemoteError,
    WorkerDied,
    unsendable,
)
from fluksio_nb.lifecycle import SHOW_AFTER_S, ClaimLifecycle, cell_raised
from fluksio_nb.ray.card_memory import sized_for_ray
from fluksio_nb.ray.connection import (
    ElsewhereThanTheKernel,
    _job_of,
    _through_client,
    parse_target,
    ray_connection,
)
from fluksio_nb.ray.mailbox import FIRST_SEND_AFTER_S, Mail, Mailboxes, Sampled, Started
from fluksio_nb.ray.task import TaskCell, _check_fits, ray_env, ray_resources, task_options
from fluksio_nb.ray.task_side import _inputs_as_parcel, run_claimed_cell
from fluksio_nb.ray.values import Frozen, Packed, pack_inputs, portable, thaw
from fluksio_nb.resources import Resources
from fluksio_nb.status import StatusView
from fluksio_nb.stop_button import stop_held_back, the_cell_is_over
from fluksio_nb.worker.client import Outcome
from fluksio_nb.worker.messages import forwarder
from fluksio_nb.worker.stopping import (
    GRACE_AFTER_SIGINT_AT_MOST,
    GRACE_AFTER_SIGKILL,
    GRACE_AFTER_SIGTERM,
)
from fluksio_nb.worker.values import unpack_outputs

#: Why a task's cards are held by the variable alone: what every view says beside them.
RAY_HOLDS_NO_CARD = "Ray sets the task's CUDA_VISIBLE_DEVICES; nothing on the node holds it to them"

#: The longest the kernel's thread blocks on Ray without looking for the stop
#: button: Python only runs signal handlers between calls into Ray.
_SIGNAL_CHECK_S = 0.1

#: How long a cancelled task gets to end its cell itself before Ray kills it:
#: the worker's whole ladder, SIGINT to SIGKILL, taken from the worker's own
#: graces so that the two cannot drift apart.
_GRACE_TO_STOP_S = GRACE_AFTER_SIGINT_AT_MOST + GRACE_AFTER_SIGTERM + GRACE_AFTER_SIGKILL

#: How long one read of the mailbox waits for output before asking again.
_TAKE_WAIT_S = 1.0


class RayClaim(ClaimLifecycle):
    """A claim whose work runs as Ray tasks: ``--on ray``'s :class:`~fluksio_nb.local_claim.Claim`.

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
        # machine's books behind it, have no say over a cluster's share. Read
        # only for a claim that names a flavor: finding and reading the file
        # was a twentieth of an empty cell's time.
        if wanted.flavor is not None:
            wanted = resolve_flavor(wanted, load_settings())
        if "CUDA_VISIBLE_DEVICES" in wanted.env:
            raise BadClaim(
                "CUDA_VISIBLE_DEVICES is Ray's to set on a cluster: it names the cards Ray "
                "granted. Ask for cards with gpus=N instead."
            )
        super().__init__(wanted, label="claim on ray", view=view, show_after=show_after)
        #: What Ray is asked for: a ``gpu_ram=`` slice is sized as a fraction (:mod:`.card_memory`).
        self.on_cluster = self.wanted
        #: The variables the task's worker was started with; before a task, the planned ones.
        self.env = ray_env(self.wanted)
        #: The Ray node the last task ran on.
        self.node: str | None = None
        self._ray: Any = None
        #: Why the last task was stopped for running out of time, if it was.
        self._timed_out: str | None = None
        #: Whether all the last task's output has been shown: a stop landing
        #: after that shows none of it again.
        self._all_shown = False
        #: Why the claim was cancelled from outside its thread, if it was.
        self._cancelled: str | None = None
        #: When the block's share was reserved, or else when the last task
        #: started on the cluster (``time.time()``).
        self._granted_at: float | None = None
        self._hold = hold
        #: The placement group holding a block's share, and the task shaped to run in it.
        self._held: Any = None
        self._held_task: Any = None
        #: A held block's deadline: its timeout counts from entry, waiting included.
        self._deadline: float | None = None

    @classmethod
    def for_block(cls, wanted: Resources, on: str | None, *, view: StatusView | None) -> RayClaim:
        claim = cls(wanted, on or "ray", view=view, hold=True)
        claim.held_by_a_block = True
        return claim

    @classmethod
    def for_cell(
        cls, wanted: Resources, on: str | None, *, view: StatusView, show_after: float | None
    ) -> RayClaim:
        return cls(wanted, on or "ray", view=view, show_after=show_after)

    reached_as = "the Ray cluster"
    pack_inputs = staticmethod(pack_inputs)

    @property
    def granted_at(self) -> float | None:
        return self._granted_at

    def take_place(self) -> None:
        # Ray's queue is the queue: what is settled here is that the cluster
        # answers and that some node of it can hold the claim.
        self.acquire()

    def acquire(self) -> RayClaim:
        """Connect, refuse a claim no node of the cluster can hold, and hold a block's share."""
        if self._ray is not None:
            return self
        ray = ray_connection.connect(self.target)
        self.on_cluster = sized_for_ray(ray, _job_of(ray), self.wanted)
        _check_fits(ray, _job_of(ray), self.on_cluster)
        self._ray = ray
        try:
            ray_connection.add_claim(self)
            self._remember_the_cell()
            if self._show_after is None:
                self._show()
            if self._hold:
                self._hold_share(ray)
        except BaseException as error:
            # A `with` whose __enter__ raised never reaches __exit__: given back
            # here, or the kernel counts it among its live claims for good.
            self.release(error)
            raise
        return self

    def _hold_share(self, ray: Any) -> None:
        """Reserve the claim's share on one node until :meth:`release`, waiting visibly."""
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.wanted.timeout is not None:
            self._deadline = time.monotonic() + self.wanted.timeout
        self.status.phase, self.status.asked_at = "waiting", time.monotonic()
        group = placement_group([ray_resources(self.on_cluster)], strategy="STRICT_PACK")
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
            # Whole: a second stop would leave the cluster holding the group.
            with stop_held_back():
                remove_placement_group(group)
            raise
        self._held = group
        task = ray_connection.remote(ray, run_claimed_cell)
        self._held_task = task.options(
            **task_options(self.on_cluster, self.status.label),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
        )
        self.status.phase, self.status.started_at = "running", time.monotonic()
        self._granted_at = time.time()
        self._update_view()

    def _give_back(self) -> None:
        ray_connection.drop_claim(self)
        if self._held is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # the cluster may be gone already
                remove_placement_group(self._held)
            self._held = self._held_task = None

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
        """Run notebook code as a Ray task holding this share; raise how it failed."""
        ray = self.acquire()._ray
        packed = inputs if isinstance(inputs, Packed) else pack_inputs(inputs)
        if packed.failures:
            raise unsendable(*next(iter(packed.failures.items())), "the Ray cluster")
        task = self._held_task or ray_connection.shaped(
            ray, run_claimed_cell, task_options(self.on_cluster, self.status.label)
        )
        job = _job_of(ray)
        mailboxes_name, mailboxes = ray_connection.mailboxes(ray, job, Mailboxes)
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
            gpu_ram_bytes=self.wanted.gpu_ram_bytes,
            through_client=through_client,
            if_changed=list(if_changed),
            random_state=random_state,
            names=list(packed.values),
        )
        machine = None if through_client else ray_connection.cluster_machine(ray, job)
        if machine is not None:
            parcel = _inputs_as_parcel(list(packed.values), list(packed.values.values()))
            try:
                sharing = replace(cell, names=[], machine=machine, parcel=parcel)
                result = self._submit(ray, task, mailboxes, sharing, [], sink, deadline)
                return self._outcome(result)
            except ElsewhereThanTheKernel:
                # Nothing ran: the task checked where it was before anything else.
                ray_connection.elsewhere.add(job)
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
        self._all_shown = False
        try:
            result = self._follow(ray, mailboxes, cell.box, running, sink, deadline)
        except KeyboardInterrupt:
            mailboxes.forget.remote(cell.box)
            # Stopped as it ran, the task ends as a local cell does, with the
            # names it had bound (task_side), unless only Ray's forced cancel
            # could end it. Stopped as its end arrived, the cell is over all
            # the same. Either way it ends as a cell stopped there does, its
            # names kept. What it printed last and had not reached the kernel
            # is lost with it.
            if not ray.wait([running], timeout=0)[0] and stop_task(ray, running) is None:
                raise
            the_cell_is_over()
            try:
                result = ray.get(running)
            except ray.exceptions.RayError:
                raise Interrupted() from None
            if not self._all_shown:
                self._take(result["unsent"], sink)
            return {**result, "stopped": True}
        except ray.exceptions.RayTaskError as error:
            # Said by fluksio_nb itself on the node, not by the cell: shown as itself.
            if isinstance(getattr(error, "cause", None), ElsewhereThanTheKernel | BadClaim):
                raise error.cause from None
            raise _remote_error(error) from None
        except ray.exceptions.TaskCancelledError:
            raise ClaimCancelled(
                f"{label} was cancelled on the Ray cluster, from outside this cell."
            ) from None
        except ray.exceptions.RayError as error:
            # The worker crashed, its node went away, or Ray's own memory
            # monitor killed it: the cell did not end by itself.
            if isinstance(error, ray.exceptions.RayActorError):
                ray_connection.forget_mailboxes()  # the next claim makes a new one
            raise WorkerDied(
                f"the Ray worker running the {'call' if self.held_by_a_block else 'cell'} "
                f"ended: {_first_line(error)}. {self.after_a_death()}"
            ) from None
        if self._timed_out is not None:
            raise ClaimTimeout(self._timed_out)
        self._raise_if_cancelled()
        assert result is not None, "a task followed to its end has a result"
        return result

    def _raise_if_cancelled(self) -> None:
        if self._cancelled is not None:
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
                    f"{self.status.label} reached its {self.wanted.timeout:g} s timeout and "
                    f"was stopped. {self.asking_more_time()}"
                )
            if self._timed_out is not None or self._cancelled is not None:
                mailboxes.forget.remote(box)
                ended = stop_task(ray, running)
                if ended is not None:
                    # Finished just before it was stopped: outputs nobody will read.
                    _discard_outputs(ended)
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
        self._all_shown = True
        # The cell's names are the kernel's now: a stop from here on lands once
        # they are bound. One that landed since the task ended, as its result
        # and last output came, is caught where the task was sent (_submit).
        the_cell_is_over()
        return result

    def _take(self, mail: list[Mail], sink: Any) -> None:
        """Show what the task sent: the worker's output as a local claim's, and its readings."""
        forward = forwarder(sink)
        for item in mail:
            match item:
                case Sampled(reading=reading):
                    self.status.readings.add(reading)
                    # A running claim is shown at its first reading, as a local one is.
                    self._show()
                    self._update_view()
                case Started(facts=facts):
                    self._started(facts)
                case _:
                    forward(item)

    def _started(self, facts: dict[str, Any]) -> None:
        self.node = facts["node"]
        self.env = dict(facts["env"])
        cards = tuple(int(gpu) if gpu.isdigit() else gpu for gpu in facts["gpus"])
        sliced = bool(cards) and self.wanted.is_slice
        self.allocation = Allocation(
            cpus=self.wanted.cpus,
            gpus=cards,
            ram_bytes=self.wanted.ram_bytes,
            gpu_bytes=(self.wanted.gpu_ram_bytes or 0) if sliced else 0,
        )
        if cards:
            # Ray tells the task its cards, and nothing on the node holds it to them.
            self.status.cards_enforcement = cards_held(None, RAY_HOLDS_NO_CARD)
            self.status.card_compute = claim_compute_words(self.env) if sliced else ""
        self.status.phase, self.status.allocation = "running", self.allocation
        self.status.budget = facts["budget"]
        if self._held is None:
            self.status.started_at, self._granted_at = time.monotonic(), time.time()
        self._update_view()

    def _outcome(self, result: dict[str, Any]) -> Outcome:
        parcel = result.get("parcel")
        readings = self.status.readings
        readings.peak_rss_bytes = max(readings.peak_rss_bytes, result.get("peak_bytes", 0))
        if result["halted"] is not None or result["died"] is not None:
            _discard_outputs(result)
            if result.get("stopped"):
                # The stop's ladder had to end the cell's worker: stopped all the same.
                raise Interrupted()
        if result["halted"] is not None:
            raise ClaimHalted(result["halted"])
        if result["died"] is not None:
            raise WorkerDied(f"{result['died']}. {self.after_a_death()}")
        values: dict[str, Any] = {}
        failed = dict(result["failed"])
        if parcel is not None:
            # On the kernel's machine: mapped where the worker wrote them,
            # writable, with no copy; refused by name where the kernel has no room.
            unpacked, unreadable = unpack_outputs(parcel)
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
        if result.get("stopped"):
            # Before its error: a cell the stop ended raised the stop.
            raise Interrupted(outcome)
        if result["error"] is not None:
            raise cell_raised(*result["error"], outcome)
        return outcome

    # -- showing ---------------------------------------------------------------

    def _due_to_show(self) -> bool:
        """Whether the claim has waited in Ray's queue long enough to be shown waiting."""
        if self._show_after is None or self.status.phase != "waiting":
            return False
        return time.monotonic() - self.status.asked_at >= self._show_after


def stop_task(ray: Any, running: Any) -> dict[str, Any] | None:
    """Stop a claim's task, and with it the cell's process group; its result, if it gave one.

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
    # One that finished just before it was stopped, or ended as a stopped
    # cell does (task_side), gave a result: outputs in shared memory on the
    # kernel's machine, for the caller to bind or discard.
    with contextlib.suppress(Exception):
        if ray.wait([running], timeout=0)[0]:
            return ray.get(running)
    return None


def _discard_outputs(result: Mapping[str, Any]) -> None:
    """Remove the shared-memory files of a task's outputs that will never be unpacked."""
    parcel = result.get("parcel")
    if parcel is not None:
        parcel.discard()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _remote_error(error: Any) -> Exception:
    """Ray's wrapper of an exception raised by the task's own code, as the cell's error."""
    cause = getattr(error, "cause", None)
    ename = type(cause).__name__ if cause is not None else type(error).__name__
    evalue = str(cause) if cause is not None else _first_line(error)
    if isinstance(cause, ModuleNotFoundError) and "fluksio_nb" in evalue:
        evalue += " on the Ray cluster's nodes: install fluksio_nb there too"
    return RemoteError(ename, evalue, str(error).splitlines())
