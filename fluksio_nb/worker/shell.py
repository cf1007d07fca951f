"""The worker's IPython: a cell behaves as in the notebook, and what it shows goes to the kernel.

A claimed cell runs in a real IPython ``InteractiveShell``, so that magics,
``!cmd``, ``display()`` and ``%matplotlib inline`` behave as they do in the
kernel. This module bends that shell to a process with no notebook of its own,
and decides:

- **What a notebook would show is sent, not printed**, as the messages of
  :mod:`fluksio_nb.worker.messages`: display data, the last expression's value
  as the cell's result, an exception as IPython formats it, and the prompt of
  an ``input()``, which waits for the kernel's answer (:func:`ask_the_notebook`).
- **Python's output is messages; everything else's is the pipe.** ``print``
  goes through :mod:`fluksio_nb.worker.streams` as messages on the same
  channel as ``display``, so the two arrive in the order the cell made them.
- **SIGINT stops the cell, never the worker** (:class:`Interrupts`). It raises
  ``KeyboardInterrupt`` only while a cell's code runs; while the worker is
  idle, it is an interrupt that arrived after its cell ended and is dropped;
  while a frame is on its way out, it waits until the frame is whole, because
  a half-written frame would leave the kernel unable to find the next one.
  A stop the main thread took no notice of, because it arrived just as the
  cell went to sleep, is made to land by waking that thread.
- **A worker that lives for many cells holds on to none of them**: no
  history, no output cache, no copy of what a cell printed. It remembers
  only how IPython rewrote the last few cells' text (:class:`RememberedTransforms`).
"""

from __future__ import annotations

import _signal
import contextlib
import ctypes
import functools
import importlib.util
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from IPython.core.alias import AliasManager
from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from fluksio_nb.worker.messages import (
    ClearOutput,
    Display,
    Error,
    FromWorker,
    InputReply,
    InputRequest,
    Result,
)
from fluksio_nb.worker.protocol import Channel
from fluksio_nb.worker.streams import FrameStream, Outbox, flush_streams

#: What a cell that awaits at top level must contain.
_MAY_AWAIT = re.compile(r"\b(await|async)\b")


# -----------------------------------------------------------------------------
# What SIGINT means right now
# -----------------------------------------------------------------------------


