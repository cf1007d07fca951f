"""The worker's stdout and stderr as the kernel reads them: never waiting, decoded as they come.

Python's own output in a claimed cell arrives as messages
(:mod:`fluksio_nb.worker.streams`); the worker's pipes carry the rest, what
child processes, ``!cmd`` and C code write. The kernel reads them in the one
thread that also reads the worker's messages
(:meth:`~fluksio_nb.worker.client.Worker.run`), so what is decided here is
that a pipe never holds that thread up:

- **A read never waits**: it takes what is in the pipe, and returns when it
  is empty.
- **A flood cannot starve the messages**: a pipe is read a few times at
  most before the channel is looked at again.
- **A character cut in two by a read arrives whole**, with the next read;
  bytes that are not UTF-8 arrive as replacement characters, not as an error.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable
from typing import Any, Literal

from fluksio_nb.worker.messages import Output, Stream

#: Read this much of a pipe at a time, and at most this many times before
#: looking at the channel again, so a child flooding stdout cannot starve the frames.
_READ_CHUNK = 1 << 16
_READS_PER_DRAIN = 16


class OutputPipe:
    """One of the worker's output pipes, decoded as it is read."""

    def __init__(self, name: Literal["stdout", "stderr"], pipe: Any) -> None:
        self.name = name
        self.pipe = pipe
        self.fd = pipe.fileno()
        os.set_blocking(self.fd, False)
        # Incremental, because a read can end in the middle of a UTF-8 character.
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def drain(self, show: Callable[[Output], None]) -> bool:
        """Relay what is waiting in the pipe; False once the pipe has reached its end."""
        for _ in range(_READS_PER_DRAIN):
            try:
                chunk = os.read(self.fd, _READ_CHUNK)
            except BlockingIOError:
                return True
            text = self.decoder.decode(chunk, final=not chunk)
            if text:
                show(Stream(self.name, text))
            if not chunk:
                return False
        return True
