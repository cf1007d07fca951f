"""The messages between kernel and worker: they cross the channel as sent, and show as meant.

The worker's own behaviour is tested in ``test_worker.py`` through real
processes; this is the vocabulary both sides share, which the Ray side forwards
as it is.
"""

from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from fluksio_nb.worker.messages import (
    ClearOutput,
    Display,
    Done,
    Error,
    Exit,
    InputReply,
    InputRequest,
    Ready,
    Reshape,
    Reshaped,
    Result,
    Run,
    Sink,
    Stream,
    forwarder,
    relay,
)
from fluksio_nb.worker.protocol import Channel
from tests.stops import said_by

EVERY_MESSAGE = [
    Run("x = 1", outputs=["x"], if_changed=["y"], random_state={"random": 3}, cwd="/tmp"),
    InputReply(value="yes"),
    InputReply(refused="nobody to ask"),
    Exit(),
    Reshape({"OMP_NUM_THREADS": "2"}),
    Ready(1234),
    Stream("stdout", "epoch 1\n"),
    Stream("stderr", "warning\n"),
    Display({"text/plain": "1"}, {}, {"display_id": "a"}, update=True),
    Result({"text/plain": "2"}, {"isolated": True}),
    Error("ZeroDivisionError", "division by zero", ["line 1", "line 2"]),
    ClearOutput(wait=True),
    InputRequest("name? ", password=False),
    Done(True, None, {"f": "cannot pickle"}, ["gone"], {"random": 4}, ["random"], exiting=True),
    Reshaped(),
    Reshaped(refused="libgomp (OpenMP) holds a thread count per thread"),
]


@pytest.fixture
def channel_pair():
    ends = [Channel(end) for end in socket.socketpair()]
    yield ends
    for end in ends:
        end.close()


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda message: type(message).__name__)
def test_every_message_crosses_the_channel_as_it_was_sent(channel_pair, message):
    sending, receiving = channel_pair
    sending.send(message)
    assert receiving.receive() == message


def test_a_big_array_inside_a_message_still_travels_out_of_band():
    """Parcels of variables travel inside Run and Done; their buffers must not be copied in."""
    ours, theirs = socket.socketpair()
    sending = Channel(ours)
    array = np.arange(1_000_000, dtype=np.float64)
    sender = threading.Thread(target=sending.send, args=(Run("b = a", inputs={"a": array}),))
    sender.start()
    body_length, buffer_count = struct.unpack("<QI", theirs.recv(12, socket.MSG_WAITALL))
    assert buffer_count == 1
    assert body_length < 1000
    (buffer_length,) = struct.unpack("<Q", theirs.recv(8, socket.MSG_WAITALL))
    assert buffer_length == array.nbytes
    rest = body_length + buffer_length
    while rest:
        rest -= len(theirs.recv(min(rest, 1 << 20)))
    sender.join()
    sending.close()
    theirs.close()


class Recorder(Sink):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def stdout(self, text):
        self.calls.append(("stdout", text))

    def stderr(self, text):
        self.calls.append(("stderr", text))

    def display(self, data, metadata):
        self.calls.append(("display", data, metadata))

    def result(self, data, metadata):
        self.calls.append(("result", data, metadata))

    def error(self, ename, evalue, traceback):
        self.calls.append(("error", ename, evalue, traceback))

    def clear_output(self, wait):
        self.calls.append(("clear_output", wait))


def test_each_output_reaches_the_sink_method_for_its_kind():
    sink = Recorder()
    for message in [
        Stream("stdout", "out"),
        Stream("stderr", "err"),
        Display({"text/plain": "d"}, {"m": 1}),
        Result({"text/plain": "r"}, {}),
        Error("E", "v", ["tb"]),
        ClearOutput(True),
    ]:
        sink.forward(message)
    assert sink.calls == [
        ("stdout", "out"),
        ("stderr", "err"),
        ("display", {"text/plain": "d"}, {"m": 1}),
        ("result", {"text/plain": "r"}, {}),
        ("error", "E", "v", ["tb"]),
        ("clear_output", True),
    ]


def test_a_message_that_is_not_output_is_refused_rather_than_dropped():
    with pytest.raises(TypeError, match="not output"):
        relay(Done(True), Recorder())