class Interrupts:
    """Turns SIGINT into ``KeyboardInterrupt`` only where that is safe.

    The client signals the worker's whole process group, so the signal can
    land at any moment: before a cell starts, halfway through a frame, or
    after the cell ended. While the cell's own code runs, Python's default
    handler is in place: it raises from C, so the traceback the user sees ends
    on their line rather than in here. Everywhere else, this object decides.
    A stop the main thread missed is made to land by a thread of its own
    (:meth:`_wake_the_cell_if_unheard`).
    """

    def __init__(self) -> None:
        self._in_cell = False
        self._held_back = False
        self._cells = 0
        self._wakeup = -1

    def install(self) -> None:
        # Inherited blocked, as from a Ray task's process, SIGINT would never
        # arrive: every stop would end the worker with SIGTERM, and the cell's
        # names with it. Unblocked first, so that the threads started here,
        # and the processes the cell starts, take it too.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, NUDGE})
        signal.signal(signal.SIGINT, self._outside_user_code)
        signal.signal(NUDGE, _only_wake)
        taken, self._wakeup = os.pipe()
        os.set_blocking(self._wakeup, False)
        signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        threading.Thread(
            target=self._wake_the_cell_if_unheard, args=(taken,), name="fluksio-stop", daemon=True
        ).start()

    @contextlib.contextmanager
    def cell_running(self) -> Iterator[None]:
        self._in_cell, self._held_back = True, False
        self._cells += 1
        self._hear_signals_again()
        # The C module's calls, as in frame_in_flight: once each way per cell.
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        try:
            yield
        finally:
            _signal.signal(_signal.SIGINT, self._outside_user_code)
            self._in_cell = False

    @contextlib.contextmanager
    def frame_in_flight(self, deliver_held_back: bool = True) -> Iterator[None]:
        # Signals are only delivered to, and handlers only changed from, the
        # main thread: a frame a cell's own thread sends cannot be cut short.
        if not self._in_cell or threading.current_thread() is not threading.main_thread():
            yield
            return
        # The C module's calls, not signal's wrappers around them: these run
        # for every frame a cell sends, and the wrappers' enum conversions
        # cost 18 µs a frame against 1.2.
        during_the_cell = _signal.getsignal(_signal.SIGINT)
        _signal.signal(_signal.SIGINT, self._outside_user_code)
        try:
            yield
        finally:
            _signal.signal(_signal.SIGINT, during_the_cell)
        if self._held_back:
            self._held_back = False
            # Sent again rather than turned into KeyboardInterrupt here, so
            # that whatever the cell set for SIGINT — ignore it, or a handler
            # that stops a training loop gently — is what answers it. Sent to
            # the process, as the kernel sent it: raised at this thread alone,
            # it would wait for good in a main thread that blocks SIGINT.
            if deliver_held_back:
                os.kill(os.getpid(), signal.SIGINT)

    def _outside_user_code(self, signum: int, frame: Any) -> None:
        # Outside a cell there is nothing to stop: the interrupt arrived after
        # its cell had already ended, and is dropped.
        if self._in_cell:
            self._held_back = True

    def _wake_the_cell_if_unheard(self, taken: int) -> None:
        """Wake the main thread when a stop may have reached it as it went to sleep.

        CPython's C handler only flags a signal; the main thread acts on the
        flag between bytecodes, or when a blocking call returns EINTR. A SIGINT
        that lands after its last look and before ``time.sleep`` enters the
        kernel — or one another thread of the cell took — is acted on only
        when the sleep ends: the cell sleeps on, and the kernel ends the worker
        as deaf. From outside, that looks just like a cleanup that sleeps, so
        the kernel cannot tell them apart; in here, every signal Python takes
        writes its number to the wakeup pipe, which this thread reads.

        The nudge interrupts whatever call the main thread is blocked in.
        Python then runs every handler due, the SIGINT's first if it was
        missed, and retries the call if nothing raised: a cleanup that was
        sleeping sleeps on.
        """
        # Any thread may take a signal sent to the process; this one must not,
        # or it would only flag the stop, never wake anyone.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, NUDGE})
        main_thread = threading.main_thread().ident
        assert main_thread is not None
        while True:
            if signal.SIGINT not in os.read(taken, 64) or not self._in_cell:
                continue
            cell = self._cells
            time.sleep(NUDGE_AFTER_SECONDS)
            if self._in_cell and self._cells == cell:
                signal.pthread_kill(main_thread, NUDGE)

    def _hear_signals_again(self) -> None:
        # A cell's asyncio loop that added and then removed signal handlers
        # sets the wakeup fd to -1 as it goes. One that still holds it keeps
        # it: its handlers would stop working otherwise.
        before = _signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        if before not in (-1, self._wakeup):
            _signal.set_wakeup_fd(before)


#: What wakes a main thread that did not act on a stop. SIGURG, because
#: nothing a cell is likely to run uses it, and by default it is ignored, so a
#: cell that resets every handler cannot be killed by it.
NUDGE = signal.SIGURG
#: How long a stop goes unanswered before the main thread is woken to answer it.
#: A cell that is running Python answers within microseconds.
NUDGE_AFTER_SECONDS = 0.05


def _only_wake(signum: int, frame: Any) -> None:
    """The nudge's handler: its delivery has already broken the blocking call."""


# -----------------------------------------------------------------------------
# The shell: IPython, with everything it would print sent as messages
# -----------------------------------------------------------------------------


class Reporter:
    """Sends messages to the kernel, whole, with Python's own output sent ahead of them."""

    def __init__(self, channel: Channel, interrupts: Interrupts) -> None:
        self.channel = channel
        self.interrupts = interrupts

    def __call__(
        self,
        message: FromWorker,
        deliver_held_back: bool = True,
        flush_first: bool = True,
    ) -> None:
        if flush_first:
            flush_streams()
        with self.interrupts.frame_in_flight(deliver_held_back):
            self.channel.send(message)


