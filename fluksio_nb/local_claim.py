"""A claim on this machine: the kernel's queue, a worker, and the OS holding it to its share.

:class:`Claim` is what a ``%%claim`` cell, a ``--background`` job and a
``with claim(...)`` block take on this machine. Its life (waiting visibly,
the live view, the record, the ``with`` block) is
:class:`~fluksio_nb.lifecycle.ClaimLifecycle`'s, and its wait in the
kernel's queue :class:`~fluksio_nb.queued_claim.QueuedClaim`'s; what is its
own is how it starts and runs once granted: derive the environment from
what was granted, hold its processes to the share
(:mod:`fluksio_nb.confinement`), run the work in a worker or a subprocess
born with that environment, sample it, and give the share back however it
ends.

How it ends decides what the user reads. A cell that raised shows its own
traceback. A cell that was halted for memory, ran out of time, was
cancelled, or lost its worker says which of those happened and the numbers,
in one paragraph, because there is no traceback in the user's code to read.
A worker the kernel's out-of-memory killer ended inside the claim's memory
cgroup was stopped for its budget, not lost: it ends as
:class:`~fluksio_nb.errors.ClaimHalted`, like the sampler's halt, and says
which of the two acted. Past the budget's warning stage the cell is told
so, once, unless the halt follows before the next reading.

Inside a ``with claim(...)`` block, the kernel's own BLAS and OpenMP pools are
also held to the share (threadpoolctl), and restored after: code run directly
in the block is then as well-behaved as code sent to a worker. The ``%%claim``
magic and background jobs do not do this, because their work is not in the
kernel, and a background job limiting the kernel's pools would slow every
other cell the user runs meanwhile.

It is long because a claim's steps once granted (started, running,
stopped, ended) share one lock, one status and one record: a stop can land
between any two of them, and each step has to see what the others left.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import psutil

from fluksio_nb import transfer
from fluksio_nb.books import Allocation
from fluksio_nb.budget import HaltDecision, budget_here, in_the_copy_back, memory_warning
from fluksio_nb.card_compute import claim_compute_words
from fluksio_nb.confinement import Confinement
from fluksio_nb.env import derive_env, worker_environ
from fluksio_nb.errors import (
    ClaimCancelled,
    ClaimHalted,
    ClaimTimeout,
    Interrupted,
    WorkerDied,
)
from fluksio_nb.flavors import resolve_flavor
from fluksio_nb.gpu_usage import kernel_cards
from fluksio_nb.kernel import inventory, settings
from fluksio_nb.lifecycle import SHOW_AFTER_S, cell_raised, ending_of
from fluksio_nb.queue import ClaimQueue, Ticket
from fluksio_nb.queued_claim import QueuedClaim, held_in_this_thread
from fluksio_nb.records import BOOKS_ENDINGS, UsageRecord
from fluksio_nb.relay import CellOutput
from fluksio_nb.resources import Resources
from fluksio_nb.sampler import Sample, Sampler, is_news
from fluksio_nb.status import Ending, StatusView, note_ended, note_running
from fluksio_nb.stop_button import stop_held_back
from fluksio_nb.transfer import Parcel
from fluksio_nb.usage.log import UsageNotRecorded, kernel_usage_log
from fluksio_nb.vocabulary import error_line
from fluksio_nb.watch import Watch, Watched, kernel_watch
from fluksio_nb.worker.client import RUNNING_THE_CELL, Outcome, Worker
from fluksio_nb.worker.messages import SendingBack
from fluksio_nb.worker.pool import WorkerPool, kernel_pool
from fluksio_nb.worker.stopping import end_process_group


class Claim(QueuedClaim):
    """A share of this machine, held from :meth:`acquire` until :meth:`release`."""

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
        super().__init__(
            resolve_flavor(wanted, settings()),
            label="claim",
            view=view,
            show_after=show_after,
            queue=queue,
        )
        self._pool = pool or kernel_pool()
        self._watch = watch or kernel_watch()
        self._limit_kernel_threads = limit_kernel_threads
        self._thread_limits: Any = None
        self._stoppers: list[Callable[[], None]] = []
        #: What :meth:`popen` started, each with whether it leads a group of its own.
        self._processes: list[tuple[subprocess.Popen, bool]] = []
        #: The reading last reported to the books.
        self._told: Sample | None = None
        #: The reading that reached the warning stage, until the cell is told of it.
        self._warning_due: Sample | None = None
        #: Its cores and cgroups, once granted.
        self._confinement: Confinement | None = None
        #: While the running work's results are copied back, until its end is
        #: told, the worker's word of it: each name being sent and about how
        #: much it holds. A stop for memory in that time names them, not the
        #: cell's code, unless the code itself went past the budget.
        self._sending: SendingBack | None = None

    @classmethod
    def for_block(cls, wanted: Resources, on: str | None, *, view: StatusView | None) -> Claim:
        claim = cls(wanted, view=view, limit_kernel_threads=True)
        claim.held_by_a_block = True
        return claim

    @classmethod
    def for_cell(
        cls, wanted: Resources, on: str | None, *, view: StatusView, show_after: float | None
    ) -> Claim:
        return cls(wanted, view=view, show_after=show_after)

    @staticmethod
    def pack_inputs(values: Mapping[str, object]) -> Parcel:
        return transfer.pack(values, reuse=True, in_place=True)

    # -- the share --------------------------------------------------------------

    def acquire(self) -> Claim:
        """Wait for the share, showing where the claim stands while it waits."""
        try:
            ticket = self.enqueue()
            if ticket.allocation is None:
                self._refuse_to_wait_on_this_thread(ticket)
            allocation = self._wait(ticket)
        except BaseException as error:
            # A `with` whose __enter__ raised never reaches __exit__: the place
            # in the queue is given up here or nowhere, even when the stop
            # button came between the queue's ticket and this claim's; a second
            # stop lands once it is.
            with stop_held_back():
                if self._ticket is not None:
                    self._queue.release(self._ticket, ending_of(error))
                self._end(
                    ending_of(error),
                    str(error) if not isinstance(error, KeyboardInterrupt) else "",
                )
            if isinstance(error, KeyboardInterrupt) and not isinstance(error, Interrupted):
                # Stopped while waiting: one line, not the queue's frames.
                raise Interrupted() from None
            raise
        try:
            self._start(ticket, allocation)
            # In here: a stop landing as it is called would leave the claim
            # started and its block never entered, holding its share for good.
            held_in_this_thread().append(self)
        except BaseException as error:
            # Granted, but not started: the cgroups made so far, the share and
            # the place all go, as they would at the block's end.
            self.release(error)
            raise
        return self

    def _start(self, ticket: Ticket, allocation: Allocation) -> None:
        """From a share granted to a claim running: its env, budget, cgroups and status."""
        self.allocation = allocation
        self.env = derive_env(
            ticket.resources,
            allocation,
            self._card_sizes(ticket, allocation),
            {gpu.index: gpu.cuda_name for gpu in inventory().gpus},
        )
        stages = settings()
        self.budget = budget_here(
            allocation.ram_bytes,
            warn_at=stages.memory_warn_at,
            halt_at=stages.memory_halt_at,
            gpu_bytes=allocation.gpu_bytes or ticket.resources.gpu_ram_bytes,
        )
        ticket.on_cancel = self._cancelled
        ticket.on_warning = self._warned
        if ticket.warning is not None:
            # Warned between its grant and now.
            self._warned(ticket.warning)
        if ticket.cancelled is not None:
            # Cancelled between its grant and now, when the stop found no work
            # to stop: nothing has started, so nothing starts.
            raise ClaimCancelled(
                f"{self.status.label} was cancelled as it started: {ticket.cancelled}"
            )
        held = self._confinement = Confinement.make(allocation, self.budget, stages, inventory())
        self.status.memory_enforcement, self.status.cores_enforcement = held.memory, held.cpus
        self.status.cards_enforcement = held.gpus
        self.status.phase, self.status.allocation = "running", allocation
        self.status.budget, self.status.started_at = self.budget, time.monotonic()
        if allocation.gpu_bytes:
            self.status.card_compute = claim_compute_words(self.env)
        note_running(self.status)
        self._update_view()
        if self._limit_kernel_threads:
            from threadpoolctl import threadpool_limits

            self._thread_limits = threadpool_limits(limits=allocation.cpus)

    def _card_sizes(self, ticket: Ticket, allocation: Allocation) -> dict[int, int] | None:
        """Each granted card's size, for a claim with ``gpu_ram=``, which cannot go unread."""
        if ticket.resources.gpu_ram is None or not allocation.gpus:
            # A slice of gpus=0.5 is told its share without a size; held to it where read.
            if allocation.gpu_bytes:
                reading = kernel_cards().latest()
                return None if reading is None else _sizes(reading)
            return None
        return _sizes(self._cards_read_for_gpu_ram(ticket.resources))

    def _give_back(self) -> None:
        with contextlib.suppress(ValueError):
            held_in_this_thread().remove(self)
        if self._thread_limits is not None:
            self._thread_limits.restore_original_limits()
            self._thread_limits = None
        # Those that ended too: what they left running in their group goes now.
        for process, leads in self._processes:
            end_process_group(process, leads)
        held = self._confinement
        if held is not None:
            # One of its processes the cap killed, unasked about since: still a halt.
            self._halt_if_the_cap_killed()
            peak = held.peak_bytes()
            if peak is not None and peak > self.status.readings.peak_rss_bytes:
                self.status.readings.peak_rss_bytes = peak
            held.remove()
        if self._ticket is not None:
            # After the cap's halt: how it ended is said to the books' metrics.
            self._queue.release(self._ticket, self.ending_now())

    # -- running things under it -----------------------------------------------

    def _ready_worker(self, sink: Any) -> Worker:
        """A worker for the cell, warm from the pool where one fits, once it has started.

        A warm worker grown too big for the budget is ended, and a fresh one
        started. Stopped or failed on the way, the worker goes back to the
        pool (ended first if it had not started), at whatever moment.
        """
        worker: Worker | None = None
        try:
            worker = self._pool.checkout(self.env, timeout=self._time_left())
            self._wait_until_started(worker, sink)
            if self._grown_into_the_budget(worker):
                # What its earlier cells left it holding (a heap they freed but
                # Python kept, a library they imported) would count against this
                # claim's ram=, or leave it too little to run in.
                worker.kill()
                self._pool.checkin(worker, self.env)
                worker = None  # given back: a stop as the next starts leaves it be
                worker = self._pool.fresh(self.env)
                self._wait_until_started(worker, sink)
            return worker
        except BaseException:
            if worker is not None:
                with stop_held_back():
                    if worker.ready_at is None:
                        worker.kill()
                    self._pool.checkin(worker, self.env)
            raise

    def _wait_until_started(self, worker: Worker, sink: Any) -> None:
        """Until ``worker`` has started: a cold one's start is not the cell running.

        The live view is due one reading into the cell, not into the worker's
        imports (half a second on a slow machine), or every quick first cell
        would get one.
        """
        asked_at = time.monotonic()
        worker.wait_until_ready(timeout=self._time_left(), sink=sink)
        self._refuse_if_out_of_time()
        ready_at = worker.ready_at or time.monotonic()
        if ready_at > asked_at:
            # Waited for a worker to start, a fresh one or the one started
            # ahead of the first claim: not the cell's running, said apart.
            self.status.starting_s += ready_at - asked_at

    def _grown_into_the_budget(self, worker: Worker) -> bool:
        """Whether a warm worker has grown, since it started, by more than a quarter of the budget.

        Asked only of a claim with a ``ram=`` budget: one read of /proc.
        """
        limit = self.budget.halt_bytes if self.budget is not None else None
        if limit is None or not worker.held_when_ready:
            return False
        try:
            held = psutil.Process(worker.pid).memory_info().rss
        except psutil.Error:
            return False
        return held - worker.held_when_ready > limit / 4

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
        """Run notebook code in a worker that holds this share; raise how it failed."""
        held = self._confinement
        if self.allocation is None or held is None:
            raise RuntimeError("the claim has no share yet; use it inside its `with` block")
        self._refuse_if_out_of_time()
        self._sending = None
        worker: Worker | None = None
        watched: Watched | None = None

        def watch_it() -> None:
            nonlocal watched
            # Once the worker has the cell, while it runs it: the first reading
            # is an interval away, and the kernel would only wait meanwhile
            # (0.3 ms off a warm trivial claim, side by side). Held whole: a
            # stop once the watch had it, and before this claim did, left the
            # watch reading the worker, back idle in the pool, for good.
            with stop_held_back():
                watched = self._watch_process(worker.pid, family=family)

        try:
            worker = self._ready_worker(sink)
            # A warm worker ran an earlier claim on other cores, and its thread
            # pools are still there: every thread of it moves to this claim's.
            family = held.admit(worker.pid)
            self.status.memory_enforcement, self.status.cores_enforcement = held.memory, held.cpus
            self.status.cards_enforcement = held.gpus
            if (too_big := held.over_before_it_ran(self.budget)) is not None:
                self._halt(too_big)
                raise ClaimHalted(too_big)
            self._hold_process(stop=worker.kill)
            outcome = worker.run(
                code,
                inputs=inputs,
                outputs=outputs,
                sink=sink,
                if_changed=if_changed,
                random_state=random_state,
                on_sending_back=self._sending_back,
                on_sent=watch_it,
            )
        finally:
            # Whole, or a stop pressed again as the cell ended would leave the
            # worker out of the pool and still watched; from the moment the
            # pool handed it over, or it would be left running for nobody.
            with stop_held_back():
                self.status.sending_since = None
                self.status.sending_written = self.status.sending_total = 0
                if watched is not None:
                    self._stop_watching(watched)
                if worker is not None:
                    with contextlib.suppress(ValueError):
                        self._stoppers.remove(worker.kill)
                    if worker.alive:
                        held.let_go(worker.pid)
                    self._pool.checkin(worker, self.env)
        if outcome.sent_s is not None:
            self.status.sent_s = (self.status.sent_s or 0.0) + outcome.sent_s
            self.status.sent_bytes += outcome.sent_bytes
        self.status.sent_in_bytes += outcome.sent_in_bytes
        # A peak between two readings, which the readings would have missed.
        readings = self.status.readings
        readings.peak_rss_bytes = max(readings.peak_rss_bytes, outcome.peak_bytes)
        try:
            self._raise_for(outcome)
        finally:
            # A process of the claim's the cap kills later was not copying results.
            self._sending = None
        return outcome

    def _stop_watching(self, watched: Watched) -> None:
        """Take the worker off the watch, with one reading now if none came while it ran."""
        self._watch.discard(watched)
        if not self.status.readings.count:
            # Over before the first reading was due: how it went still says what the worker held.
            cards = kernel_cards().latest(wait_for_first=False) if watched.sampler.gpus else None
            last = watched.sampler.sample(cards=cards)
            if last is not None:
                self.status.readings.add(last)
        watched.sampler.close()

    def _refuse_if_out_of_time(self) -> None:
        """End the claim as timed out if its time ran out before the cell could start.

        A claim granted on the spot never looks at its deadline while it waits,
        and the running cell is held to it only from its first reading on: a
        quick cell past a tiny timeout ran to its end and was recorded "ok".
        """
        if self._deadline is None or time.monotonic() < self._deadline:
            return
        raise ClaimTimeout(
            f"{self.status.label} reached its {self.wanted.timeout:g} s timeout before its cell "
            f"started, so {'c.run' if self.held_by_a_block else 'the cell'} did not run; "
            "waiting, starting its worker and running all count. "
            f"Raise {self.timeout_option}."
        )

    def _time_left(self) -> float:
        """How long a worker may take to start or answer: the claim's time left, or 30 s."""
        left = None if self._deadline is None else self._deadline - time.monotonic()
        return 30.0 if left is None else max(left, 0.0)

    def _sending_back(self, written: int, total: int, announced: SendingBack) -> None:
        self._sending = announced
        status = self.status
        if status.sending_since is None:
            status.sending_since = time.monotonic()
        status.sending_written, status.sending_total = written, total
        self._update_view()

    def popen(self, args: Sequence[str] | str, **kwargs: Any) -> subprocess.Popen:
        """Start a subprocess with this share's environment, sampled and held to its budget.

        An ``env=`` given here is laid over the derived one, as a claim's own
        ``env`` is. The process ends, if it has not already, when the claim does,
        and so does everything in the process group it leads (a session of its
        own, unless ``start_new_session=False`` is given).
        """
        self._refuse_once_ended()
        held = self._confinement
        if self.allocation is None or held is None:
            raise RuntimeError("the claim has no share yet; use it inside its `with` block")
        extra = kwargs.pop("env", None) or {}
        kwargs.setdefault("start_new_session", True)
        kwargs["preexec_fn"] = held.into_the_share(then=kwargs.pop("preexec_fn", None))
        process = subprocess.Popen(args, env={**worker_environ(self.env), **extra}, **kwargs)
        leads = bool(kwargs["start_new_session"]) or kwargs.get("process_group") == 0
        self._processes.append((process, leads))
        self._hold_process(stop=lambda: end_process_group(process, leads))
        self._watch_process(process.pid)
        return process

    # -- stopping ----------------------------------------------------------------

    def _hold_process(self, stop: Callable[[], None]) -> None:
        """Make ``stop`` end a process of the claim's when the claim is stopped; now, if it is."""
        # A process of the claim the cap killed (a `c.popen`'s, a cell's
        # child) stopped the claim: whatever it is asked to do next is refused.
        self._halt_if_the_cap_killed()
        with self._lock:
            self._stoppers.append(stop)
            stopped = self._stop_reason is not None
        if stopped:
            # Stopped (cancelled, out of time) before this process was there to
            # stop, as while a cold worker started: it goes at once.
            stop()

    def _watch_process(self, pid: int, family: Sequence[int] | None = None) -> Watched:
        """Read the process and what it starts, and halt the claim on what the readings say."""
        assert self.budget is not None and self._confinement is not None
        # Told to a machine's books service, which kills it if an admin's
        # cancel is not carried out here (a kernel stopped, or hung).
        tell = getattr(self._queue, "processes", None)
        if tell is not None and self._ticket is not None:
            tell(self._ticket, [pid])
        return self._watch.add(
            Watched(
                sampler=Sampler(
                    pid,
                    gpus=tuple(self.allocation.gpus) if self.allocation else (),
                    family=family,
                ),
                budget=self.budget,
                on_sample=self._sampled,
                on_halt=self._halt,
                deadline=self._deadline,
                capped=self._confinement.cap is not None,
            )
        )

    def _sampled(self, sample: Sample) -> None:
        self.status.readings.add(sample)
        if not sample.stopped:
            self.status.stopped_since = None
        elif self.status.stopped_since is None:
            self.status.stopped_since = time.time()
        self._warn_if_amber(sample)
        # A cell still running at the first reading is worth a live status.
        self._show()
        # Reported to the books only when it changed by more than drift: each
        # report changes the snapshot every other kernel and the server read,
        # and a steady claim's readings are the same every tick.
        if self._ticket is not None and is_news(self._told, sample):
            self._told = sample
            self._queue.report(
                self._ticket,
                {
                    "rss_bytes": sample.rss_bytes,
                    "peak_rss_bytes": self.status.readings.peak_rss_bytes,
                    "cpu_percent": sample.cpu_percent,
                    "processes": sample.processes,
                    "gpu_bytes": sample.gpu_bytes,
                    "peak_gpu_bytes": self.status.readings.peak_gpu_bytes,
                    "gpu_percent": sample.gpu_percent,
                    "stopped_since": self.status.stopped_since,
                    "at": time.time(),
                },
            )
        self._update_view()

    def _warn_if_amber(self, sample: Sample) -> None:
        """Past the warning stage: the status turns amber, and the cell is told a reading later.

        Not at once: a claim growing straight through its budget is halted by
        then, and the halt says all the warning would. Told once, at the next
        reading short of the stop, or as the claim ends unstopped.
        """
        budget = self.budget
        if budget is None or budget.warn_bytes is None or budget.halt_bytes is None:
            return
        if sample.rss_bytes >= budget.halt_bytes:
            return
        self._tell_the_warning()
        with self._lock:
            if sample.rss_bytes < budget.warn_bytes or self.status.memory_warning:
                return
            self.status.memory_warning = True
            self._warning_due = sample

    def _tell_the_warning(self) -> None:
        with self._lock:
            due, self._warning_due = self._warning_due, None
        if due is not None and self._stop_reason is None and self.budget is not None:
            by = self.status.memory_enforcement.by if self.status.memory_enforcement else "sampler"
            (self._cell or CellOutput()).stderr(memory_warning(due.rss_bytes, self.budget, by))

    def _halt(self, decision: HaltDecision | None) -> None:
        if decision is None:
            self._stop(
                "timed out",
                f"{self.status.label} reached its {self.wanted.timeout:g} s timeout and was "
                f"stopped; waiting, starting its worker and running all count. "
                f"{self.asking_more_time()}",
                None,
            )
        else:
            decision = self._in_the_copy_back(decision)
            self._stop("halted", decision.message, decision)

    def _cancelled(self, reason: str) -> None:
        ticket = self._ticket
        if ticket is not None and ticket.ended_as in BOOKS_ENDINGS:
            # The admin's rule, not a person's cancel: its record says so too.
            self._stop(ticket.ended_as, f"{self.status.label} was stopped: {reason}", None)
            return
        self._stop("cancelled", f"{self.status.label} was cancelled while running: {reason}", None)

    def _warned(self, message: str) -> None:
        """What the books warn of (a time limit near, idle cards), or withdraw: a line in the
        cell, and in its view while it holds."""
        ticket = self._ticket
        # The client clears the ticket's warning before saying why it was withdrawn.
        withdrawn = ticket is not None and ticket.warning is None
        with self._lock:
            if self.status.warning == message or self._stop_reason is not None:
                return
            self.status.warning = None if withdrawn else message
        (self._cell or CellOutput()).stderr(f"fluksio_nb: {message}\n")
        self._update_view()

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
            # Killed by a machine's books service carrying out an admin's
            # cancel, maybe: the stop it sent first says who, once heard.
            hear = getattr(self._queue, "hear_all_sent", None)
            if hear is not None:
                hear()
            if self._stop_reason is not None:
                self._raise_for(outcome)
            capped = self._halt_if_the_cap_killed()
            if capped is not None:
                raise ClaimHalted(capped)
            raise WorkerDied(f"{self._in_words(outcome.died)}. {self.after_a_death()}")
        if outcome.error is not None:
            error = outcome.error
            raise cell_raised(error.ename, error.evalue, error.traceback, outcome)

    def _in_words(self, died: str) -> str:
        """How the worker died, said of what the user ran: a cell, or c.run's function."""
        return (
            died.replace(RUNNING_THE_CELL, "while running c.run's function")
            if self.held_by_a_block
            else died
        )

    def _halt_if_the_cap_killed(self) -> HaltDecision | None:
        """Halt the claim if the cap killed one of its processes and nothing stopped it first."""
        held = self._confinement
        if held is None or self._stop_reason is not None:
            return None
        capped = held.halt_by_the_cap(self.budget, self.status.readings.peak_rss_bytes)
        if capped is not None:
            capped = self._in_the_copy_back(capped)
            self._stop("halted", capped.message, capped)
        return capped

    def _in_the_copy_back(self, decision: HaltDecision) -> HaltDecision:
        """The stop as the copy back's, if the results were being copied back as it came."""
        sending, budget = self._sending, self.budget
        if sending is None or budget is None:
            return decision
        return in_the_copy_back(decision, budget, sending.sizes, sending.peak_bytes)

    # -- ending ------------------------------------------------------------------

    def _ended(self, ending: Ending) -> None:
        note_ended(self.status)
        self._tell_the_warning()
        self._record_usage(ending)

    def _record_usage(self, ending: Ending) -> None:
        """Leave the line `fluksio-nb usage` counts; a claim that never queued has none."""
        ticket = self._ticket
        if ticket is None:
            return
        held = self.allocation or ticket.allocation
        try:
            kernel_usage_log().write(
                UsageRecord(
                    ticket=ticket.number,
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
                    peak_gpu_bytes=self.status.readings.peak_gpu_bytes,
                    # The figures its cell's record says, figured once: every view says these.
                    waited_for_s=self.status.waited_s,
                    ran_for_s=self.status.ran_s if ticket.granted_at is not None else None,
                    error=None if ending == "ok" else error_line(self.status.message),
                )
            )
        except Exception as error:
            # The log warns of its own failures; a cell never fails for its accounting.
            warnings.warn(
                f"{self.status.label}'s usage was not recorded: {error}",
                UsageNotRecorded,
                stacklevel=2,
            )


def _sizes(reading: Any) -> dict[int, int]:
    return {card.index: card.total_bytes for card in reading.cards if card.total_bytes is not None}
