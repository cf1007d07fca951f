"""The worker's side: run claimed cells in a process that was born with the share.

``OMP_NUM_THREADS`` and ``CUDA_VISIBLE_DEVICES`` are read once, when a library
is imported, so the only way to give a cell a share of the machine is to run it
in a process that had the share in its environment from birth. This is that
process. It is started by :class:`fluksio_nb.worker.client.Worker` and serves
one cell at a time over a :class:`~fluksio_nb.worker.protocol.Channel`, in the
IPython shell of :mod:`fluksio_nb.worker.shell`.

What it decides:

- **A cell sees the kernel as it is now**, not as it was when the worker
  started: its ``sys.path``, working directory and environment
  (:func:`follow_the_kernel`), its random streams
  (:mod:`fluksio_nb.random_streams`), and the notebook for ``input()``
  (:func:`~fluksio_nb.worker.shell.ask_the_notebook`).
- **Every cell starts from an empty namespace**; only its inputs are put in it.
  A claimed cell is a function of what it was given, so that what it hands back
  cannot depend on which claimed cell ran here before. Modules stay imported,
  so the second ``import torch`` costs nothing.
- **A warm worker may take another share's thread count** between cells, when
  every thread pool loaded in it will hold the new count
  (:mod:`fluksio_nb.worker.threads`); otherwise it keeps the count it has.
- **Every cell ends with one** :class:`~fluksio_nb.worker.messages.Done`,
  however it ended, so the kernel is never left waiting on a cell that is over.
- **The worker never outlives its kernel, nor a cell's processes their cell**
  (:mod:`fluksio_nb.worker.lifetime`): what a cell left running is ended
  after it, and everything below the worker when the kernel goes.

Packing of inputs and outputs happens in exactly two functions,
:func:`unpack_inputs` and :func:`pack_outputs`, so that how values travel can be
changed without touching how cells run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import FunctionType, ModuleType
from typing import Any

import psutil
from IPython.core.interactiveshell import InteractiveShell

from fluksio_nb import claim_cgroups, namespaces, random_streams, transfer
from fluksio_nb.env import GPU_FRACTION_VAR, EnvironMark
from fluksio_nb.variables import EVERY_NAME_BOUND
from fluksio_nb.worker.lifetime import (
    GRACE_S,
    adopt_orphans,
    end_leftovers,
    leave_with_the_kernel,
    sweep_after,
    threads_left,
)
from fluksio_nb.worker.messages import (
    Done,
    Error,
    Exit,
    InputReply,
    Ready,
    Reshape,
    Reshaped,
    Run,
    Sending,
    SendingBack,
    Stream,
    Unpacked,
)
from fluksio_nb.worker.peak import PeakMemory
from fluksio_nb.worker.protocol import Channel, ChannelClosed
from fluksio_nb.worker.shell import (
    Interrupts,
    Reporter,
    WorkerShell,
    ask_the_notebook,
    default_to_inline_figures,
    flush_c_streams,
    let_go_of_the_cells_values,
    make_shell,
    report_exception_only,
    start_fresh,
    use_the_kernels_colors,
)
from fluksio_nb.worker.threads import take_threads

#: Told to a cell that left threads running its code (see :mod:`~.lifetime`).
_THREADS_LEFT = (
    "fluksio_nb: the cell ended with threads still running its code ({names}). They end "
    "with its worker, which leaves after this cell: join them before the cell ends "
    "(thread.join()) to keep what they do.\n"
)

#: How often, at most, the kernel is told how far the results are on their way.
SENDING_REPORT_S = 0.25

#: The variables the worker set in its own environment as it started
#: (``MPLBACKEND``), which the kernel's environment does not carry.
OWN_ENVIRON: dict[str, str] = {}

#: The environment every cell starts with, as the kernel last sent it.
_environ_wanted: dict[str, str] | None = None

#: ``os.environ`` once it was last made :data:`_environ_wanted`: a cell that
#: changed nothing left it unmoved.
_environ_as_left = EnvironMark()


# -----------------------------------------------------------------------------
# What travels: the one place on this side that knows how values are packed
# -----------------------------------------------------------------------------


class UnreadableInput(Exception):
    """An input the kernel sent could not be rebuilt in the worker."""


def unpack_inputs(parcel: Any) -> dict[str, Any]:
    """The cell's inputs, name to value, from what the kernel packed."""
    if parcel is None:
        return {}
    # Remembered, so that a value bound to what came in goes back without a copy.
    values, failed = transfer.unpack(parcel, remember=True)
    if failed:
        name, reason = next(iter(failed.items()))
        raise UnreadableInput(
            f"input '{name}' could not be rebuilt in the worker ({reason}) — "
            "the module that defines it must be importable in the worker too, "
            f"or leave '{name}' out of the cell's inputs"
        )
    return values