class FramePublisher(DisplayPublisher):
    """``display()`` and friends, sent to the kernel as they happen."""

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kw):
        # Display ids are carried for the kernel to honour; nothing here depends on them.
        self.shell.report(Display(data, metadata or {}, transient or None, bool(update)))

    def clear_output(self, wait=False):
        self.shell.report(ClearOutput(wait))


class ResultHook(DisplayHook):
    """The last expression's value, sent as the cell's result instead of ``Out[n]``."""

    def write_output_prompt(self):
        pass

    def write_format_data(self, format_dict, md_dict=None):
        self.shell.report(Result(format_dict, md_dict or {}))

    def log_output(self, format_dict):
        # IPython keeps every result's reprs in its history; a worker that lives
        # for many cells would keep every image it ever returned.
        pass

    def finish_displayhook(self):
        self._is_active = False


class SteadyAliases(AliasManager):
    """IPython's aliases, made again after a cell only where the cell changed them.

    ``InteractiveShell.reset``, which empties the worker after every cell,
    takes every alias down and makes each again: two thirds of the reset's
    time. Only ``%alias``, ``%unalias`` and the like change them, and a cell
    that left the line magics as the last reset did has nothing to put back.
    """

    #: The line magics as the last reset left them.
    _as_left: dict[str, Any] | None = None
    _unchanged = False

    def clear_aliases(self) -> None:
        self._unchanged = self._as_left is not None and self.linemagics == self._as_left
        if not self._unchanged:
            super().clear_aliases()

    def init_aliases(self) -> None:
        if not self._unchanged:
            super().init_aliases()
        self._unchanged = False

    def reset_done(self) -> None:
        self._as_left = dict(self.linemagics)


class WorkerShell(InteractiveShell):
    """An ``InteractiveShell`` whose tracebacks go to the kernel as :class:`Error` messages."""

    report: Reporter
    #: Python's stdout and stderr as frames; put back before every cell, in
    #: case the last one replaced them and never restored them.
    streams: tuple[FrameStream, FrameStream]

    def init_alias(self):
        self.alias_manager = SteadyAliases(shell=self, parent=self)
        self.configurables.append(self.alias_manager)

    def reset(self, new_session=True, aggressive=False):
        super().reset(new_session, aggressive)
        self.alias_manager.reset_done()

    def _get_exc_info(self, exc_tuple=None):
        etype, value, tb = super()._get_exc_info(exc_tuple)
        return etype, value, without_our_last_frames(tb)

    def _showtraceback(self, etype, evalue, stb):
        # The cell is already ending in an error; a held-back interrupt would
        # only end it a second time.
        self.report(
            Error(getattr(etype, "__name__", str(etype)), str(evalue), list(stb)),
            deliver_held_back=False,
        )

    def ask_exit(self):
        # `exit()` in a kernel's cell ends the kernel; in a claimed cell, the
        # worker: after this cell, and its claim gets a fresh one next time.
        self.exit_now = True

    def show_usage_error(self, exc):
        # A mistyped magic is an error like any other, and a notebook should
        # show it as one, not as a stray line on stderr.
        self.report(
            Error("UsageError", str(exc), [f"UsageError: {exc}"]),
            deliver_held_back=False,
        )

    def enable_gui(self, gui=None):
        # Called by %matplotlib for every backend; None (IPython 9) or "inline"
        # (IPython 8) for the ones that draw without a window, which need no
        # event loop at all.
        if gui not in (None, "inline"):
            raise UsageError(
                f"a worker has no screen to open a {gui} window on — "
                "use %matplotlib inline to see figures under the cell"
            )

    def should_run_async(self, raw_cell, *, transformed_cell=None, preprocessing_exc_tuple=None):
        # IPython compiles every cell once more just to learn whether it awaits
        # at top level, which only a cell with `await` or `async` in it can: in
        # a worker that sat idle 100 ms, that compile was a quarter of `x = 1`.
        if transformed_cell is not None and not _MAY_AWAIT.search(transformed_cell):
            return False
        return super().should_run_async(
            raw_cell,
            transformed_cell=transformed_cell,
            preprocessing_exc_tuple=preprocessing_exc_tuple,
        )

    @contextlib.contextmanager
    def _tee(self, channel):
        # IPython 9 copies everything a cell prints into its history. A training
        # loop printing for a day would keep the whole day in the worker's memory.
        yield


