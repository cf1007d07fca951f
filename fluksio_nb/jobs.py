"""A claimed cell as a job: run here and waited for, or ``--background`` with a handle.

Every ``%%claim`` cell is a :class:`Job`, wherever it runs; a foreground cell
is a job run in the cell's own thread (:meth:`Job.run`), as a blocking call in
ipyparallel is a task plus a wait. A background cell has taken its place
before the magic returns (:meth:`Job.start`), in the main thread, so eight
background cells started in order are granted in that order and never more
at once than the inventory holds. Stopped before its handle returns, it
leaves nothing going on that the handle would have reached. It then waits and
runs on a thread of its own while the user goes on working. A cell ``--on
ray`` has connected to its cluster by then, and been refused if no node can
hold it; Ray's queue is its queue.

Two things a background cell must not do. Its output must not land in
whichever cell happens to be executing when it prints, so it is sent to the
cell that started it (see :mod:`fluksio_nb.relay`). And the names it binds must
not appear in the namespace at some unpredictable later moment, overwriting
what the user has since done with them; they wait on the handle, in
:meth:`Job.result`.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Sequence
from typing import Any

from fluksio_nb import random_streams
from fluksio_nb.errors import BadClaim, RemoteError
from fluksio_nb.lifecycle import ClaimLifecycle
from fluksio_nb.namespaces import each_at_home
from fluksio_nb.relay import CellOutput
from fluksio_nb.status import describe
from fluksio_nb.stop_button import stop_held_back
from fluksio_nb.worker.client import Outcome, Sink

#: How long starting a job granted on the spot waits for it to be running,
#: so that the cell says it runs. Its cgroups and its worker's checkout take
#: milliseconds; this only bounds a machine that is badly stuck.
STARTS_WITHIN_S = 5.0

#: How long a kernel that is shutting down waits for its background jobs to
#: end and write their usage records. Jupyter kills a kernel that has not
#: exited 5 s after it was asked to; a worker ends within about 1 s.
ENDS_WITHIN_S = 3.0

_unfinished: set[Job] = set()
_unfinished_lock = threading.Lock()


class Job:
    """A handle on a claimed cell: ``.result()``, ``.done()``, ``.cancel()``, ``.status``."""

    def __init__(
        self,
        claimed: ClaimLifecycle,
        code: str,
        inputs: Any,
        outputs: Sequence[str] | None,
        *,
        by_hand: bool = False,
        if_changed: Sequence[str] = (),
        home: dict[str, object] | None = None,
        output: Sink | None = None,
        random_state: dict[str, Any] | None = None,
    ) -> None:
        """Run ``code`` under ``claimed``, which takes its place as the job starts or runs.

        ``inputs`` were packed by the claim's place to run, and are discarded
        once the cell is over. ``home`` is the namespace the job's names are
        for: the functions and classes it makes read their globals from it, as
        if made there. ``random_state`` is the random streams the cell draws
        from; by default new ones, made in the thread that starts the job, in
        order, so that they are the same on every run of the notebook
        (:func:`fluksio_nb.random_streams.spawn`); they do not come back.
        """
        self._claim = claimed
        self._code, self._inputs, self._outputs = code, inputs, outputs
        self._if_changed = if_changed
        self._home = home
        self._random_state = random_streams.spawn() if random_state is None else random_state
        #: Whether the user named ``outputs`` with ``--out``: only then is a
        #: name the cell ended without worth a warning.
        self._by_hand = by_hand
        self._output = output or CellOutput()
        self._finished = threading.Event()
        #: Set once the claim is running, or failed to start.
        self._started = threading.Event()
        self._values: dict[str, object] = {}
        self._error: BaseException | None = None
        self._shown_by_its_cell = False
        #: Whose the job is once :meth:`start` has begun: its thread's, or,
        #: if the start was given up first, nobody's.
        self._handover = threading.Lock()
        self._taken = False

    @property
    def label(self) -> str:
        return self._claim.status.label

    @property
    def status(self) -> str:
        """``waiting``, ``running``, or how it ended: ``ok``, ``error``, ``halted``..."""
        state = self._claim.status
        return state.ending or state.phase if state.phase == "done" else state.phase

    @property
    def granted_at(self) -> float | None:
        """When the queue granted this job its share (``time.time()``), if it has."""
        return self._claim.granted_at

    def done(self) -> bool:
        return self._finished.is_set()

    def result(self, timeout: float | None = None) -> dict[str, object]:
        """Wait for the cell and return the names it bound; raise how it failed."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.label} is still {self.status} after {timeout:g} s")
        if self._error is not None:
            raise self._error
        return dict(self._values)

    def cancel(self) -> bool:
        """Leave the queue, or stop the worker if it is running. False once it has ended."""
        if self.done():
            return False
        return self._claim.cancel("cancelled from its job handle")

    def run(self) -> Outcome:
        """Wait for the share and run the cell in this thread; raise how it failed."""
        try:
            return self._run()
        finally:
            self._finished.set()

    def _run(self) -> Outcome:
        try:
            with self._claim as claimed:
                self._started.set()
                outcome = claimed.run_code(
                    self._code,
                    self._inputs,
                    self._outputs,
                    claimed.telling_of_clears(self._output),
                    if_changed=self._if_changed,
                    random_state=self._random_state,
                )
                # Known before the claim ends, so that its record does not
                # read as a plain success above the error that says which.
                claimed.status.not_back = sorted(outcome.not_brought_back(self._by_hand))
                return outcome
        finally:
            self._inputs.discard()
            self._started.set()

    def start(self) -> Job:
        """Take the claim's place in its queue and run the cell on a thread of its own.

        The handle, at once. A stop landing before it returns leaves nothing
        of the job going on without one: its place in the queue is given
        back, or, once its thread has it, the job is cancelled.
        """
        try:
            self._claim.take_place()
            with _unfinished_lock:
                _unfinished.add(self)
            # Registered again each time so that it runs before anything registered
            # since, such as the worker pool's close: atexit runs the last first.
            atexit.unregister(_end_unfinished_jobs)
            atexit.register(_end_unfinished_jobs)
            thread = threading.Thread(
                target=self._in_the_background, name=f"fluksio-job-{self.label}", daemon=True
            )
            thread.start()
            if self._claim.granted_at is not None:
                # Granted on the spot: what the cell shows is that it runs, not a
                # race between this thread and the job's (cgroups take a moment).
                self._started.wait(STARTS_WITHIN_S)
        except BadClaim:
            raise
        except BaseException as error:
            self._given_up(error)
            raise
        return self

    def _given_up(self, error: BaseException) -> None:
        """Undo a start that did not return its handle, at whatever moment it stopped."""
        with stop_held_back():
            with self._handover:
                taken = self._taken
                self._taken = True
            if taken:
                # Its thread has it, and ends it as any cancelled job ends.
                self.cancel("stopped as the cell that started it was")
                return
            # No thread ever will: one starting now finds it taken, and does nothing.
            self._error = error
            try:
                self._claim.release(error)
            finally:
                self._inputs.discard()
                with _unfinished_lock:
                    _unfinished.discard(self)
                self._started.set()
                self._finished.set()

    def _in_the_background(self) -> None:
        with self._handover:
            if self._taken:
                return  # given up as it started
            self._taken = True
        try:
            outcome = self._run()
            home = self._home
            self._values = outcome.outputs if home is None else each_at_home(outcome.outputs, home)
            warning = outcome.warning(self._by_hand)
            if warning:
                self._output.stderr(warning)
        except RemoteError as error:
            self._error = error
            # One the cell raised was shown as it came, with its output; one
            # with no outcome was raised on the way, and nobody has shown it.
            if error.outcome is None:
                self._output.error(error.ename, error.evalue, error.traceback)
        except BaseException as error:
            self._error = error
            self._output.stderr(f"{type(error).__name__}: {error}\n")
        finally:
            with _unfinished_lock:
                _unfinished.discard(self)
            self._finished.set()

    def __repr__(self) -> str:
        return f"<Job {self.label!r}: {describe(self._claim.status).splitlines()[0]}>"

    def _ipython_display_(self) -> None:
        """Nothing as the ``Out[n]`` of the cell that started it; the job as it is now after.

        That cell's own status display follows the job to its end, and a repr
        beside it would say "waiting" for good. ``_`` is still the handle.
        """
        if not self._shown_by_its_cell:
            self._shown_by_its_cell = True
            return
        from IPython.display import display

        display({"text/plain": repr(self)}, raw=True)


def _end_unfinished_jobs() -> None:
    """As the kernel exits, end its background jobs and let them record how they ended.

    Without this, a job's thread (a daemon) is stopped wherever it is as the
    interpreter finalizes: a running job's worker was killed under it, and
    its usage record written or not by a race; a waiting job left none.
    """
    with _unfinished_lock:
        jobs = list(_unfinished)
    for job in jobs:
        job._claim.cancel("its kernel was shut down")
    deadline = time.monotonic() + ENDS_WITHIN_S
    for job in jobs:
        job._finished.wait(max(0.0, deadline - time.monotonic()))