def settle_inputs(namespace: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Bind the inputs, with the notebook's functions and classes at home here; what was bound.

    A function the kernel sent reads its globals from this namespace, as it
    read them from the kernel's, and the globals it carried are bound here
    too, unless an input or IPython's own furniture (``In``, ``get_ipython``)
    has the name already. What is returned is everything bound before the
    cell ran, which the cell did not make.
    """
    carried: dict[str, Any] = {}
    for value in inputs.values():
        for name, global_value in namespaces.globals_carried(value, namespace).items():
            if name not in inputs and name not in namespace:
                carried.setdefault(name, global_value)
    bound = namespaces.each_at_home({**carried, **inputs}, namespace)
    namespace.update(bound)
    return bound


def pack_outputs(
    namespace: dict[str, Any],
    names: list[str],
    keep: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Any, dict[str, str], list[str]]:
    """What goes back for ``names``, why each one that cannot go back can't, and the absent
    (a file the cell closed counts as absent).

    ``keep`` writes big values into files this worker keeps, warm for the
    next cell's: a receiver copies them elsewhere at once (a Ray task, into
    the object store), or, the kernel, holds a lock on each for as long as it
    has arrays there. Written unmapped, so they never count in the worker's
    resident memory, and in ``/dev/shm``, so a value with no room there fails
    by name. Otherwise each goes into a new file of its own for the kernel
    to take over. ``progress(written, total)`` is told how the writing goes.

    The writing happens outside the claim's memory cgroup, once every value
    is pickled (:func:`~fluksio_nb.claim_cgroups.copy_back_outside_the_cap`):
    the pages written are the kernel's, not the cell's.
    """
    # A file the cell closed has nothing in it to bring back: as good as absent.
    present = {
        name: namespace[name]
        for name in names
        if name in namespace and not _closed_file(namespace[name])
    }
    absent = [name for name in names if name not in present]
    with claim_cgroups.copy_back_outside_the_cap() as step_out:

        def writing(written: int, total: int) -> None:
            # Told the size once every value is pickled, before a byte is written.
            if total:
                step_out()
            if progress is not None:
                progress(written, total)

        parcel = transfer.pack(
            present,
            refer_back=True,
            reuse=keep,
            unmapped=keep,
            room_in_segment_dir=keep,
            progress=writing,
        )
    return parcel, dict(parcel.failures), absent


#: Values whose packing is over in microseconds: numbers, and text or bytes up
#: to 64 KiB. These types only: a subclass may pickle as slowly as it likes.
_AT_ONCE = frozenset({int, float, complex, bool, type(None), str, bytes})


def packs_at_once(namespace: dict[str, Any], names: list[str]) -> bool:
    """Whether every value named packs in microseconds: no "sending back" to show then.

    Not announcing it spares a message and a kernel wake per cell (``x = 1``, warm).
    """
    return all(
        type(value) in _AT_ONCE and not (isinstance(value, str | bytes) and len(value) > 1 << 16)
        for value in (namespace.get(name) for name in names)
    )


def sizes_held(namespace: dict[str, Any], names: Sequence[str]) -> dict[str, int]:
    """About how many bytes each value named holds, for a stop during the copy back to name."""
    return {name: transfer.size_held(namespace[name]) for name in names if name in namespace}


def telling_the_kernel(shell: WorkerShell) -> Callable[[int, int], None]:
    """A ``progress`` for :func:`pack_outputs` that says how it goes in :class:`Sending` messages.

    The size as soon as it is known, then no more often than
    :data:`SENDING_REPORT_S`: what the kernel shows moves by the second.
    """
    told = 0.0

    def progress(written: int, total: int) -> None:
        nonlocal told
        if not total:
            return  # nothing big: over before anyone could read a size
        now = time.monotonic()
        if written and written < total and now - told < SENDING_REPORT_S:
            return
        told = now
        shell.report(Sending(written, total))

    return progress


#: Outputs lent to the kernel (``lend_outputs``): their files are put back for
#: the next cell's once the kernel has said it mapped them.
_lent: list[Any] = []


def take_back_lent() -> None:
    """Put the files of outputs lent to the kernel back on the shelf, for the next cell's.

    Only once the kernel has them mapped, which it says with :class:`Unpacked`
    or by sending the next request: before that, nothing on a file says it is
    in use, and a shelf trimming its idle files would close one the kernel is
    about to open.
    """
    while _lent:
        _lent.pop().discard()


def names_wanted(
    shell: InteractiveShell, wanted: Sequence[str] | None, inputs: dict[str, Any]
) -> list[str]:
    """The names to send back: those the kernel asked for, or, where it said so, all bound."""
    if wanted is None:
        return names_bound_by_cell(shell, inputs)
    names = [name for name in wanted if name != EVERY_NAME_BOUND]
    if EVERY_NAME_BOUND in wanted:
        names += [name for name in names_bound_by_cell(shell, inputs) if name not in names]
    return names


def names_bound_by_cell(shell: InteractiveShell, inputs: dict[str, Any]) -> list[str]:
    """What the cell made, when the kernel did not say what it wants back.

    A name counts when the cell bound it to something it was not bound to
    before the cell ran: an input the cell only read does not go back, one it
    reassigned does. Modules, ``_private`` names and IPython's own furniture
    (``In``, ``exit``, ``get_ipython``...) never go back, nor a file the cell
    has closed: ``with open(path) as f`` leaves nothing in ``f`` to use.
    """
    furniture = shell.user_ns_hidden
    bound = []
    for name, value in shell.user_ns.items():
        if name.startswith("_") or isinstance(value, ModuleType) or _closed_file(value):
            continue
        if name in furniture and furniture[name] is value:
            continue
        if name in inputs and inputs[name] is value:
            continue
        bound.append(name)
    return bound


def _closed_file(value: Any) -> bool:
    return isinstance(value, io.IOBase) and value.closed


def changed_in_place(
    namespace: dict[str, Any],
    candidates: Iterable[str],
    parcel: Any,
    inputs: dict[str, Any],
) -> list[str]:
    """The inputs among ``candidates`` the cell changed without binding them again.

    The kernel names the inputs a call in the cell may have changed; one that still
    pickles as it came in (``parcel``, unpacked into ``inputs``) stays
    behind, so the kernel keeps its own object.
    """
    sent = parcel.values if parcel is not None else {}
    changed = []
    for name in candidates:
        # Rebound or deleted, it is an output or absent already.
        if name not in sent or name not in inputs or namespace.get(name) is not inputs[name]:
            continue
        value = inputs[name]
        # A module goes back by name, and is the same module either way. A
        # function or class is rebuilt on arrival, so it pickles differently
        # unchanged, and a copy sent back would replace the kernel's own:
        # the kernel's instances would stop being instances of its class.
        # Bytes cannot change in place, and a big one arrives as a copy off
        # its file, which would be taken for a change.
        if isinstance(value, (ModuleType, FunctionType, type)) or type(value) is bytes:
            continue
        if not transfer.unchanged(value, sent[name]):
            changed.append(name)
    return changed


# -----------------------------------------------------------------------------
# One cell
# -----------------------------------------------------------------------------


_peak = PeakMemory()


def run_one_cell(shell: WorkerShell, request: Run, interrupts: Interrupts) -> None:
    """Run one cell and answer with exactly one :class:`Done`, however it ends."""
    _peak.start()
    ok = False
    inputs: dict[str, Any] = {}
    given = request.random_state
    streams_before: dict[str, Any] = {}
    try:
        use_the_kernels_colors(shell, request.colors)
        follow_the_kernel(request.path, request.cwd, request.environ)
        if given is not None:
            streams_before = random_streams.arrive(given)
        inputs = settle_inputs(shell.user_ns, unpack_inputs(request.inputs))
    except Exception as error:
        report_exception_only(shell, error)
    else:
        try:
            hold_torch_to_the_card_budget()
            if request.execution_count is not None:
                # Its traceback then says "Cell In[n]" as the notebook numbers the cell.
                shell.execution_count = request.execution_count
            with interrupts.cell_running():
                ok = shell.run_cell(request.code, store_history=True).success
        except (KeyboardInterrupt, Exception) as escaped:
            # Raised in IPython's own machinery around the cell's code rather
            # than in the code itself — typically an interrupt landing just
            # before or after it — so nothing has reported it yet.
            report_exception_only(shell, escaped)
    # Again after: the cell that first touched a card is the one that started torch's CUDA.
    hold_torch_to_the_card_budget()
    if left := threads_left(shell.user_ns):
        shell.exit_now = True
        shell.report(Stream("stderr", _THREADS_LEFT.format(names=", ".join(left))))
    drawn, held = random_streams.drawn_since(streams_before, given)
    random_streams.forget_pending()
    names = names_wanted(shell, request.outputs, inputs)
    names += changed_in_place(shell.user_ns, request.if_changed, request.inputs, inputs)
    keep = request.keep_outputs
    # A worker on its way out would take its kept files with it before the
    # kernel had mapped them.
    lend = request.lend_outputs and not shell.exit_now
    if names and not packs_at_once(shell.user_ns, names):
        shell.report(SendingBack(len(names), sizes_held(shell.user_ns, names), _peak.bytes()))
    outputs, failed, absent = pack_outputs(
        shell.user_ns, names, keep or lend, progress=telling_the_kernel(shell) if names else None
    )
    # Everything that goes back is packed: the cell's values, and the inputs
    # mapped under them, go before the kernel is told, so that by the time
    # it has bound the names this worker holds nothing of the cell's, and the
    # kernel's next parcel finds the files it sent free to write into.
    inputs.clear()
    let_go_of_the_cells_values(shell)
    flush_c_streams()
    shell.report(
        Done(
            ok,
            outputs,
            failed,
            absent,
            random_state=drawn,
            streams_held=held,
            # Said here, so the kernel never hands the next cell to a worker on its way out.
            exiting=shell.exit_now,
            peak_bytes=_peak.bytes(),
        )
    )
    if keep:
        # Every file in it is kept, and back on the shelf only for the next
        # cell's outputs, which come after the receiver has mapped these:
        # it holds a shared lock on each for as long as it has them mapped.
        outputs.discard()
    elif lend:
        _lent.append(outputs)
    # Emptied now rather than when the next cell comes: an idle worker then
    # holds none of the last cell's data, the arrays it was sent stop
    # pinning the kernel's shared memory, and the next cell does not wait
    # for the reset (a few milliseconds, most of it a garbage collection).
    start_fresh(shell)


def hold_torch_to_the_card_budget() -> None:
    """torch's own cap on each card, at the claim's ``gpu_ram=``, once torch is using a card.

    Only once its CUDA is initialised: setting the cap initialises it, and a
    cell that imported torch for the CPU would be handed a context on a card
    for nothing. The cap then holds every later allocation at once; the
    sampler holds the rest, including the allocations made before it.
    """
    # torch first, twice a cell: a read of os.environ costs 30 µs after a pause.
    torch = sys.modules.get("torch")
    if torch is None or not (fraction := os.environ.get(GPU_FRACTION_VAR)):
        return
    try:
        if not torch.cuda.is_initialized():
            return
        for device in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(float(fraction), device)
    except Exception:
        # A torch built without CUDA, or of a shape this does not know: the
        # sampler still holds the budget, and the cell must not fail for it.
        return


def follow_the_kernel(
    path: list[str] | None, cwd: str | None, environ: dict[str, str] | None = None
) -> None:
    """Import from where the kernel imports, open files where it opens them, see its variables.

    A function the kernel imported from ``mymodule`` travels by reference and
    is imported again here, which only works with the kernel's ``sys.path``;
    and ``open("data.csv")`` in a claimed cell means the kernel's ``%cd``, not
    wherever the worker happened to start.

    ``environ`` is what the worker's environment should be now, sent when it
    changed: the kernel's as it is now, with the share's variables on top. A
    warm worker was started long ago, and ``os.environ["HF_TOKEN"] = ...`` or
    ``%env`` in the kernel since then must reach the cell, as it would reach a
    normal one. What an earlier claimed cell set here goes, whether or not
    the kernel's changed, so that no cell depends on which ran here before.
    The variables the worker set for itself at start (:data:`OWN_ENVIRON`)
    stay, unless the kernel sets them too.
    """
    global _environ_wanted
    if path is not None and sys.path[: len(path)] != path:
        sys.path[:] = [*path, *(entry for entry in sys.path if entry not in path)]
    if cwd is not None and cwd != os.getcwd():
        os.chdir(cwd)
    if environ is not None:
        _environ_wanted = {**OWN_ENVIRON, **environ}
        _environ_as_left.forget()
    wanted = _environ_wanted
    # Comparing os.environ itself was a millisecond of a cell in a worker
    # that sat idle.
    if wanted is None or _environ_as_left.unmoved():
        return
    if os.environ != wanted:
        for name in [name for name in os.environ if name not in wanted]:
            del os.environ[name]
        for name, value in wanted.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
    _environ_as_left.mark()


def reshape(environ: dict[str, str]) -> str | None:
    """Take another share's thread variables, if every pool here will hold them; why not if not."""
    try:
        refused = take_threads(environ)
    except Exception as error:
        # threadpoolctl failing to read a library is a worker nobody can vouch
        # for at the new count: the claim gets a fresh one instead.
        refused = f"its thread pools could not be read ({type(error).__name__}: {error})"
    if refused is None:
        follow_the_kernel(None, None, environ)
    return refused


