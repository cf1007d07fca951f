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
import socket
import struct
import threading
from typing import Any

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

    A frame interrupted halfway — a ``KeyboardInterrupt`` landing inside a big
    transfer — leaves the stream somewhere no reader can find the next frame,
    so the channel marks itself broken and every later call raises
    :class:`ChannelClosed`, rather than reading garbage as a length.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._broken: str | None = None

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
                self._broken = "a send was interrupted halfway through a frame"
                raise

    def receive(self) -> Any:
        """Read one whole frame, blocking until it has arrived: the object that was sent."""
        self._check_usable()
        started = False
        try:
            prefix = self._read_exact(_PREFIX.size, at_boundary=True)
            started = True
            body_length, buffer_count = _PREFIX.unpack(prefix)
            lengths = self._read_exact(_BUFFER_LENGTH.size * buffer_count)
            body = self._read_exact(body_length)
            buffers = [
                self._read_exact(length) for (length,) in _BUFFER_LENGTH.iter_unpack(lengths)
            ]
        except ChannelClosed as closed:
            self._broken = str(closed)
            raise
        except OSError as error:
            self._broken = f"receiving failed: {error}"
            raise ChannelClosed(f"the other end of the channel is gone ({error})") from error
        except BaseException:
            if started:
                self._broken = "a receive was interrupted halfway through a frame"
            raise
        return pickle.loads(body, buffers=buffers)

    def close(self) -> None:
        self._broken = self._broken or "this end closed the channel"
        self.sock.close()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ChannelClosed(f"the channel can no longer be used: {self._broken}")

    def _send_all(self, parts: list[memoryview]) -> None:
        pending = [part.cast("B") for part in parts if part.nbytes]
        first = 0
        while first < len(pending):
            sent = self.sock.sendmsg(pending[first : first + _MOST_PARTS_PER_SEND])
            # A partial send stops anywhere, including inside one part.
            while sent:
                head = pending[first]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    first += 1
                else:
                    pending[first] = head[sent:]
                    sent = 0

    def _read_exact(self, size: int, at_boundary: bool = False) -> bytearray:
        # A bytearray so that out-of-band buffers come back writable: a numpy
        # array rebuilt on read-only memory would refuse the cell's first `+=`.
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        while got < size:
            count = self.sock.recv_into(view[got:])
            if count == 0:
                where = "between frames" if at_boundary and got == 0 else "in the middle of a frame"
                raise ChannelClosed(f"the other end of the channel closed it {where}")
            got += count
        return buffer
