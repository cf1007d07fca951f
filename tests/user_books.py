"""A user's own books service, as the tests reach it: read from outside, and shared by processes.

The service runs in the directory ``FLUKSIO_LEDGER`` names, each test's own
(the suite's ``conftest.py``). A test reads it as a view does, never
starting it; and it starts other processes that keep claims in it as a
kernel does, through the kernel's accountant, each saying what happened as a
line of JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from fluksio_nb.machine.connection import read_snapshot
from fluksio_nb.machine.run_dir import SOCKET_NAME


def users_books(directory: Path | str) -> dict[str, Any]:
    """The books of the user's service in ``directory``, as a view reads them; it must answer."""
    return read_snapshot(Path(directory) / SOCKET_NAME, os.geteuid())


def other_process(
    directory: Path, body: str, *, made_first: bool = True, **settings: str
) -> subprocess.Popen:
    """A Python process keeping claims in the user's books in ``directory``, as a kernel does.

    ``settings`` are ``FLUKSIO_*`` variables by their setting's name
    (``cpus="4"``); ``q`` is its accountant, made before ``body`` runs unless
    ``made_first`` is false, and ``say(**facts)`` a line to :func:`heard`. It
    reads its stdin for the test's go-ahead.
    """
    script = (
        textwrap.dedent(
            """
        import json, sys, time
        from fluksio_nb.kernel import accountant
        from fluksio_nb.resources import Resources
        def say(**facts):
            print(json.dumps(facts), flush=True)
        """
        )
        + ("q = accountant()\n" if made_first else "")
        + textwrap.dedent(body)
    )
    env = {**os.environ, "FLUKSIO_LEDGER": str(directory)}
    env.update({f"FLUKSIO_{name.upper()}": value for name, value in settings.items()})
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        env=env,
    )


def heard(process: subprocess.Popen) -> dict[str, Any]:
    """The next line the process said; it must say one."""
    line = process.stdout.readline()
    assert line, f"the other process ended without saying anything (status {process.wait()})"
    return json.loads(line)
