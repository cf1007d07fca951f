"""What the kernel and its worker say to each other, and how an output is shown.

Every frame on the kernel–worker :class:`~fluksio_nb.worker.protocol.Channel`
is one of the messages below. Writing them down as classes, rather than dicts
with a ``"type"``, makes a misspelt field an error where it is made, lets both
sides match on the kind, and gives the Ray side the same vocabulary to forward
instead of a third encoding of its own.

The conversation, one worker and one kernel:

- **The worker starts** and says :class:`Ready`, once.
- **The kernel sends** :class:`Run`, one cell at a time, and nothing else of
  its own while that cell runs except an :class:`InputReply`.
- **While the cell runs**, the worker sends its output as it is made —
  :class:`Stream`, :class:`Display`, :class:`Result`, :class:`Error`,
  :class:`ClearOutput` — in the order the cell made it. What child processes
  and C code write arrives on the worker's stdout and stderr pipes instead,
  live but not ordered against the messages; the kernel shows it as a
  :class:`Stream` too.
- **input() and getpass()** in the cell send an :class:`InputRequest` and
  wait for the one :class:`InputReply` that answers it, which carries either
  the user's answer or why nobody could give one (a background cell, a front
  end without input). A reply that crosses the stop button arrives after its
  cell is over, and the worker drops it.
- **The cell ends with** :class:`Done`, exactly one for each :class:`Run`,
  however the cell ended: error, interrupt, or ``exit()``, which it
  announces, so the kernel never hands the next cell to a worker on its way
  out. The first :class:`Error` of the cell is the one the kernel reports as
  its failure.
- **Between cells, the kernel may send** :class:`Reshape`: another share's
  thread variables for the cells from now on. The worker answers with one
  :class:`Reshaped`, saying that it holds them, or why it cannot
  (:mod:`fluksio_nb.worker.threads`), and then changes nothing.
- **Its results on their way back** are announced with :class:`SendingBack`
  as the cell's code ends, then their size and how much is written with
  :class:`Sending`; results that pack at once (a few numbers) are not.
- **Outputs lent** (``lend_outputs``) are answered, once the kernel has
  mapped them, with :class:`Unpacked`, which the worker takes between cells.
- **The conversation ends** with :class:`Exit` from the kernel between cells,
  with the kernel closing its end, or with the worker dying, which the kernel
  hears as the channel closing, not as a message.
- **A request the worker does not know** is answered with an :class:`Error`
  (``ProtocolError``) rather than ignored.

Stopping a cell is not a message: the kernel signals the worker's process
group (:meth:`fluksio_nb.worker.client.Worker.interrupt`), which works even
while the worker is too busy to read anything.

An output message reaches whoever shows it through :meth:`Sink.forward`,
which by default calls the sink's method for its kind (:func:`relay`), so a
sink that relays the messages further on unchanged — to a Ray task's
outbox — overrides one method rather than five.

A ``print`` in a cell is a message, so messages pickle as cheaply as a class
can: as the class and its fields in order. A frozen dataclass with slots
otherwise pickles through ``dataclasses.fields()`` and unpickles with a
``__setattr__`` per field: about 4 µs each way for a line of output, against
2 to 2.5 µs this way, a little less than a ``NamedTuple`` too. What is left
over the 0.8 µs of the dict this replaced is the class itself, looked up by
name on both sides; next to the rest of a ``print``'s trip to the notebook
it does not show.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fluksio_nb.relay import BACKGROUND_CANNOT_ASK, NoOneToAsk


class _Message:
    """What every message shares: it pickles as its class and its fields, in order."""

    __slots__ = ()
    #: The fields in the order they are declared, as ``@dataclass`` fills it in.
    __match_args__: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return type(self), tuple(map(self.__getattribute__, self.__match_args__))


# -----------------------------------------------------------------------------
# The kernel to the worker
# -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run(_Message):
    """Run one cell; answered by output, then exactly one :class:`Done`."""

    code: str
    #: The cell's inputs as :func:`fluksio_nb.worker.values.pack_inputs` packed
    #: them: a :class:`fluksio_nb.transfer.Parcel`, whose big buffers are in
    #: shared memory already.
    inputs: Any = None
    #: The names to bring back; None brings back every name the cell bound.
    outputs: list[str] | None = None
    #: Write big outputs into files the worker keeps for its next cell's.
    keep_outputs: bool = False
    #: Write big outputs into files the worker keeps, lent to the kernel:
    #: written again only once the kernel has said :class:`Unpacked` and its
    #: arrays on them are gone.
    lend_outputs: bool = False
    #: Inputs to bring back too if the cell changed them in place.
    if_changed: Sequence[str] = ()
    #: The kernel's global random streams, each :data:`fluksio_nb.random_streams.SAME`
    #: where the worker holds it as it is; None when the cell is not told of them.
    random_state: dict[str, Any] | None = None
    #: The whole environment for cells from now on; None when it has not changed.
    environ: dict[str, str] | None = None
    #: The kernel's ``sys.path`` and working directory, which the cell uses too.
    path: list[str] | None = None
    cwd: str | None = None
    #: The kernel's ``In[n]`` for the cell, so that its traceback says
    #: ``Cell In[n]`` as the notebook numbers it; None outside a kernel.
    execution_count: int | None = None
    #: The kernel's IPython colour scheme (``InteractiveShell.colors``), so that
    #: the cell's traceback is coloured for the notebook's theme as the
    #: kernel's own are; None outside a kernel.
    colors: str | None = None


@dataclass(frozen=True, slots=True)
class InputReply(_Message):
    """The answer to an :class:`InputRequest`, or why there is none."""

    value: str | None = None
    #: Set when nobody could answer; the cell's ``input()`` raises with it.
    refused: str | None = None


@dataclass(frozen=True, slots=True)
class Reshape(_Message):
    """Between cells: hold every thread pool to this environment's thread variables.

    Answered by exactly one :class:`Reshaped`. On a yes the worker's
    environment is ``environ`` from then on, as after a :class:`Run` carrying it.
    """

    environ: dict[str, str]


@dataclass(frozen=True, slots=True)
class Unpacked(_Message):
    """The kernel has mapped the outputs the worker lent it (``lend_outputs``).

    Until then the worker may neither write nor let go of their files: the
    kernel's lock on each, which says it still has arrays there, is only
    taken as it maps them.
    """


@dataclass(frozen=True, slots=True)
class Exit(_Message):
    """Exit between cells; sent by :meth:`fluksio_nb.worker.client.Worker.close`."""


# -----------------------------------------------------------------------------
# The worker to the kernel
# -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready(_Message):
    """The worker has started and waits for its first :class:`Run`."""

    pid: int
    #: What it holds in memory, having run no cell: what a fresh worker costs.
    resident_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Stream(_Message):
    """Text the cell wrote to ``sys.stdout`` or ``sys.stderr``."""

    name: Literal["stdout", "stderr"]
    text: str


@dataclass(frozen=True, slots=True)
class Display(_Message):
    """A ``display()``: a MIME bundle and its metadata."""

    data: dict[str, Any]
    metadata: dict[str, Any]
    #: Its ``display_id``, for a display that ``update=True`` later redraws.
    transient: dict[str, Any] | None = None
    update: bool = False


@dataclass(frozen=True, slots=True)
class Result(_Message):
    """The value of the cell's last expression, as a MIME bundle."""

    data: dict[str, Any]
    metadata: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Error(_Message):
    """An exception the cell raised, as IPython formatted it in the worker."""

    ename: str
    evalue: str
    #: Lines with IPython's ANSI colours, as a notebook shows them.
    traceback: list[str]


