"""The cell in flight: what the thread running it and a thread stopping it both know of it.

A cell is run, and its output relayed, by the thread that called
:meth:`~fluksio_nb.worker.client.Worker.run`; it may be stopped from any
other (:meth:`~fluksio_nb.worker.client.Worker.interrupt`), and the stop
ladder (:mod:`fluksio_nb.worker.stopping`) notes on it how far it had to go,
so that a death it caused is told as the ladder's doing, not as a crash. One
:class:`CellInFlight` holds all of that for one cell, made afresh for each,
so that nothing known of one cell is taken for the next one's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fluksio_nb.worker.messages import Output, Reshaped, SendingBack, Sink, forwarder
from fluksio_nb.worker.outcome import CellError, Outcome


@dataclass
class CellInFlight:
    """What is known about the cell in flight, shared with the thread that stops it."""

    sink: Sink
    thread: int = field(default_factory=threading.get_ident)
    ended: threading.Event = field(default_factory=threading.Event)
    #: Whether the worker has the request, so there is a cell over there to stop.
    sent: bool = False
    #: Whether its end has been heard, so there is no longer anything to stop.
    over: bool = False
    interrupted: bool = False
    #: The strongest signal the ladder had to use beyond SIGINT, if any.
    escalated_to: str | None = None
    #: How the cell ended, when its end was heard after an interrupt.
    outcome: Outcome | None = None
    #: The kernel's random streams as they were when the cell was sent.
    streams_sent: dict[str, Any] | None = None
    error: CellError | None = None
    #: Whether its outputs are left packed, for another process to unpack.
    forward: bool = False
    #: Called as the cell's code ends and its results start back, and as they
    #: go, with the bytes written and to write (0 and 0 until known), and
    #: the worker's word that they started back.
    on_sending_back: Callable[[int, int, SendingBack], None] | None = None
    #: That word: the names being sent back, about how much each holds, and
    #: the most the worker held while the code ran.
    sending_back: SendingBack | None = None
    #: When that was (monotonic), if it was.
    sending_since: float | None = None
    #: The bytes copied to send the cell its inputs.
    sent_in_bytes: int = 0
    #: The worker's answer to a :class:`Reshape`, once it has come.
    reshaped: Reshaped | None = None
    #: Where each output message goes: the sink's ``forward``, or relayed to it.
    show: Callable[[Output], None] = field(init=False)

    def __post_init__(self) -> None:
        self.show = forwarder(self.sink)