class RememberedTransforms:
    """IPython's rewriting of a cell's text (``%magic``, ``!cmd``, ``?``), done once per text.

    A notebook runs the same claimed cells again and again, and the rewrite
    is a pure function of the text: tokenizing it again was an eighth of a
    warm worker's time on ``x = 1`` after a pause (120 of 1020 µs, side by side).
    Only IPython's own transforms are remembered; once a cell has added or
    removed one, every cell is rewritten afresh, since a transform of the
    user's may count or log what it sees. What depends on the namespace
    (a bare ``ls`` becoming ``%ls``) is IPython's later, dynamic step, which
    still runs every time.
    """

    #: Cells whose rewrite is kept; the one run longest ago goes first.
    SIZE = 64

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self._transform = manager.transform_cell
        self._ipythons = self._transforms()
        self._remembered = functools.lru_cache(maxsize=self.SIZE)(self._transform)

    def _transforms(self) -> tuple[Any, ...]:
        manager = self._manager
        # Marked apart, so that a transform moved from one list to the next is a change.
        return (
            *manager.cleanup_transforms,
            None,
            *manager.line_transforms,
            None,
            *manager.token_transformers,
        )

    def __call__(self, cell: str) -> str:
        if self._transforms() != self._ipythons:
            return self._transform(cell)
        return self._remembered(cell)

    @classmethod
    def install(cls, shell: InteractiveShell) -> None:
        manager = shell.input_transformer_manager
        manager.transform_cell = cls(manager)


def make_shell(reporter: Reporter) -> WorkerShell:
    config = Config()
    # A worker's cells are not history anyone will search, and a sqlite file
    # shared with the user's real IPython sessions is a lock to contend for.
    config.HistoryManager.enabled = False
    shell = WorkerShell.instance(
        config=config,
        # The output cache (Out, _1, _2...) holds every result; the namespace
        # is emptied between cells anyway.
        cache_size=0,
        # ipykernel's own scheme, until the kernel says which (use_the_kernels_colors).
        colors="neutral",
        display_pub_class=FramePublisher,
        displayhook_class=ResultHook,
    )
    shell.report = reporter
    RememberedTransforms.install(shell)
    # Stream messages go without flushing the streams first: they are what is flushed.
    outbox = Outbox(functools.partial(reporter, flush_first=False))
    shell.streams = (FrameStream("stdout", 1, outbox), FrameStream("stderr", 2, outbox))
    sys.stdout, sys.stderr = shell.streams
    return shell


#: What IPython's own reset keeps in the namespace: objects' ``__del__`` may need them.
_KEPT_BY_RESET = frozenset({"__builtin__", "__builtins__", "__name__"})


def use_the_kernels_colors(shell: WorkerShell, colors: str | None) -> None:
    """Colour tracebacks as the kernel does, so that they read in the notebook's theme.

    A scheme the worker does not know (one a kernel registered for itself)
    falls back on ipykernel's ``neutral``: a traceback in other colours still
    says what went wrong, a cell that fails on its colours says nothing.
    """
    if colors is None or colors == shell.colors:
        return
    try:
        shell.colors = colors
    except Exception:
        shell.colors = "neutral"


