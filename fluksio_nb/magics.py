"""``%%claim`` and ``%claims``: the notebook's way in.

A claimed cell should behave as much like a normal cell as a separate process
can. Its output appears in the cell as it happens, its last expression is
shown, the names it reads come in from the kernel and the names it binds go
back, and the stop button stops it. What cannot be hidden is said plainly: a
name that could not travel is reported by name, and a cell that was halted,
timed out or lost its worker says which, in one paragraph.

Bad input is refused before anything waits or starts. A misspelled resource,
an unknown flavor or an input that cannot be sent is a ``UsageError``: one
line, no traceback, no share taken, no worker started.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from fluksio_nb import kernel_room, random_streams, segments, warm_start
from fluksio_nb.claim_line import ClaimLine, claim_parser, parse_claim_line
from fluksio_nb.context import place_to_run
from fluksio_nb.errors import (
    BadClaim,
    ClaimCancelled,
    ClaimHalted,
    ClaimTimeout,
    Interrupted,
    NotBroughtBack,
    RemoteError,
    UnsendableInput,
    WorkerDied,
    typed_as,
)
from fluksio_nb.in_place import into_the_kernels_own
from fluksio_nb.jobs import Job
from fluksio_nb.lifecycle import SHOW_AFTER_S
from fluksio_nb.namespaces import each_at_home, globals_assigned
from fluksio_nb.pickling import global_to_blame
from fluksio_nb.relay import ForegroundOutput, kernels_cell_number
from fluksio_nb.status import StatusView, TextView, can_show_widgets
from fluksio_nb.stop_button import held_once_the_cell_is_over
from fluksio_nb.variables import (
    choose_if_changed,
    choose_inputs,
    choose_outputs,
    names_deleted,
    names_never_rebound,
)
from fluksio_nb.worker.client import Outcome

#: Errors whose message is the whole story: shown as one paragraph, with no
#: traceback through fluksio_nb's own code, which the user did not write.
PLAIN_ERRORS = (
    ClaimHalted,
    WorkerDied,
    ClaimTimeout,
    ClaimCancelled,
    BadClaim,
    NotBroughtBack,
    UnsendableInput,
)


@magics_class
class ClaimMagics(Magics):
    """The magics ``%load_ext fluksio_nb`` registers."""

    @cell_magic
    def claim(self, line: str, cell: str) -> Any:
        try:
            # IPython hands the line with the magic's name and trailing spaces cut off.
            with typed_as(f"%%claim {line}".rstrip()):
                return self._claim(line, cell)
        except Interrupted:
            raise
        except KeyboardInterrupt:
            # Stopped while waiting its turn, or between two steps: shown as
            # one line (_show_claim_error), not through fluksio_nb's frames.
            raise Interrupted() from None

    def _claim(self, line: str, cell: str) -> Any:
        namespace = self.shell.user_ns
        try:
            parsed = parse_claim_line(line)
            inputs, outputs, deleted, if_changed = _names(cell, parsed, namespace)
        except (BadClaim, SyntaxError, ValueError) as error:
            raise _refused(error) from None
        resources = parsed.resources
        if resources.label is None and (number := kernels_cell_number()) is not None:
            # Named as the notebook numbers the cell, which a person can find;
            # the queue would name it by its ticket, which nobody can.
            resources = resources.model_copy(update={"label": f"In[{number}]"})
        place = place_to_run(parsed.on)
        # Packed now, before the claim waits: an input that cannot travel is
        # refused before it takes a place in the queue, and a background cell
        # ships its inputs as they were when it was started.
        packed = place.pack_inputs({name: namespace[name] for name in inputs})
        if packed.failures:
            packed.discard()
            raise UsageError(_unsendable_message(packed.failures, place.reached_as, namespace))
        by_hand = parsed.outputs is not None
        try:
            try:
                # A background claim's status is shown at once, from this thread:
                # it belongs in the cell that started it, which is only the
                # executing one now.
                claimed = place.for_cell(
                    resources,
                    parsed.on,
                    view=new_view(),
                    show_after=None if parsed.background else SHOW_AFTER_S,
                )
                job = Job(
                    claimed,
                    cell,
                    packed,
                    outputs,
                    by_hand=by_hand,
                    if_changed=if_changed,
                    # A background cell's names wait on its handle, for the
                    # namespace it was started from; its output goes to its
                    # cell, and it draws from random streams of its own.
                    home=namespace if parsed.background else None,
                    output=None if parsed.background else ForegroundOutput(),
                    random_state=None if parsed.background else random_streams.capture(),
                )
                if parsed.background:
                    # In the queue, in order, and refused if it can never run,
                    # before the handle returns: a foreground cell does both as it
                    # waits, and shows a refusal as the claim's own error.
                    return job.start()
            except BadClaim as error:
                raise _refused(error) from None
            # Arrays that go into the kernel's own rather than replace it: those a
            # call may have changed, and those the cell changed only through
            # themselves, as `data *= 2` does.
            into_own = if_changed + sorted(names_never_rebound(cell).intersection(inputs))
            # A stop pressed as the cell ends lands once its names are bound.
            with held_once_the_cell_is_over():
                with self._keeping_what_came_back(deleted, into_own):
                    outcome = job.run()
                missing = self._bring_back(outcome, deleted, into_own, by_hand=by_hand)
        except BaseException:
            # Refused, failed or stopped, at any moment: the inputs' shared
            # memory goes with the cell (a job that had them discarded them).
            packed.discard()
            raise
        if missing:
            # After the rest are bound, and as the cell's error: "Run All"
            # stops here, not at a later cell that reads a name not there.
            said = "; ".join(f"{name} ({why})" for name, why in sorted(missing.items()))
            if any(why.startswith(kernel_room.TOO_BIG) for why in missing.values()):
                what_to_do = kernel_room.WHAT_TO_DO
            else:
                what_to_do = (
                    "A name only the cell needs can be deleted at its end "
                    "(del), or --out can name the ones to bring back."
                )
            raise NotBroughtBack(
                f"the cell ran, but {'this name' if len(missing) == 1 else 'these names'} "
                f"did not come back to the kernel: {said}. Everything else it bound is "
                f"in the kernel. {what_to_do}"
            )
        return None

    @contextlib.contextmanager
    def _keeping_what_came_back(
        self, deleted: frozenset[str], into_own: list[str]
    ) -> Iterator[None]:
        """On the cell's error or the stop button, bind what it had bound, then raise.

        A normal cell that raises halfway through a training loop leaves the
        losses it appended and the model it fitted so far; so does this one.
        """
        try:
            yield
        except RemoteError as error:
            if error.outcome is not None:
                self._bring_back(error.outcome, deleted, into_own, by_hand=False)
                # Beside the cell's own error, which is what is raised.
                sys.stderr.write(error.outcome.warning(by_hand=False))
            raise
        except Interrupted as stopped:
            if stopped.outcome is not None:
                self._bring_back(stopped.outcome, deleted, into_own, by_hand=False)
                sys.stderr.write(stopped.outcome.warning(by_hand=False))
            raise

    def _bring_back(
        self, outcome: Outcome, deleted: frozenset[str], into_own: list[str], by_hand: bool
    ) -> dict[str, str]:
        """Bind what the cell made, drop what it deleted; what did not come back, and why.

        An array of ``into_own`` goes into the kernel's own, as in a normal cell.
        """
        namespace = self.shell.user_ns
        values = into_the_kernels_own(outcome.outputs, into_own, namespace)
        namespace.update(each_at_home(values, namespace))
        random_streams.restore(outcome.random_state)
        # A name the cell deleted is gone after it, as after a normal cell.
        for name in deleted.intersection(outcome.absent):
            namespace.pop(name, None)
        return outcome.not_brought_back(by_hand)

    @line_magic
    def claims(self, line: str = "") -> Any:
        """Show the machine: totals, free, the queue and the running claims."""
        # IPython hands a line magic its trailing comment too: `%claims  # the machine`.
        given = line.partition("#")[0].strip()
        if given:
            raise UsageError(
                f"%claims takes no arguments, and was given {given!r}: it shows the "
                "whole machine. `fluksio-nb` in a terminal prints the same."
            )
        if can_show_widgets():
            from fluksio_nb.widget import monitor

            return monitor()
        from fluksio_nb.overview import describe_monitor, kernel_snapshot, ray_now

        print(describe_monitor(kernel_snapshot(), ray_now()))
        return None


ClaimMagics.claim.__doc__ = claim_parser().format_help()


def _refused(error: Exception) -> UsageError:
    """A refusal of the line, said as every other: starting ``%%claim:``."""
    said = str(error)
    return UsageError(said if said.startswith("%%claim") else f"%%claim: {said}")


def _names(
    cell: str, parsed: ClaimLine, namespace: dict[str, Any]
) -> tuple[list[str], list[str], frozenset[str], list[str]]:
    """What travels: the inputs, the outputs, the names it deletes, the inputs it may change."""
    inputs = choose_inputs(cell, namespace, parsed.inputs)
    outputs = choose_outputs(cell, parsed.outputs)
    if parsed.outputs is not None:
        return inputs, outputs, frozenset(), []
    # `bump()` binds nothing the source shows; a `global` in bump does.
    assigned = globals_assigned((namespace[name] for name in inputs), namespace)
    outputs += sorted(assigned.difference(outputs))
    # Asked for too, so that the worker says whether each is gone: a `del`
    # on a branch not taken leaves the name where it was.
    deleted = names_deleted(cell)
    outputs += sorted(deleted.difference(outputs))
    return inputs, outputs, deleted, choose_if_changed(cell, inputs, outputs)


def _unsendable_message(failures: dict[str, str], to: str, namespace: dict[str, Any]) -> str:
    said = []
    for name, reason in sorted(failures.items()):
        # A notebook function goes with the globals it reads: the one to fix is
        # the global, which the function's own error does not name.
        blamed = global_to_blame(namespace.get(name))
        if blamed is not None:
            reason = f"it reads the global '{blamed[0]}', which cannot travel: {blamed[1]}"
        said.append(f"'{name}' ({reason})")
    return (
        f"%%claim: cannot send {', '.join(said)} to {to}. Create it inside the cell, "
        "or leave it out with --in."
    )


def new_view() -> StatusView:
    """The view a claimed cell draws its status with: the live widget where it can be drawn."""
    if can_show_widgets():
        from fluksio_nb.widget import WidgetView

        return WidgetView()
    return TextView()


def _show_claim_error(shell, kind, error, traceback, tb_offset=None):
    """Show a claimed cell's failure as the user needs to read it."""
    if isinstance(error, Interrupted):
        # The interrupt it is, at the user's line where the worker said where;
        # never through fluksio_nb's frames, which the user did not write.
        said = error.outcome.error if error.outcome is not None else None
        if said is not None and said.ename == "KeyboardInterrupt" and said.traceback:
            stb = list(said.traceback)
        else:
            stb = ["\x1b[0;31mKeyboardInterrupt\x1b[0m: the cell was stopped"]
        shell._showtraceback(KeyboardInterrupt, KeyboardInterrupt(), stb)
    elif isinstance(error, RemoteError):
        # The cell's own exception name, not ours: the front end shows the
        # error's name, and "ValueError" is what the user raised.
        stb = (error.traceback or [str(error)]) + _unsent_name_hint(error, shell.user_ns)
        shell._showtraceback(type(error.ename, (Exception,), {}), error.evalue, stb)
    else:
        stb = [f"\x1b[0;31m{kind.__name__}\x1b[0m: {error}"]
        shell._showtraceback(kind, error, stb)
    return stb


