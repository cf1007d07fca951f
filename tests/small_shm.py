"""A kernel whose ``/dev/shm`` is small, without filling the machine's.

Values a claimed cell binds come back through files in ``/dev/shm``
(:mod:`fluksio_nb.transfer`), and what happens when there is no room there is
only seen with a ``/dev/shm`` that really is full. Filling the machine's
would take gigabytes and starve every other test running beside this one.
So the kernel is started in a mount namespace of its own, with a tmpfs of a
few megabytes mounted on its ``/dev/shm``: the kernel, and the workers it
starts, see that one; the rest of the machine never does, and it goes when
the last process in the namespace ends. Mounting takes root (CI has it);
elsewhere the tests skip and say so.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import pytest

#: Where root's tools live, when its PATH left them out (``sudo`` often does).
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: Mounts the small tmpfs, then becomes the command it was given.
_MOUNT_THEN_RUN = (
    'mount -t tmpfs -o "size=$1,mode=1777" fluksio-small-shm /dev/shm || exit 97\n'
    "shift\n"
    'exec "$@"\n'
)


def _tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=_SYSTEM_PATH)


def launcher(size: str) -> list[str]:
    """The command a kernel is handed to for a ``/dev/shm`` of ``size`` (``"4m"``) of its own.

    ``unshare --mount`` makes every mount in the new namespace private, so
    the tmpfs is never seen outside it.
    """
    return [str(_tool("unshare")), "--mount", "sh", "-c", _MOUNT_THEN_RUN, "small-shm", size]


@functools.cache
def missing_for_small_shm() -> str | None:
    """Why a process cannot be given a small ``/dev/shm`` of its own here; ``None`` if it can."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux mount namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return (
            "needs root to mount a small tmpfs on /dev/shm in a mount namespace "
            f"of the kernel's own (running as uid {os.geteuid()})"
        )
    for tool in ("unshare", "mount"):
        if _tool(tool) is None:
            return f"needs `{tool}` (util-linux) to give a kernel a /dev/shm of its own"
    try:
        probe = subprocess.run(
            [*launcher("1m"), "df", "--output=size", "-B1", "/dev/shm"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"cannot give a process a /dev/shm of its own: {error}"
    said = probe.stdout.split()
    if probe.returncode != 0 or said[-1:] != [str(2**20)]:
        why = (probe.stderr.strip() or probe.stdout.strip() or "nothing").splitlines()[-1]
        return f"cannot mount a small tmpfs on /dev/shm in a mount namespace: {why}"
    return None


def require_small_shm() -> None:
    """Skip the calling test, saying exactly what is missing, unless it can be done here."""
    reason = missing_for_small_shm()
    if reason is not None:
        pytest.skip(reason)
