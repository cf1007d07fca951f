"""A machine set up for books every user shares, as an admin sets one up.

Each test gets a machine of its own under a temporary prefix, set up by what
``fluksio-nb machine init`` runs (as root) and taken down by what ``machine
remove`` runs, so two runs of the suite on one machine never share books.
Kernels and processes find it through ``FLUKSIO_LEDGER``, the machine's run
directory.

:func:`machine` calls ``init`` and ``remove`` in the test's own process
rather than through the command: a Python started for each cost 0.36 CPU-s
a machine (the 349 tests that use one: 417 busy CPU-s against 440), and the
command's own words, flags and exit codes are the business of the tests that
type it (:func:`fluksio_nb`), as ``test_machine_service`` and
``test_shared_machine_day`` do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any
from unittest import mock

import pytest

from fluksio_nb.machine.prefix import MachineSetupError
from fluksio_nb.machine.setup import Layout, init, remove
from tests.unix_users import UnixUser, as_user, shared_tmp_dir, user_environ


def fluksio_nb(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``fluksio-nb ARGS`` as a terminal runs it, with ``env`` over the test's environment."""
    ran = subprocess.run(
        [sys.executable, "-m", "fluksio_nb", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    if check and ran.returncode != 0:
        raise AssertionError(f"fluksio-nb {' '.join(args)} failed: {ran.stderr}")
    return ran


@contextmanager
def machine(
    cpus: int = 4,
    gpus: int = 1,
    config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Layout]:
    """A machine's books, served by a real service run by root, removed afterwards.

    ``env`` goes on top of the test's environment while ``init`` runs, and so
    for the service it starts: ``PATH`` with a stand-in ``nvidia-smi``, say.
    """
    if os.geteuid() != 0:
        pytest.skip(
            f"needs root: `fluksio-nb machine init` sets up books as root (uid {os.geteuid()})"
        )
    with shared_tmp_dir("fluksio-machine-") as prefix:
        layout = Layout(prefix)
        if config:
            layout.config.parent.mkdir(parents=True)
            layout.config.write_text(json.dumps(config))
        with mock.patch.dict(os.environ, env or {}):
            init(
                layout,
                admin_group=(config or {}).get("admin_group"),
                inventory={"cpus": cpus, "gpus": gpus},
            )
        try:
            yield layout
        finally:
            # As `machine remove` would have failed quietly: a test may have removed it.
            with suppress(MachineSetupError):
                remove(layout)


def machine_env(layout: Layout, **more: str) -> dict[str, str]:
    """What a kernel or process of any user needs to use this machine's books."""
    return {
        "FLUKSIO_LEDGER": str(layout.run_dir),
        "FLUKSIO_RESERVE_CPUS": "0",
        "FLUKSIO_CONFIG": "/nonexistent/fluksio_nb.json",
        **more,
    }


PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time
    from fluksio_nb.kernel import accountant
    from fluksio_nb.resources import Resources
    q = accountant()
    def say(**facts):
        print(json.dumps(facts), flush=True)
    """
)


def process(
    layout: Layout, body: str, user: UnixUser | None = None, **env: str
) -> subprocess.Popen:
    """A Python process using the machine's books, as ``user`` or as root."""
    script = PRELUDE + textwrap.dedent(body)
    prefix = as_user(user) if user is not None else []
    environ = (
        user_environ(user, machine_env(layout, **env))
        if user is not None
        else {**os.environ, **machine_env(layout, **env)}
    )
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
        cwd="/",
    )


def wait_until(condition, timeout: float = 30.0, what: str = "the condition"):
    """Poll ``condition`` until it gives something true, and return that."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} was not reached in {timeout} s")
        time.sleep(0.01)
    return found


def heard(proc: subprocess.Popen) -> dict[str, Any]:
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"the process ended without a word: {proc.stderr.read()}")
    return json.loads(line)


@contextmanager
def kernels_on_books() -> Iterator[Any]:
    """``start(user, layout, **env)``: a kernel of the user's on those books, shut down after."""
    from tests.kernels import Kernel, shut_down_at_the_end

    def start(user: UnixUser, layout: Layout, **env: str) -> Kernel:
        return Kernel(user=user, **machine_env(layout, **env))

    with shut_down_at_the_end(start) as started:
        yield started
