"""The most memory the worker held while one cell ran, as the OS counted it.

The kernel's sampler reads the worker every half second, and a cell that
builds 400 MB and lets it go in a tenth of one was recorded at the 43 MB it
held before and after. Where a claim has a memory cap its cgroup counts the
peak; without one, nothing did. Linux keeps a high-water mark of each
process's resident memory (``VmHWM``), and lets a process set it back to
what it holds now (``5`` written to ``/proc/self/clear_refs``). So the
worker sets it back as a cell starts and reads it as the cell ends: the
peak of its own memory in between, exact however short the cell. Its
children's are not in it; the sampler's readings of the whole tree still
are. Both files stay open, so a cell costs two system calls (about 10 µs).
"""

from __future__ import annotations

import os


class PeakMemory:
    """The worker's own resident peak since :meth:`start`, where Linux keeps one."""

    def __init__(self) -> None:
        try:
            self._reset = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
            self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._reset = self._status = -1

    def start(self) -> None:
        if self._reset >= 0:
            try:
                os.write(self._reset, b"5")
            except OSError:
                # A kernel before 4.0 has no such reset: the peak would be the
                # worker's lifetime's, which is not the cell's.
                self._reset = -1

    def bytes(self) -> int:
        """The peak since :meth:`start`, or 0 where it cannot be told."""
        if self._reset < 0:
            return 0
        try:
            status = os.pread(self._status, 4096, 0)
            at = status.index(b"VmHWM:") + len(b"VmHWM:")
            return int(status[at : status.index(b"kB", at)]) * 1024
        except (OSError, ValueError):
            return 0