def _unsent_name_hint(error: RemoteError, namespace: dict[str, Any]) -> list[str]:
    """Why a name the kernel has was not defined in the cell, and what to do: or nothing.

    The cell's inputs are the names its source reads, and a name read only
    through ``eval("x")`` or ``globals()["x"]`` is not among them.
    """
    missing = re.fullmatch(r"name '(\w+)' is not defined", error.evalue or "")
    if error.ename != "NameError" or missing is None or missing.group(1) not in namespace:
        return []
    name = missing.group(1)
    return [
        f"fluksio_nb: '{name}' is in the kernel, but was not sent: the cell's source does not "
        "read it by name (an eval, a globals() lookup?). Name it with --in, with every other "
        "name the cell reads, as --in replaces the names worked out from the source."
    ]


def load_ipython_extension(shell) -> None:
    # Shared-memory files of kernels that died mid-transfer would otherwise
    # hold their memory until the machine reboots.
    segments.sweep_orphans()
    shell.register_magics(ClaimMagics)
    shell.set_custom_exc((RemoteError, Interrupted, *PLAIN_ERRORS), _show_claim_error)
    warm_start.begin(_prepare_the_view)


def _prepare_the_view() -> None:
    """Import what a claimed cell's view is drawn with: 175 ms of a first claim's, measured."""
    if can_show_widgets():
        import fluksio_nb.widget  # noqa: F401


def unload_ipython_extension(shell) -> None:
    shell.set_custom_exc((), None)
