"""Locks the suites on one machine share, for what no two of them may do at once.

Two suites may run side by side on one machine: CI's two Pythons, or a
developer's run beside another. A few things a test does are seen by every
process on the machine, the other suite's too: a Ray starting (which another
start slows past Ray's own time limit), a stand-in MPS control daemon (which
every claim then finds). A test doing such a thing holds a lock of its user's
while it does; a test that must not see it holds the same lock shared.

The lock files are kept in the user's home directory (as the OS names it,
whatever a test set ``HOME`` to), so that the notebooks, which take them too,
leave nothing in the machine's temporary directory.
"""

from __future__ import annotations

import fcntl
import os
import pwd
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def held_across_suites(name: str, shared: bool = False) -> Iterator[None]:
    """The lock ``name``, held alone, or ``shared`` with whoever else holds it shared."""
    folder = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "fluksio-tests"
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(
        folder / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