@dataclass(frozen=True, slots=True)
class ClearOutput(_Message):
    """``clear_output()``: now, or when the next output arrives if ``wait``."""

    wait: bool = False


@dataclass(frozen=True, slots=True)
class InputRequest(_Message):
    """The cell called ``input()`` (or ``getpass()``, with ``password``) and waits."""

    prompt: str
    password: bool = False


@dataclass(frozen=True, slots=True)
class SendingBack(_Message):
    """The cell's code is over and its results are being packed to go back.

    Sent only when there are names to send, so that the kernel can say
    "sending results back" for as long as that takes, and tell the time the
    cell ran from the time its results took; not when every one of them is a
    number or short text (:func:`fluksio_nb.worker.main.packs_at_once`).
    """

    names: int
    #: About how many bytes each name being sent holds
    #: (:func:`fluksio_nb.worker.main.sizes_held`): for a stop during the copy
    #: to name what was being copied.
    sizes: dict[str, int] = field(default_factory=dict)
    #: The worker's own resident peak while the cell's code ran: a stop during
    #: the copy that finds the code itself went past the budget (between two
    #: of the sampler's readings) is still the code's.
    peak_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Sending(_Message):
    """How far the results are on their way back, in bytes of their big buffers.

    Sent once every value is pickled, when what is left is writing their
    buffers into shared memory, with nothing written; then as the writing
    goes, a few times a second at most.
    """

    written: int
    total: int


