"""Whether a directory is a machine's run directory, looked up cheaply.

Every kernel asks this once, before its first claim, on machines with books
of their own as much as on machines set up for everyone, so it imports
nothing beyond the standard library and the stop button: the service's
protocol and its pydantic models load only where there is a service to talk
to.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fluksio_nb.stop_button import open_whole

#: Where ``fluksio-nb machine init`` puts the books on a real machine.
DEFAULT_RUN_DIR = Path("/run/fluksio_nb")
#: The service's socket in the run directory.
SOCKET_NAME = "books.sock"
#: Present in a run directory set up by ``fluksio-nb machine init``: the books
#: are the machine's even while the service restarts and its socket is gone.
MARKER_NAME = "machine"


def socket_in(directory: Path) -> Path | None:
    """The service's socket in ``directory``, if the directory is a machine's run directory.

    A machine's run directory is root's and nobody else may write it: a socket
    in a directory another user could write might be theirs. It is marked as
    the machine's by ``fluksio-nb machine init``, so the books stay the
    machine's while the service restarts: a kernel then waits for it, rather
    than keeping books of its own that nobody else sees.
    """
    try:
        fd = open_whole(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        marker = os.stat(MARKER_NAME, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(marker.st_mode) or marker.st_uid != 0:
        return None
    return directory / SOCKET_NAME
