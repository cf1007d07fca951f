"""Holding a share for a block of code: ``with claim(cpus=2) as c:``.

:class:`Claim` is the one path every claimed piece of work takes, whether a
``%%claim`` cell, a ``--background`` job or a ``with claim(...)`` block: wait
in the kernel's queue with a visible status, derive the environment from what
was granted, run the work in a worker or a subprocess that was born with that
environment, sample it, and give the share back however it ends.

How it ends decides what the user reads. A cell that raised shows its own
traceback. A cell that was halted for memory, ran out of time, was
cancelled, or lost its worker says which of those happened and the numbers,
in one paragraph, because there is no traceback in the user's code to read.
A worker the kernel's out-of-memory killer ended inside the claim's memory
cgroup (:mod:`fluksio_nb.memory_cap`) was stopped for its budget, not lost:
it ends as :class:`ClaimHalted`, like the sampler's halt, and says which of
the two acted. Past the budget's warning stage the cell is told so, once.

Inside a ``with claim(...)`` block, the kernel's own BLAS and OpenMP pools are
also held to the share (threadpoolctl), and restored after: code run directly
in the block is then as well-behaved as code sent to a worker. The ``%%claim``
magic and background jobs do not do this, because their work is not in the
kernel, and a background job limiting the kernel's pools would slow every
other cell the user runs meanwhile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import psutil

from fluksio_nb.books import Allocation
from fluksio_nb.budget import (
    CGROUP_V2,
    Budget,
    HaltDecision,
    memory_warning,
    over_budget,
    resolve_budget,
)
from fluksio_nb.enforcement import (
    THREAD_VARIABLES,
    Enforcement,
    cores_enforcement,
    quota_enforcement,
)
from fluksio_nb.env import derive_env, worker_environ
from fluksio_nb.flavors import resolve_flavor
from fluksio_nb.inventory import confine_tree, host_memory
from fluksio_nb.kernel import accountant, inventory, settings
from fluksio_nb.memory_cap import (
    CapNotMade,
    ClaimCgroup,
    cap_place,
    memory_enforcement,
    sampled,
)
from fluksio_nb.queue import ClaimCancelled, ClaimQueue, ClaimTimeout, Ticket
from fluksio_nb.relay import CellOutput
from fluksio_nb.resources import Resources, ask
from fluksio_nb.sampler import Readings, Sample, Sampler, is_news
from fluksio_nb.status import ClaimStatus, Ending, StatusView, TextView, note_ended, note_running
from fluksio_nb.transfer import Parcel
from fluksio_nb.usage import UsageNotRecorded, UsageRecord, kernel_usage_log
from fluksio_nb.watch import Watch, Watched, kernel_watch
from fluksio_nb.worker.client import Interrupted, Outcome
from fluksio_nb.worker.pool import WorkerPool, kernel_pool

#: How long the status may lag the queue while a claim waits.
_STATUS_EVERY_S = 0.5

#: How long a claim waits before it is shown waiting. A running claim is shown
#: at its first reading, one sampling interval in. A cell done sooner shows
#: only its summary: a live view of a cell that is over before anyone could
#: read it costs more than the cell (measured: most of a trivial claimed
#: cell's time went to drawing it).
SHOW_AFTER_S = 0.25


class ClaimHalted(RuntimeError):
    """A claim stopped for memory: over its budget (sampler or cgroup), or the host short."""

    def __init__(self, decision: HaltDecision) -> None:
        super().__init__(decision.message)
        self.decision = decision


class WorkerDied(RuntimeError):
    """The worker process ended in the middle of the work."""


class RemoteError(Exception):
    """The claimed code raised; its traceback is the worker's, not the kernel's."""

    def __init__(
        self, ename: str, evalue: str, traceback: list[str], outcome: Outcome | None = None
    ) -> None:
        super().__init__(f"{ename}: {evalue}")
        self.ename, self.evalue, self.traceback = ename, evalue, traceback
        #: What the cell had bound before it raised, as a normal cell keeps it.
        self.outcome = outcome


class Claim:
    """A share of the machine, held from :meth:`acquire` until :meth:`release`."""

    def __init__(
        self,
        wanted: Resources,
        *,
        view: StatusView | None = None,
        queue: ClaimQueue | None = None,
        pool: WorkerPool | None = None,
        watch: Watch | None = None,
        limit_kernel_threads: bool = False,
        show_after: float | None = SHOW_AFTER_S,
    ) -> None:
        self.wanted = resolve_flavor(wanted, settings())
        self._queue = queue or accountant()
        self._pool = pool or kernel_pool()
        self._watch = watch or kernel_watch()
        self._view = view
        self._show_after = show_after
        self._shown = False
        self._summary: TextView | None = None
        self._limit_kernel_threads = limit_kernel_threads
        self._thread_limits: Any = None
        self._ticket: Ticket | None = None
        self._deadline: float | None = None
        self._lock = threading.Lock()
        self._stop_reason: tuple[Ending, str, HaltDecision | None] | None = None
        self._stoppers: list[Callable[[], None]] = []
        self._processes: list[subprocess.Popen] = []
        #: The reading last written to the machine's ledger.
        self._told: Sample | None = None
        self.status = ClaimStatus(label=self.wanted.label or "claim", asked=self.wanted)
        self.allocation: Allocation | None = None
        self.env: dict[str, str] = {}
        self.budget: Budget | None = None
        #: The claim's memory cgroup, while the kernel caps its memory.
        self._cap: ClaimCgroup | None = None
        #: Where the claim has no cores of its own: the cgroup that holds it to
        #: its cpus' worth of time (cgroup v1's cpu hierarchy; on v2 the quota
        #: goes in :attr:`_cap` when there is one).
        self._quota: ClaimCgroup | None = None
        #: Where this claim's messages to its cell go (the cell that asked).
        self._cell: CellOutput | None = None

    # -- the share --------------------------------------------------------------

    @property
    def readings(self) -> Readings:
        """The latest, peak and mean readings of everything this claim ran."""
        return self.status.readings

    def enqueue(self) -> Ticket:
        """Take a place in the queue and show it; does not wait. Idempotent."""
        if self._ticket is not None:
            return self._ticket
        if self.wanted.timeout is not None:
            self._deadline = time.monotonic() + self.wanted.timeout
        ticket = self._queue.enqueue(self.wanted)
        self._ticket = ticket
        # Made now, in the cell that asked: a background claim's summary
        # belongs there, not in whichever cell is running when it ends.
        self._cell = CellOutput()
        self._summary = TextView(self._cell)
        self.status.label, self.status.ticket = ticket.label, ticket.number
        self.status.asked = ticket.resources
        # A claim granted on the spot has no place in the queue to show, and
        # reading the ledger for one cost a warm trivial cell two more reads.
        if ticket.allocation is None:
            self._refresh_queue_position()
        if self._show_after is None:
            self._show()
        return ticket

    @property
    def granted_at(self) -> float | None:
        """When the queue granted the share (``time.time()``), if it has."""
        return None if self._ticket is None else self._ticket.granted_at

    def cancel(self, reason: str) -> bool:
        """Leave the queue, or stop the work if it is running. False if it never queued."""
        if self._ticket is None:
            return False
        return self._queue.cancel(self._ticket.number, reason)

    def acquire(self) -> Claim:
        """Wait for the share, showing where the claim stands while it waits."""
        try:
            ticket = self.enqueue()
            allocation = self._wait(ticket)
        except BaseException as error:
            # A `with` whose __enter__ raised never reaches __exit__: the place
            # in the queue is given up here or nowhere, even when the stop
            # button came between the queue's ticket and this claim's.
            if self._ticket is not None:
                self._queue.release(self._ticket)
            self._end(
                _ending_of(error), str(error) if not isinstance(error, KeyboardInterrupt) else ""
            )
            raise
        try:
            self._start(ticket, allocation)
        except BaseException as error:
            # Granted, but not started: the cgroups made so far, the share and
            # the place all go, as they would at the block's end.
            self.release(error)
            raise
        return self

    def _start(self, ticket: Ticket, allocation: Allocation) -> None:
        """From a share granted to a claim running: its env, budget, cgroups and status."""
        self.allocation = allocation
        self.env = derive_env(ticket.resources, allocation)
        stages = settings()
        if allocation.ram_bytes:
            total, available = host_memory()
            self.budget = resolve_budget(
                allocation.ram_bytes,
                host_total_bytes=total,
                host_available_bytes=available,
                warn_at=stages.memory_warn_at,
                halt_at=stages.memory_halt_at,
            )
        else:
            self.budget = Budget(None, None, stages.memory_warn_at, stages.memory_halt_at)
        ticket.on_cancel = self._cancelled
        if ticket.cancelled is not None:
            # Cancelled between its grant and now, when the stop found no work
            # to stop: nothing has started, so nothing starts.
            raise ClaimCancelled(
                f"{self.status.label} was cancelled as it started: {ticket.cancelled}"
            )
        self.status.memory_enforcement = self._make_cap(self.budget)
        self.status.cores_enforcement = self._hold_to_cores(allocation)
        self.status.phase, self.status.allocation = "running", allocation
        self.status.budget, self.status.started_at = self.budget, time.monotonic()
        note_running(self.status)
        self._update_view()
        if self._limit_kernel_threads:
            from threadpoolctl import threadpool_limits

            self._thread_limits = threadpool_limits(limits=allocation.cpus)

    def _make_cap(self, budget: Budget) -> Enforcement:
        """The claim's memory cgroup, where one can be made; what holds the claim either way."""
        if budget.halt_bytes is None:
            return sampled("the claim named no ram=, so it has no budget of its own to cap")
        enforcement = memory_enforcement(settings())
        if not enforcement.capped:
            return enforcement
        try:
            self._cap = ClaimCgroup.make(cap_place(), budget.halt_bytes)
        except CapNotMade as error:
            return sampled(str(error))
        return enforcement

    def _hold_to_cores(self, allocation: Allocation) -> Enforcement:
        """Own cores where the books pinned some; a CPU quota where they could not."""
        pinning = cores_enforcement(allocation.cores, settings().pin_cores, inventory().cpus)
        if pinning.capped or not settings().pin_cores:
            return pinning
        place = cap_place(controller="cpu")
        if not place.available:
            return replace(pinning, why=f"{pinning.why}; no CPU quota either: {place.why_not}")
        assert place.version is not None
        try:
            cap = self._cap
            if cap is not None and cap.version == place.version == CGROUP_V2:
                cap.limit_cpus(allocation.cpus)
            else:
                self._quota = ClaimCgroup.make_quota(place, allocation.cpus)
        except OSError as error:
            return replace(pinning, why=f"{pinning.why}; the CPU quota was not set: {error}")
        return quota_enforcement(allocation.cpus, place.version, pinning.why)

    def _cgroups(self) -> list[ClaimCgroup]:
        return [cgroup for cgroup in (self._cap, self._quota) if cgroup is not None]

    def _admit(self, pid: int) -> None:
        """Put a worker under the claim's cgroups; if it cannot go, say what holds it instead."""
        quota = self._quota
        if quota is not None:
            try:
                quota.admit(pid)
            except OSError as error:
                self._quota = None
                quota.remove()
                self.status.cores_enforcement = Enforcement(
                    THREAD_VARIABLES,
                    THREAD_VARIABLES,
                    f"the worker could not be moved into {quota.path}: {error}",
                )
        cap = self._cap
        if cap is None:
            return
        try:
            held = psutil.Process(pid).memory_info().rss
            cap.admit(pid, held)
        except (OSError, psutil.Error) as error:
            self._cap = None
            cap.remove()
            self.status.memory_enforcement = sampled(
                f"the worker could not be moved into {cap.path}: {error}"
            )

    def _wait(self, ticket: Ticket) -> Allocation:
        # The first look comes sooner: a claim still waiting then is shown
        # waiting, and one granted by then never needed to be.
        every = _STATUS_EVERY_S if self._show_after is None else self._show_after
        while True:
            left = None if self._deadline is None else self._deadline - time.monotonic()
            try:
                return self._queue.wait(ticket, every if left is None else min(max(left, 0), every))
            except ClaimTimeout:
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    raise ClaimTimeout(
                        self._queue.timeout_message(ticket, self.wanted.timeout)
                    ) from None
            every = _STATUS_EVERY_S
            self._refresh_queue_position()
            self._show()
            self._update_view()

    def _refresh_queue_position(self) -> None:
        ticket = self._ticket
        if ticket is None:
            return
        self.status.position = self._queue.position(ticket)
        self.status.holders = [
            f"{holder.label!r} (#{holder.number})"
            for holder in self._queue.holders()
            if holder.number != ticket.number
        ]

    def release(self, error: BaseException | None = None) -> None:
        """Give the share back and end everything this claim started."""
        if self._thread_limits is not None:
            self._thread_limits.restore_original_limits()
            self._thread_limits = None
        for process in self._processes:
            if process.poll() is None:
                _end_process_group(process)
        if self._cap is not None:
            # What the kernel counted is exact where a reading may have missed
            # the top of a fast allocation.
            peak = self._cap.peak_bytes()
            if peak is not None and peak > self.status.readings.peak_rss_bytes:
                self.status.readings.peak_rss_bytes = peak
        for cgroup in self._cgroups():
            cgroup.remove()
        if self._ticket is not None:
            self._queue.release(self._ticket)
        if self.status.phase != "done":
            if self._stop_reason is not None:
                ending, message, _ = self._stop_reason
                self._end(ending, message)
            elif error is None:
                self._end("ok", "")
            else:
                self._end(_ending_of(error), _message_of(error))

    def __enter__(self) -> Claim:
        return self.acquire()

    def __exit__(self, kind, error, traceback) -> None:
        self.release(error)

    # -- running things under it -----------------------------------------------

    def run_code(
        self,
        code: str,
        inputs: Mapping[str, object] | Parcel,
        outputs: Sequence[str] | None,
        sink: Any,
        *,
        if_changed: Sequence[str] = (),
        random_state: dict[str, Any] | None = None,
    ) -> Outcome:
        """Run notebook code in a worker that holds this share; raise how it failed.

        ``if_changed`` names inputs to bring back too if the code changed them in
        place; ``random_state`` is the global random streams the code draws from
        (:mod:`fluksio_nb.random_streams`).
        """
        if self.allocation is None:
            raise RuntimeError("the claim has no share yet; use it inside its `with` block")
        worker = self._pool.checkout(self.env)
        # A cold worker's start is not the cell running: the live view is due
        # one reading into the cell, not into the worker's own imports, which
        # take half a second on a slow machine and put a live view, then the
        # summary, under every first claimed cell that was over at once.
        try:
            left = None if self._deadline is None else self._deadline - time.monotonic()
            worker.wait_until_ready(timeout=30.0 if left is None else max(left, 0.0), sink=sink)
        except BaseException:
            worker.kill()
            self._pool.checkin(worker, self.env)
            raise
        # A warm worker ran an earlier claim on other cores, and its thread
        # pools are still there: every thread of it moves to this claim's.
        confine_tree(worker.pid, self._cores())
        self._admit(worker.pid)
        watched = self._watch_process(worker.pid, stop=worker.kill)
        try:
            outcome = worker.run(
                code,
                inputs=inputs,
                outputs=outputs,
                sink=sink,
                if_changed=if_changed,
                random_state=random_state,
                environ=worker_environ(self.env),
            )
        finally:
            self._watch.discard(watched)
            if not self.status.readings.count:
                # Over before the first reading was due: one now, so that how
                # it went still says what the worker held.
                last = watched.sampler.sample()
                if last is not None:
                    self.status.readings.add(last)
            watched.sampler.close()
            self._stoppers.remove(worker.kill)
            if worker.alive:
                # A warm worker goes back to the pool as it came: outside any claim.
                for cgroup in self._cgroups():
                    cgroup.let_go(worker.pid)
            self._pool.checkin(worker, self.env)
        self._raise_for(outcome)
        return outcome

    def run(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn(*args, **kwargs)`` in a worker holding this share; return its result."""
        return call_through(self.run_code, CellOutput(), fn, args, kwargs)

    def popen(self, args: Sequence[str] | str, **kwargs: Any) -> subprocess.Popen:
        """Start a subprocess with this share's environment, sampled and held to its budget.

        An ``env=`` given here is laid over the derived one, as a claim's own
        ``env`` is. The process ends, if it has not already, when the claim does.
        """
        if self.allocation is None:
            raise RuntimeError("the claim has no share yet; use it inside its `with` block")
        extra = kwargs.pop("env", None) or {}
        kwargs.setdefault("start_new_session", True)
        cgroups, cores = self._cgroups(), self._cores()
        for cgroup in cgroups:
            cgroup.settle(0)
        theirs = kwargs.pop("preexec_fn", None)

        def into_the_share() -> None:
            # In before it runs a line: moved after it started, what it
            # allocated first would be charged outside the cap, and what it
            # started first would run on any core.
            os.sched_setaffinity(0, cores)
            for cgroup in cgroups:
                cgroup.enter_from_child()
            if theirs is not None:
                theirs()

        kwargs["preexec_fn"] = into_the_share
        process = subprocess.Popen(args, env={**worker_environ(self.env), **extra}, **kwargs)
        self._processes.append(process)
        self._watch_process(process.pid, stop=lambda: _end_process_group(process))
        return process

    def _cores(self) -> frozenset[int]:
        """The cores this claim's processes run on: its own, or every claimable one."""
        assert self.allocation is not None
        if self.allocation.cores and settings().pin_cores:
            return frozenset(self.allocation.cores)
        return inventory().worker_cores or frozenset(os.sched_getaffinity(0))

    # -- stopping ----------------------------------------------------------------

    def _watch_process(self, pid: int, stop: Callable[[], None]) -> Watched:
        # A process of the claim the cap killed (a `c.popen`'s, a cell's
        # child) stopped the claim: whatever it is asked to do next is refused.
        if self._stop_reason is None:
            capped = self._stopped_by_the_cap()
            if capped is not None:
                self._stop("halted", capped.message, capped)
        with self._lock:
            self._stoppers.append(stop)
            stopped = self._stop_reason is not None
        if stopped:
            # Stopped (cancelled, out of time) before this process was there to
            # stop, as while a cold worker started: it goes at once.
            stop()
        assert self.budget is not None
        return self._watch.add(
            Watched(
                sampler=Sampler(pid),
                budget=self.budget,
                on_sample=self._sampled,
                on_halt=self._halt,
                deadline=self._deadline,
                capped=self._cap is not None,
            )
        )

    def _sampled(self, sample: Sample) -> None:
        self.status.readings.add(sample)
        self._warn_if_amber(sample)
        # The first reading comes one interval after the work started: a cell
        # still running then is worth a live status.
        self._show()
        # Written to the machine's ledger only when it changed by more than
        # drift: each report rewrites the file every other kernel and the
        # server read, and a steady claim's readings are the same every tick.
        if self._ticket is not None and is_news(self._told, sample):
            self._told = sample
            self._queue.report(
                self._ticket,
                {
                    "rss_bytes": sample.rss_bytes,
                    "peak_rss_bytes": self.status.readings.peak_rss_bytes,
                    "cpu_percent": sample.cpu_percent,
                    "processes": sample.processes,
                    "at": time.time(),
                },
            )
        self._update_view()

    def _warn_if_amber(self, sample: Sample) -> None:
        """Past the warning stage: the status turns amber and the cell is told, once."""
        budget = self.budget
        warn_at = None if budget is None else budget.warn_bytes
        if warn_at is None or sample.rss_bytes < warn_at:
            return
        assert budget is not None and budget.halt_bytes is not None
        if sample.rss_bytes >= budget.halt_bytes:
            # Past the warning and the stop in one reading: the halt says it all.
            return
        with self._lock:
            if self.status.memory_warning:
                return
            self.status.memory_warning = True
        enforcement = self.status.memory_enforcement
        line = memory_warning(
            sample.rss_bytes, budget, enforcement.by if enforcement else "sampler"
        )
        (self._cell or CellOutput()).stderr(line)

    def _halt(self, decision: HaltDecision | None) -> None:
        if decision is None:
            self._stop(
                "timed out",
                f"{self.status.label} ran past its {self.wanted.timeout:g} s timeout and was "
                "stopped. Raise --timeout, or make the cell do less.",
                None,
            )
        else:
            self._stop("halted", decision.message, decision)

    def _cancelled(self, reason: str) -> None:
        self._stop("cancelled", f"{self.status.label} was cancelled while running: {reason}", None)

    def _stop(self, ending: Ending, message: str, decision: HaltDecision | None) -> None:
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = (ending, message, decision)
            stoppers = list(self._stoppers)
        for stop in stoppers:
            stop()

    def _raise_for(self, outcome: Outcome) -> None:
        if self._stop_reason is not None:
            ending, message, decision = self._stop_reason
            if ending == "halted" and decision is not None:
                raise ClaimHalted(decision)
            if ending == "timed out":
                raise ClaimTimeout(message)
            raise ClaimCancelled(message)
        if outcome.died is not None:
            capped = self._stopped_by_the_cap()
            if capped is not None:
                self._stop("halted", capped.message, capped)
                raise ClaimHalted(capped)
            raise WorkerDied(f"{outcome.died}. Its share was given back; run the cell again.")
        if outcome.error is not None:
            error = outcome.error
            raise cell_raised(error.ename, error.evalue, error.traceback, outcome)

    def _stopped_by_the_cap(self) -> HaltDecision | None:
        """The halt to report for a worker that died, if the kernel's cap is what killed it."""
        cap, budget = self._cap, self.budget
        if cap is None or budget is None or budget.halt_bytes is None or not cap.oom_kills():
            return None
        peak = cap.peak_bytes()
        if peak is None:
            peak = self.status.readings.peak_rss_bytes
        return over_budget(peak, budget, cap.version)

    # -- showing ----------------------------------------------------------------

    def _show(self) -> None:
        with self._lock:
            if self._shown or self._view is None:
                return
            self._shown = True
        self._view.show(self.status)

    def _update_view(self) -> None:
        if self._view is not None and self._shown:
            self._view.update(self.status)

    def _end(self, ending: Ending, message: str) -> None:
        self.status.phase, self.status.ending, self.status.message = "done", ending, message
        self.status.ended_at = time.monotonic()
        if self.status.started_at is None:
            self.status.started_at = self.status.ended_at
        note_ended(self.status)
        self._record_usage(ending)
        self._update_view()
        if self._view is not None and self._summary is not None:
            # How it went is always left as text of its own, after the live
            # view if there was one: it is what a saved notebook shows without
            # its widgets, and what nbval compares, since nbval reads a live
            # view as it was first drawn, never as it was updated. A claim that
            # was over before its live view was due shows only this.
            self._shown = True
            self._summary.show(self.status)

    def _record_usage(self, ending: Ending) -> None:
        """Leave the line `fluksio-nb usage` counts; a claim that never queued has none."""
        ticket = self._ticket
        if ticket is None:
            return
        held = self.allocation or ticket.allocation
        try:
            kernel_usage_log().write(
                UsageRecord(
                    label=self.status.label,
                    # jupyter_server tells the kernels it starts which notebook they serve.
                    notebook=os.environ.get("JPY_SESSION_NAME"),
                    cpus=held.cpus if held else 0,
                    gpus=list(held.gpus) if held else [],
                    ram_bytes=held.ram_bytes if held else 0,
                    asked_at=ticket.since,
                    granted_at=ticket.granted_at,
                    ended_at=time.time(),
                    ending=ending,
                    peak_rss_bytes=self.status.readings.peak_rss_bytes,
                )
            )
        except Exception as error:
            # The log warns of its own failures; a cell never fails for its accounting.
            warnings.warn(
                f"{self.status.label}'s usage was not recorded: {error}",
                UsageNotRecorded,
                stacklevel=2,
            )


def cell_raised(
    ename: str, evalue: str, traceback: list[str], outcome: Outcome
) -> RemoteError | Interrupted:
    """What the kernel raises for a claimed cell that raised, here or on Ray.

    The stop button is an interrupt, as in a normal cell; anything else is the
    cell's own error. Either carries what the cell had bound.
    """
    if ename == "KeyboardInterrupt":
        return Interrupted(outcome)
    return RemoteError(ename, evalue, traceback, outcome)


def call_through(
    run_code: Callable[..., Outcome],
    sink: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """``fn(*args, **kwargs)`` as a one-line claimed cell run by ``run_code``; its result.

    A claim's ``run`` on this machine and on Ray alike: the function and its
    arguments travel as the cell's inputs and the result as its one output.
    """
    outcome = run_code(
        "__fluksio_result__ = __fluksio_fn__(*__fluksio_args__, **__fluksio_kwargs__)",
        {"__fluksio_fn__": fn, "__fluksio_args__": args, "__fluksio_kwargs__": kwargs},
        ["__fluksio_result__"],
        sink,
    )
    if "__fluksio_result__" in outcome.failed:
        raise RemoteError(
            "TransferError",
            f"the result could not be sent back: {outcome.failed['__fluksio_result__']}",
            [],
        )
    return outcome.outputs["__fluksio_result__"]


def _ending_of(error: BaseException) -> Ending:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, ClaimHalted):
        return "halted"
    if isinstance(error, ClaimTimeout):
        return "timed out"
    if isinstance(error, ClaimCancelled):
        return "cancelled"
    if isinstance(error, WorkerDied):
        return "died"
    return "error"


def _message_of(error: BaseException) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted by the user"
    return str(error)


def _end_process_group(process: subprocess.Popen) -> None:
    """SIGTERM the process's group, then SIGKILL whatever is left a moment later."""
    try:
        group = os.getpgid(process.pid)
    except ProcessLookupError:
        return
    for sig, grace in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=grace or 5)
            break
        except subprocess.TimeoutExpired:
            continue