def let_go_of_the_cells_values(shell: WorkerShell) -> None:
    """Drop the namespace's references to what the cell made and was sent, at once.

    The cheap half of :func:`start_fresh`, for the moment the values are
    packed: no garbage collection, only the names, so that every value
    nothing else holds, and the mapping under it, goes now.
    """
    namespace = shell.user_ns
    for name in [name for name in namespace if name not in _KEPT_BY_RESET]:
        del namespace[name]


def start_fresh(shell: WorkerShell) -> None:
    """Empty the namespace a previous cell left behind; keep what was imported."""
    shell.reset(new_session=False)
    sys.stdout, sys.stderr = shell.streams
    history = shell.history_manager
    del history.input_hist_parsed[1:]
    del history.input_hist_raw[1:]
    # A traceback keeps the locals of every frame in it alive.
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None


def ask_the_notebook(channel: Channel, reporter: Reporter) -> None:
    """``input()`` and ``getpass()`` in a cell ask the notebook, as in the kernel itself.

    The worker's stdin is not a terminal nobody watches: a cell that asks
    sends an :class:`InputRequest` and waits for the kernel's answer on the same
    channel, which carries nothing else while a cell runs. Where nobody can
    answer (a background cell, a front end without input) the kernel says
    so, and the cell gets the error ipykernel itself raises.
    """
    import builtins
    import getpass

    def ask(prompt: object = "", password: bool = False) -> str:
        reporter(InputRequest(str(prompt), password))
        while not isinstance(reply := channel.receive(), InputReply):
            pass
        if reply.refused is not None:
            raise StdinNotImplementedError(reply.refused)
        return reply.value

    def ask_secretly(prompt: str = "Password: ", stream: object = None) -> str:
        return ask(prompt, password=True)

    builtins.input = ask
    getpass.getpass = ask_secretly


def default_to_inline_figures() -> None:
    """Figures appear under the cell, as in a kernel, unless the user chose a backend.

    ipykernel makes the same choice for the same reason: a worker has no
    screen, and the alternative is figures silently drawn to nowhere.
    """
    if "MPLBACKEND" not in os.environ and importlib.util.find_spec("matplotlib_inline"):
        os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"


def flush_c_streams() -> None:
    """C code's ``printf`` sits in stdio's buffer, which ``sys.stdout`` cannot reach."""
    global _fflush
    with contextlib.suppress(Exception):
        # Looked up once: opening the C library and finding the function each
        # time took 1.9 ms of a cell in a worker that sat idle, the call 0.5 ms.
        if _fflush is None:
            _fflush = ctypes.CDLL(None).fflush
        _fflush(None)


_fflush: Any = None


#: Where fluksio_nb's own files are: frames there are none of the user's business.
_OUR_FILES = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: The standard library's glue under a ``with`` of ours: a stop held back
#: while a frame went out is raised as that ``with`` ends, inside it.
_GLUE_FILES = (contextlib.__file__,)


def without_our_last_frames(tb: Any) -> Any:
    """``tb`` ending at the user's last frame, not in fluksio_nb's code below it.

    The stop button lands wherever the worker is, and that is often inside
    this package's own stream, which the user's ``print`` called: a traceback
    that went on into it would show the user code they never wrote. Frames of
    ours above the user's are left alone (IPython skips its own), and so is a
    traceback that is all ours, which is a fault of ours worth reading whole.
    """
    frames = []
    walk = tb
    while walk is not None:
        frames.append(walk)
        walk = walk.tb_next
    cut = len(frames)
    while cut > 0 and _ours_or_glue(frames[cut - 1].tb_frame.f_code.co_filename):
        cut -= 1
    if 0 < cut < len(frames) and not all(
        f.tb_frame.f_code.co_filename.startswith(_OUR_FILES) for f in frames[:cut]
    ):
        frames[cut - 1].tb_next = None
    return tb


def _ours_or_glue(filename: str) -> bool:
    return filename.startswith(_OUR_FILES) or filename in _GLUE_FILES


def report_exception_only(shell: WorkerShell, error: BaseException) -> None:
    lines = shell.InteractiveTB.get_exception_only(type(error), error)
    shell._showtraceback(type(error), error, lines)