@dataclass(frozen=True, slots=True)
class Done(_Message):
    """The cell is over, and what it leaves: the last message of every :class:`Run`."""

    #: Whether the cell finished without raising.
    ok: bool
    #: The outputs as the worker packed them (a :class:`fluksio_nb.transfer.Parcel`).
    outputs: Any = None
    #: Output names that cannot go back, with the reason for each.
    failed: dict[str, str] = field(default_factory=dict)
    #: Output names the cell ended without.
    absent: Sequence[str] = ()
    #: The random streams the cell drew from, as it left them.
    random_state: dict[str, Any] | None = None
    #: The names of the random streams the worker holds now.
    streams_held: Sequence[str] = ()
    #: The cell called ``exit()``: the worker ends after this message.
    exiting: bool = False
    #: The most the worker itself held in memory while the cell ran; 0 if unknown.
    peak_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Reshaped(_Message):
    """The answer to a :class:`Reshape`: done, or why not, with nothing changed."""

    refused: str | None = None


#: What a running cell shows, in the order it showed it.
Output = Stream | Display | Result | Error | ClearOutput
#: What the kernel sends.
ToWorker = Run | InputReply | Reshape | Unpacked | Exit
#: What the worker sends.
FromWorker = Ready | Output | InputRequest | SendingBack | Sending | Done | Reshaped
#: Every frame on the channel.
Message = ToWorker | FromWorker


# -----------------------------------------------------------------------------
# Showing output
# -----------------------------------------------------------------------------


class Sink:
    """Where a running cell's output goes; subclass it and override what you show.

    Every method is called from the thread that called
    :meth:`fluksio_nb.worker.client.Worker.run`, while the cell is still
    running, in the order the worker produced the output. Each output arrives
    at :meth:`forward` first, which hands it to the method for its kind; the
    defaults drop everything.

    A sink need not be a ``Sink``: anything with the five methods ``stdout``,
    ``stderr``, ``display``, ``result`` and ``error`` will do, and is shown
    through :func:`relay`. Two more are taken where a sink has them:
    ``clear_output(wait)``, and ``update_display(data, display_id, metadata)``,
    whose sink's ``display`` then takes a ``display_id=`` too. The notebook's
    own, :class:`fluksio_nb.relay.CellOutput`, is one: it sits below the
    worker in the package's layers, so it cannot subclass this.
    """

    def forward(self, message: Output) -> None:
        """Take one output message; override to pass messages on unchanged."""
        relay(message, self)

    def stdout(self, text: str) -> None:
        pass

    def stderr(self, text: str) -> None:
        pass

    def display(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        pass

    def result(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        pass

    def error(self, ename: str, evalue: str, traceback: list[str]) -> None:
        pass

    def clear_output(self, wait: bool) -> None:
        pass

    def input(self, prompt: str, password: bool) -> str:
        """What the user answers to the cell's ``input(prompt)``; raise to refuse."""
        raise NoOneToAsk(BACKGROUND_CANNOT_ASK)


def forwarder(sink: Sink) -> Callable[[Output], None]:
    """Where each output for ``sink`` goes: its ``forward``, or :func:`relay` to it."""
    forward = getattr(sink, "forward", None)
    return forward if forward is not None else functools.partial(relay, sink=sink)


def relay(message: Output, sink: Sink) -> None:
    """Show one output message on ``sink``, through the method for its kind."""
    match message:
        case Stream(name="stderr", text=text):
            sink.stderr(text)
        case Stream(text=text):
            sink.stdout(text)
        case Display(data=data, metadata=metadata, transient=transient, update=update):
            display_id = (transient or {}).get("display_id")
            # Display ids are honoured by a sink that can redraw, whose
            # ``display`` then takes one too; any other shows each anew.
            update_display = getattr(sink, "update_display", None)
            if display_id is None or update_display is None:
                sink.display(data, metadata)
            elif update:
                update_display(data, display_id, metadata)
            else:
                sink.display(data, metadata, display_id=display_id)
        case Result(data=data, metadata=metadata):
            sink.result(data, metadata)
        case Error(ename=ename, evalue=evalue, traceback=traceback):
            sink.error(ename, evalue, traceback)
        case ClearOutput(wait=wait):
            # Not one of the five methods a sink must have; one without it
            # simply keeps the output.
            clear_output = getattr(sink, "clear_output", None)
            if clear_output is not None:
                clear_output(wait)
        case _:
            raise TypeError(f"{message!r} is not output a sink can show")