def claim(
    cpus: int | None = None,
    gpus: int | None = None,
    ram: int | str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flavor: str | None = None,
    label: str | None = None,
    timeout: float | None = None,
    strict: bool = False,
    view: StatusView | None = None,
    on: str | None = None,
) -> Claim:
    """Hold a share of the machine for a ``with`` block.

    ``with claim(cpus=2, gpus=1, ram="8G") as c:`` waits for the share, then
    gives ``c.allocation``, ``c.env``, ``c.run(fn, *args)``, ``c.popen(args)``
    and ``c.readings``. The kernel's own BLAS/OpenMP pools are limited to the
    share inside the block.

    ``on="ray"`` (or a Ray address) holds the share on one node of a Ray
    cluster instead, and runs each ``c.run`` there as a Ray task: see
    :class:`fluksio_nb.ray.claim.RayClaim`.
    """
    fields: dict[str, Any] = {
        name: value
        for name, value in {"cpus": cpus, "gpus": gpus, "ram": ram, "flavor": flavor}.items()
        if value is not None
    }
    wanted = ask(**fields, env=dict(env or {}), label=label, timeout=timeout, strict=strict)
    if on is not None:
        from fluksio_nb.ray.claim import RayClaim

        return RayClaim(wanted, on, view=view, hold=True)  # type: ignore[return-value]
    return Claim(wanted, view=view, limit_kernel_threads=True)
