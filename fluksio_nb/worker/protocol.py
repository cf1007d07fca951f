"""How the kernel and its worker talk: framed pickles over one socket.

A claimed cell's variables can be arrays of gigabytes, and the same channel
carries a ``print`` every few milliseconds, so the framing has to be cheap for
both. Each frame is a pickle (protocol 5) of one message of
:mod:`fluksio_nb.worker.messages` (the channel itself frames any picklable
object); whatever the pickle hands out of band — numpy arrays, ``bytearray``,
``PickleBuffer`` — travels as its own run of bytes after the pickle, written
from where it already lies in memory with ``sendmsg`` and read into a buffer
allocated once at its final size with ``recv_into``. Nothing is concatenated, so a frame costs one
copy through the kernel whatever its size.

The peer is the same user's own process, started by this package, so unpickling
what it sends extends no trust that running the cell did not already extend.

A peer that goes away — exits, is killed, closes its end — surfaces as
:class:`ChannelClosed` at the next read or write, at a frame boundary or in the
middle of one. Nothing here waits with a timeout: whoever needs to notice a
silent peer watches the socket with a selector and decides for themselves.

A cell's variables travel inside frames as a :class:`fluksio_nb.transfer.Parcel`,
whose big buffers are already in shared memory, so the channel only ever
carries their names.
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
import threading
from typing import Any

from fluksio_nb.stop_button import stop_held_back

#: Body length, then how many out-of-band buffers follow it.
_PREFIX = struct.Struct("<QI")
_BUFFER_LENGTH = struct.Struct("<Q")

#: ``sendmsg`` refuses more iovecs than this in one call on Linux.
_MOST_PARTS_PER_SEND = 1024


class ChannelClosed(ConnectionError):
    """The process at the other end of the channel is gone, or the channel broke."""


class Channel:
    """One end of the kernel–worker socket: whole frames in, whole frames out.

    Sending is safe from several threads, because the worker's own cell may
    display from a thread of its own. Receiving is meant for one thread.

    A frame whose sending was interrupted halfway — a ``KeyboardInterrupt``
    landing inside a big transfer — leaves the stream somewhere no reader can
    find the next frame, so the channel marks itself broken and every later
    call raises :class:`ChannelClosed`, rather than reading garbage as a
    length. A receive the stop interrupted is picked up again by the next.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._broken: str | None = None
        #: The frame being read, as far as it has come, and its object once it is whole.
        self._frame = _Frame()
        self._whole: Any = _MORE
        #: What a read waits on for more bytes: poll has no ceiling on descriptor numbers.
        self._more = select.poll()
        self._more.register(sock, select.POLLIN)
        #: What a write waits on for room in the peer's socket buffer.
        self._room = select.poll()
        self._room.register(sock, select.POLLOUT)
        #: Bytes of the frame being sent that have gone, and are still to go.
        self._gone = self._to_go = 0
        #: How many frames have gone whole: read before a send and after a
        #: stop that landed in it, it says whether the peer has the message.
        self.frames_sent = 0

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        """The channel over a socket inherited as a bare descriptor."""
        return cls(socket.socket(fileno=fd))

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def send(self, message: Any) -> None:
        """Write one frame, blocking until the peer's socket buffer has taken all of it."""
        buffers: list[pickle.PickleBuffer] = []
        body = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        views = [buffer.raw() for buffer in buffers]
        header = _PREFIX.pack(len(body), len(views)) + b"".join(
            _BUFFER_LENGTH.pack(view.nbytes) for view in views
        )
        with self._send_lock:
            self._check_usable()
            try:
                self._send_all([memoryview(header), memoryview(body), *views])
            except OSError as error:
                self._broken = f"sending failed: {error}"
                raise ChannelClosed(f"the other end of the channel is gone ({error})") from error
            except BaseException:
                # Stopped before the first byte went, or as the last one did,
                # the stream is still whole frames.
                if self._gone and self._to_go:
                    self._broken = "a send was interrupted halfway through a frame"
                raise

    def receive(self) -> Any:
        """Read one whole frame, blocking until it has arrived: the object that was sent."""
        message = self.next_message()
        self.taken()
        return message

    def next_message(self) -> Any:
        """The next whole message, which stays the next until :meth:`taken` says it was acted on.

        For a reader the stop button may interrupt between reading a message
        and acting on it: the message is read again, not lost. A stop landing
        while it waits leaves what was read of the frame with the channel, and
        the next call reads on from there.
        """
        self._check_usable()
        try:
            while True:
                # Each read and its count are one step the stop cannot split:
                # landing as a read returned, it left bytes taken that nobody
                # counted, and the next frame was read from the middle of this
                # one, a length of garbage waited for ever. Nothing in here
                # waits, so the stop is late by a read at most.
                with stop_held_back():
                    self._read_on()
                if self._whole is not _MORE:
                    return self._whole
                self._more.poll()
        except ChannelClosed as closed:
            self._broken = str(closed)
            raise
        except OSError as error:
            self._broken = f"receiving failed: {error}"
            raise ChannelClosed(f"the other end of the channel is gone ({error})") from error

    @property
    def has_next(self) -> bool:
        """Whether a whole message is here that was not :meth:`taken`: no need to wait for one."""
        return self._whole is not _MORE

    def taken(self) -> None:
        """The message :meth:`next_message` gave was acted on: the one after is next."""
        self._whole = _MORE

    def _read_on(self) -> None:
        """Read what has arrived of the frame; once it is whole, its object is ``_whole``."""
        frame = self._frame
        if self._whole is not _MORE:
            return
        while (into := frame.unfilled()) is not None:
            try:
                count = self.sock.recv_into(into, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if count == 0:
                where = "between frames" if frame.untouched else "in the middle of a frame"
                raise ChannelClosed(f"the other end of the channel closed it {where}")
            frame.filled(count)
        self._whole = pickle.loads(frame.body, buffers=frame.buffers)
        self._frame = _Frame()

    def close(self) -> None:
        self._broken = self._broken or "this end closed the channel"
        self.sock.close()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ChannelClosed(f"the channel can no longer be used: {self._broken}")

    def _send_all(self, parts: list[memoryview]) -> None:
        pending = [part.cast("B") for part in parts if part.nbytes]
        self._gone, self._to_go = 0, sum(part.nbytes for part in pending)
        first = 0
        while first < len(pending):
            # Each write and its count are one step the stop cannot split, as
            # a read's are: landing as a write returned, it left nobody
            # knowing how much of the frame went, so whether the peer has the
            # message. Nothing in here waits, so the stop is late by a write.
            with stop_held_back():
                try:
                    sent = self.sock.sendmsg(
                        pending[first : first + _MOST_PARTS_PER_SEND], [], socket.MSG_DONTWAIT
                    )
                except BlockingIOError:
                    sent = -1
                else:
                    self._gone += sent
                    self._to_go -= sent
                    if not self._to_go:
                        self._gone = 0
                        self.frames_sent += 1
            if sent < 0:
                self._room.poll()
                continue
            # A partial send stops anywhere, including inside one part.
            while sent:
                head = pending[first]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    first += 1
                else:
                    pending[first] = head[sent:]
                    sent = 0


#: A frame not read whole yet.
_MORE = object()


class _Frame:
    """One frame as it is read: its prefix, its buffers' lengths, its body, its buffers.

    Each part is read into a buffer allocated once at its final size: a
    bytearray, so that out-of-band buffers come back writable (a numpy array
    rebuilt on read-only memory would refuse the cell's first ``+=``).
    """

    def __init__(self) -> None:
        self.prefix = bytearray(_PREFIX.size)
        self.lengths = bytearray()
        self.body = bytearray()
        self.buffers: list[bytearray] = []
        self.untouched = True
        #: The parts still to fill, in order, and how much of the first is.
        self._parts = [self.prefix]
        self._got = 0
        self._stage = 0

    def unfilled(self) -> memoryview | None:
        """Where the next bytes go; None once the frame is whole."""
        while self._parts and self._got == len(self._parts[0]):
            self._parts.pop(0)
            self._got = 0
            if not self._parts:
                self._next_stage()
        return memoryview(self._parts[0])[self._got :] if self._parts else None

    def filled(self, count: int) -> None:
        self._got += count
        self.untouched = False

    def _next_stage(self) -> None:
        # The prefix says how long the lengths and the body are; the lengths,
        # how long each buffer is.
        self._stage += 1
        if self._stage == 1:
            body_length, buffer_count = _PREFIX.unpack(self.prefix)
            self.lengths = bytearray(_BUFFER_LENGTH.size * buffer_count)
            self.body = bytearray(body_length)
            self._parts = [self.lengths, self.body]
        elif self._stage == 2:
            self.buffers = [
                bytearray(length) for (length,) in _BUFFER_LENGTH.iter_unpack(self.lengths)
            ]
            self._parts = list(self.buffers)