def _resident_bytes() -> int:
    try:
        return psutil.Process().memory_info().rss
    except psutil.Error:
        return 0


def serve(channel: Channel, shell: WorkerShell, interrupts: Interrupts) -> bool:
    """Answer requests until the kernel says exit (True) or stops listening (False)."""
    shell.report(Ready(os.getpid(), _resident_bytes()))
    while True:
        try:
            request = channel.receive()
        except ChannelClosed:
            return False
        # Whatever the kernel sends after a cell, it has unpacked that cell's outputs.
        take_back_lent()
        match request:
            case Exit():
                return True
            case Unpacked():
                continue
            case Run():
                run_one_cell(shell, request, interrupts)
                if shell.exit_now:
                    return True
                end_leftovers()
            case Reshape(environ=environ):
                shell.report(Reshaped(reshape(environ)))
            case InputReply():
                # An answer that crossed the stop button on its way: its cell is over.
                continue
            case _:
                kind = type(request).__name__
                shell.report(
                    Error("ProtocolError", f"the worker does not know requests of type {kind}", [])
                )


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fluksio_nb.worker",
        description="Run claimed notebook cells for a kernel. Started by the kernel, not by hand.",
    )
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    parser.add_argument("--kernel-pid", type=int, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    interrupts = Interrupts()
    interrupts.install()
    # Inherited on purpose from the kernel, but a cell's `os.system("... &")`
    # must not inherit them in turn: a child holding the channel would keep
    # the kernel from ever seeing this worker die.
    for fd in (arguments.channel_fd, arguments.lifeline_fd):
        os.set_inheritable(fd, False)
    adopt_orphans()
    leave_with_the_kernel(arguments.lifeline_fd, arguments.kernel_pid)
    channel = Channel.from_fd(arguments.channel_fd)
    started_with = dict(os.environ)
    default_to_inline_figures()
    OWN_ENVIRON.update(
        {name: value for name, value in os.environ.items() if started_with.get(name) != value}
    )
    # Until the kernel's environment changes, every cell starts with this one.
    global _environ_wanted
    _environ_wanted = dict(os.environ)
    reporter = Reporter(channel, interrupts)
    shell = make_shell(reporter)
    ask_the_notebook(channel, reporter)
    # The kernel closing the channel is how a conversation ends, not an error.
    told_to_exit = False
    with contextlib.suppress(ChannelClosed):
        told_to_exit = serve(channel, shell, interrupts)
    if not told_to_exit:
        sweep_after(arguments.kernel_pid)
    # A cell cut short by the kernel's going leaves its processes to nobody else.
    end_leftovers(grace_s=GRACE_S if told_to_exit else 0)
    # Whatever atexit handlers print is for the pipe: nobody reads frames now.
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        # A cell's thread that is not a daemon would hold the interpreter's exit.
        sys.stdout.flush()
        os._exit(0)
    return 0
