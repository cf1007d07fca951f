"""The worker's process, and everything it starts: started apart, ended together, reaped once.

A claimed cell may start processes of its own — a ``DataLoader``'s workers, a
``!cmd``, a daemon that calls ``setsid`` — and every one of them holds some of
the claim's share. This module is what the kernel does with the worker as a
process, below any talk with it (:mod:`fluksio_nb.worker.client`), and it
decides:

- **The worker lives in a session of its own**, so the SIGINT Jupyter's stop
  button sends the kernel does not reach it behind the kernel's back, and the
  group it leads holds whatever its cells start.
- **Nothing the worker started outlives it.** Ending a worker ends its process
  group and any descendant that left the group, and reaps the worker.
- **The group is signalled only while the worker is unreaped**, because after
  that its number may already belong to somebody else's process. Whether it
  has exited is asked without reaping it, for the same reason.
- **The worker never outlives the kernel**, however the kernel ends: it holds
  the read end of a pipe only the kernel writes to, and leaves when that pipe
  reaches end-of-file (:func:`fluksio_nb.worker.lifetime.leave_with_the_kernel`).
  A :class:`WorkerProcess` dropped without being ended ends its process when it
  is collected.

POSIX only: process groups, ``killpg`` and ``waitid``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from typing import IO

import psutil

from fluksio_nb.stop_button import stop_held_back

#: Where this process found ``fluksio_nb``: where its worker must find it too.
_PACKAGE_HOME = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: How a worker starts: ``python -m fluksio_nb.worker``, with the kernel's own
#: copy of the package first on the path. ``-m`` alone puts the working
#: directory first, and a folder named ``fluksio_nb`` there (a checkout of
#: this project, opened in JupyterLab) would be imported instead: a worker of
#: another version than its kernel, whose messages the kernel cannot read.
_START = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from fluksio_nb.worker.main import main; raise SystemExit(main())"
)


class WorkerProcess:
    """The worker's process: ``python -m fluksio_nb.worker`` with ``env``, over ``channel_end``.

    ``channel_end`` is the worker's end of the kernel's socket; the worker
    inherits it, and the caller closes its own copy once this is made.
    """

    def __init__(
        self,
        env: dict[str, str],
        cwd: str | os.PathLike[str] | None,
        channel_end: socket.socket,
    ) -> None:
        # The worker watches the read end for the end-of-file that the kernel's
        # death causes; the kernel never writes to it.
        try:
            # Made and owned in one step: a stop landing as the pipe is made, or
            # as the process starts, would leave one open, or running, for nobody.
            with stop_held_back():
                lifeline_read, lifeline_write = os.pipe()
                try:
                    self._popen = subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            _START,
                            _PACKAGE_HOME,
                            f"--channel-fd={channel_end.fileno()}",
                            f"--lifeline-fd={lifeline_read}",
                            f"--kernel-pid={os.getpid()}",
                        ],
                        env=env,
                        cwd=cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        pass_fds=(channel_end.fileno(), lifeline_read),
                        start_new_session=True,
                    )
                except BaseException:
                    os.close(lifeline_write)
                    raise
                finally:
                    os.close(lifeline_read)
                self._lifeline = lifeline_write
                # Dropped without being closed, it must not leave its process behind.
                self._finalizer = weakref.finalize(self, _end_unreaped, self._popen, lifeline_write)
        except KeyboardInterrupt:
            # The stop, held back while the process started, lands as it
            # ends: the process and its pipes go with the start nobody will return.
            if hasattr(self, "_finalizer"):
                self._finalizer()
                self._popen.stdout.close()
                self._popen.stderr.close()
            raise
        self.pid: int = self._popen.pid
        self.stdout: IO[bytes] = self._popen.stdout
        self.stderr: IO[bytes] = self._popen.stderr

    @property
    def returncode(self) -> int | None:
        """Once reaped: the exit code, or minus the signal that ended it; None before."""
        return self._popen.returncode

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker and every process in its group, while that is safe."""
        # Once reaped, the worker's number may already be someone else's group.
        if self._popen.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def strays(self) -> list[psutil.Process]:
        """Processes the worker started that left its group — ``setsid`` daemons, mostly.

        Found only while the worker is unreaped: after that, what it started
        in a session of its own is nobody's descendant any more.
        """
        if self._popen.returncode is not None:
            return []
        return _descendants_outside_group(self.pid)

    def end(self, strays: list[psutil.Process] | None = None) -> None:
        """SIGKILL the worker's group and its strays, then reap the worker."""
        if self._popen.returncode is not None:
            return
        if strays is None:
            strays = self.strays()
        self.signal_group(signal.SIGKILL)
        for stray in strays:
            with contextlib.suppress(psutil.Error):
                stray.kill()
        self._popen.wait()

    def has_exited(self) -> bool:
        """Whether the worker has exited, without reaping it: see :meth:`signal_group`."""
        if self._popen.returncode is not None:
            return True
        if not hasattr(os, "waitid"):
            return self._popen.poll() is not None
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def wait_without_reaping(self, timeout: float) -> None:
        """Return once the worker has exited; ``subprocess.TimeoutExpired`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.has_exited():
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self._popen.args, timeout)
            time.sleep(0.01)

    def close(self) -> None:
        """Let go of the lifeline, once the worker is reaped: nothing is left to end."""
        # At interpreter exit the finalizer may have run first and closed it.
        if self._finalizer.detach() is not None:
            os.close(self._lifeline)


def _descendants_outside_group(pid: int) -> list[psutil.Process]:
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    strays = []
    for process in descendants:
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) != pid:
                strays.append(process)
    return strays


def _end_unreaped(process: subprocess.Popen[bytes], lifeline: int) -> None:
    """The finalizer of a worker nobody closed: its process must not outlive it."""
    with contextlib.suppress(OSError):
        os.close(lifeline)
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
