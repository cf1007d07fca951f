"""Who a process is, as the operating system says.

A user's name goes into the books, the monitor and the usage records, and on
a machine several people share it decides whose claim is whose. ``$USER`` and
``$LOGNAME`` are anybody's to set, so the name always comes from a uid: the
process's own, a file's owner, or a socket's peer.
"""

from __future__ import annotations

import os
import pwd


def user_name(uid: int) -> str:
    """The name of user ``uid``, or the uid itself where it has no entry (a container's)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def my_user() -> str:
    """The name of the user this process runs as."""
    return user_name(os.geteuid())


def process_started(pid: int) -> float | None:
    """When a process started, or ``None`` if there is no such process.

    A pid alone names whichever process has it now; with its start time it
    names one process for good. A zombie is no such process: it holds
    nothing and runs nothing, and a kernel killed under a server that has not
    reaped it yet is one.
    """
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.Error:
        return None


def this_kernel() -> dict[str, str | None]:
    """Which kernel this process is, as its user's views name it: its id and its notebook."""
    import contextlib
    import sys
    from pathlib import Path

    kernel_id = None
    # A kernel imported its app before anything of ours ran. Anything else (the
    # command line, a script, a Ray task) would import ipykernel and
    # jupyter_client only to hear it is no kernel: 0.2 CPU-s of every
    # `fluksio-nb machine status`.
    if "ipykernel.kernelapp" in sys.modules:
        with contextlib.suppress(Exception):
            from ipykernel.connect import get_connection_file

            kernel_id = Path(get_connection_file()).stem.removeprefix("kernel-")
    # jupyter_server tells the kernels it starts which notebook they serve.
    return {"kernel_id": kernel_id, "notebook": os.environ.get("JPY_SESSION_NAME")}