def test_a_sink_that_overrides_forward_gets_the_messages_themselves():
    """What the Ray outbox does: pass the worker's messages on without taking them apart."""

    class Forwarding(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.forwarded: list[object] = []

        def forward(self, message):
            self.forwarded.append(message)

    sink = Forwarding()
    message = Display({"text/plain": "d"}, {})
    sink.forward(message)
    assert sink.forwarded == [message]
    assert sink.calls == []


def test_a_sink_that_is_no_sink_is_shown_through_relay_and_may_lack_clear_output():
    """The notebook's CellOutput sits below the worker, so it has the methods but no forward."""

    class Duck:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def stdout(self, text):
            self.calls.append(("stdout", text))

        def stderr(self, text):
            self.calls.append(("stderr", text))

        def display(self, data, metadata):
            self.calls.append(("display", data))

        def result(self, data, metadata):
            self.calls.append(("result", data))

        def error(self, ename, evalue, traceback):
            self.calls.append(("error", ename))

    duck = Duck()
    show = forwarder(duck)
    show(Stream("stdout", "out"))
    show(ClearOutput(wait=False))
    show(Error("E", "v", []))
    assert duck.calls == [("stdout", "out"), ("error", "E")]
    sink = Recorder()
    assert forwarder(sink) == sink.forward


#: Each round, a frame with an out-of-band buffer arrives in two halves while
#: ``receive`` reads it, and is stopped at one moment of the reading. The frame
#: must come whole, from that receive or the next: a stop that landed as a read
#: returned left its bytes uncounted, and the next frame was read from the
#: middle of this one, its length garbage, waited for ever.
STOP_AT_EVERY_MOMENT_OF_A_RECEIVE = """
import pickle, socket, threading, time
import numpy as np
import fluksio_nb.stop_button
import fluksio_nb.worker.protocol as protocol
from fluksio_nb.worker.messages import Done

ours, theirs = socket.socketpair()
receiving = protocol.Channel(ours)
last = {}

def frame_of(message):
    buffers = []
    body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    views = [buffer.raw() for buffer in buffers]
    header = protocol._PREFIX.pack(len(body), len(views))
    header += b"".join(protocol._BUFFER_LENGTH.pack(view.nbytes) for view in views)
    return header + body + b"".join(bytes(view) for view in views)

def in_two_halves(frame):
    half = len(frame) // 2
    theirs.sendall(frame[:half])
    time.sleep(0.002)
    theirs.sendall(frame[half:])

def attempt(made):
    last["round"] = last.get("round", 0) + 1
    last["sent"] = Done(True, {"n": np.arange(last["round"] * 7)}, {}, [])
    writer = threading.Thread(target=in_two_halves, args=(frame_of(last["sent"]),))
    last["writer"] = writer
    writer.start()
    made["got"] = receiving.receive()

def undo(made):
    last["writer"].join()
    last["got"] = made["got"] if "got" in made else receiving.receive()

def check():
    if receiving.broken:
        return "broken_by_a_stop"
    got, sent = last["got"], last["sent"]
    if got.outputs.keys() != {"n"} or not np.array_equal(got.outputs["n"], sent.outputs["n"]):
        return "a_frame_read_wrong"

each_moment([protocol.__file__, fluksio_nb.stop_button.__file__], attempt, undo, check)
"""


def test_a_stop_at_any_moment_of_a_receive_leaves_the_frame_to_the_next():
    """Guards against the stop button landing as a read from the worker returned: the
    bytes it took went uncounted, and the kernel waited for ever on a frame whose length
    it read from the middle of another, with the worker waiting on it."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_RECEIVE, timeout=100)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 10, said


#: Each round, a frame bigger than the socket's buffer is sent on a fresh pair
#: of sockets while a thread reads the other end slowly, and the send is
#: stopped at one moment. The channel must know what went: the whole frame
#: (``frames_sent``), none of it (usable still), or part (broken). A stop that
#: landed as a write returned left that unknown, and the kernel took a cell the
#: worker was running for one it never had, and left it running for nobody.
STOP_AT_EVERY_MOMENT_OF_A_SEND = """
import socket, threading, time
import fluksio_nb.stop_button
import fluksio_nb.worker.protocol as protocol

last = {}

def read_all(sock, into):
    while chunk := sock.recv(65536):
        into.extend(chunk)
        time.sleep(0.001)

def attempt(made):
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    got = bytearray()
    reader = threading.Thread(target=read_all, args=(theirs, got))
    reader.start()
    last.update(ours=ours, theirs=theirs, got=got, reader=reader, channel=None)
    last["channel"] = channel = protocol.Channel(ours)
    channel.send({"payload": b"x" * 200_000})

def undo(made):
    last["ours"].close()
    last["reader"].join()
    last["theirs"].close()

def check():
    channel, got = last["channel"], bytes(last["got"])
    if channel is None:
        return "sent_without_a_channel" if got else None
    whole = len(got) > 200_000
    if whole and (channel.broken or channel.frames_sent != 1):
        return "a_whole_frame_taken_for_a_broken_one"
    if not got and (channel.broken or channel.frames_sent):
        return "nothing_sent_taken_for_something"
    if got and not whole and not channel.broken:
        return "half_a_frame_left_the_channel_usable"

each_moment([protocol.__file__, fluksio_nb.stop_button.__file__], attempt, undo, check)
"""


def test_a_stop_at_any_moment_of_a_send_leaves_the_channel_knowing_what_went():
    """Guards against the stop button landing as a write to the worker returned: nobody
    knew whether the worker had the cell, so the kernel gave up on a cell that ran, and
    marked the channel broken even when nothing, or everything, had gone."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_SEND, timeout=200)
    assert "stopped_at" in said, said
    assert said["stopped_at"] > 10, said
