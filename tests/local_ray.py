"""A local Ray for a test, started on a machine that another suite may be using.

Ray gives a new node's raylet a fixed 30 s to register with its GCS, and a
raylet registers only once its agents have imported themselves: about 5 s of
CPU on a two-core machine with nothing else to do. Two suites at once, one in
its browser tests while the other starts Ray, push that past 30 s, and Ray
gives up ("timed out during startup"). That is Ray starting slowly, which no
test here is about. So a start waits until no other start of this user's is
under way on this machine (a lock file, locked only while Ray starts), and is
tried again when Ray gave up on its own clock. Any other failure is raised at
once.

The cells that start Ray run in a kernel, so :func:`starting_ray` writes the
cell that imports this module there; ``python -m tests.ray_head`` and the
notebooks' ``conftest.py`` use it in their own processes.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from tests.suite_locks import held_across_suites

REPO = Path(__file__).resolve().parents[1]

T = TypeVar("T")

#: Starts tried before Ray's own "timed out during startup" is the test's failure.
ATTEMPTS = 4

#: What Ray says when it gave up on its own clock.
STARTUP_TIMED_OUT = "timed out during startup"

#: What a test that starts Ray may wait for it: another suite's start, every
#: attempt of it, then every attempt of ours, each up to Ray's 30 s and the
#: seconds it spends starting processes before that clock begins.
START_TIMEOUT_S = 2 * ATTEMPTS * 60


@contextmanager
def one_start_at_a_time() -> Iterator[None]:
    """Held while this user starts a Ray on this machine, by any suite or notebook."""
    with held_across_suites("ray-start"):
        yield


def started_again_when_ray_gave_up(start: Callable[[], T], undo: Callable[[], object]) -> T:
    """``start()``, one start at a time, with ``undo()`` and again when Ray gave up on time.

    Ray's "timed out during startup" is found in what the error says, or in
    the traceback it carries from a kernel (nbval's ``inner_traceback``).
    """
    with one_start_at_a_time():
        for _ in range(ATTEMPTS - 1):
            try:
                return start()
            except Exception as error:
                if STARTUP_TIMED_OUT not in f"{error}{getattr(error, 'inner_traceback', '')}":
                    raise
                undo()
        return start()


def start_local_ray(**init_kwargs: Any) -> Any:
    """``ray.init(**init_kwargs)``, one start at a time, again when Ray gave up on time."""
    import ray

    return started_again_when_ray_gave_up(lambda: ray.init(**init_kwargs), ray.shutdown)


def ray_env(state: str) -> dict[str, str]:
    """The environment of a process that starts a Ray keeping its state in ``state``: with
    a token of its own, for without one Ray writes a new one to ``~/.ray``."""
    return {
        "RAY_TMPDIR": state,
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def local_ray_args(state: str, gpus: int = 2) -> dict[str, Any]:
    """One node: 2 CPUs, ``gpus`` declared cards (Ray hands out declared cards whether or
    not there are any), a 256 MB object store, its state in ``state``, loopback only."""
    return {
        "num_cpus": 2,
        "num_gpus": gpus,
        "include_dashboard": False,
        "_temp_dir": state,
        "object_store_memory": 256 * 2**20,
        "_node_ip_address": "127.0.0.1",
        "log_to_driver": False,
    }


def starting_ray(state: str) -> str:
    """A cell that starts the local Ray of :func:`local_ray_args` with
    :func:`start_local_ray`, then has ``ray`` imported, as the cells after it expect."""
    return (
        "import sys\n"
        f"if {str(REPO)!r} not in sys.path:\n"
        f"    sys.path.append({str(REPO)!r})\n"
        "from tests.local_ray import start_local_ray\n"
        f"start_local_ray(**{local_ray_args(state)!r})\n"
        "import ray\n"
    )
