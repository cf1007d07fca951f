"""The stop button at every moment of a ``%%claim --on ray`` cell, against a local Ray.

In a module of its own: it starts a Ray of its own in a Python of its own,
and two clusters at once would crowd a two-core machine.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from tests.local_ray import REPO, local_ray_args, ray_env
from tests.stops import said_by

#: A cell run on Ray from an IPython shell of its own, stopped at every moment of
#: fluksio_nb's code in the kernel, one moment a round: as it connects and checks
#: the cluster, as it notes itself among the kernel's live claims, as its task
#: runs and as its end comes back. After each, the kernel may count no claim on
#: Ray as live, and a cell that ran to its end (it leaves a file as its last act)
#: must have its name bound: stopped before its end reached the kernel, it keeps
#: what it bound as a local cell does, unless Ray itself reported the task
#: cancelled, which a cancel that meets the task as it returns makes it do.
STOP_AT_EVERY_MOMENT_OF_A_CELL_ON_RAY = """
import glob, os, sys, tempfile
from pathlib import Path
sys.path.append({repo!r})
os.environ.update({environ!r})
from tests.local_ray import start_local_ray
from IPython.core.interactiveshell import InteractiveShell
import fluksio_nb
import fluksio_nb.ray.claim as ray_claim
from fluksio_nb.ray.connection import ray_connection

start_local_ray(**{ray_args!r})
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "fluksio_nb")
assert shell.run_cell("%%claim --on ray\\nwarm = 1").success
ran = Path(tempfile.mkdtemp()) / "ran"
last = {{"n": 0}}

# Whether Ray reported the task cancelled when it was stopped as it ran: one
# that met the cancel as it returned is reported so, its result gone, however
# far the cell got. Nothing in fluksio_nb can keep those names.
ray_claim_stop_task = ray_claim.stop_task

def stop_task(ray, running):
    result = ray_claim_stop_task(ray, running)
    last["ray_cancelled"] = result is None
    return result

ray_claim.stop_task = stop_task

def attempt(made):
    last["n"] += 1
    last["ray_cancelled"] = False
    shell.run_cell(f"%%claim --on ray\\nx = {{last['n']}}\\nopen({{str(ran)!r}}, 'w').close()")

def undo(made):
    last["ran"] = ran.exists()
    ran.unlink(missing_ok=True)

def check():
    if ray_connection.claims():
        return "a_claim_left_live"
    if last["ran"] and shell.user_ns.get("x") != last["n"] and not last["ray_cancelled"]:
        return f"it_ran_and_x_is_{{shell.user_ns.get('x')}}_not_{{last['n']}}"

here = os.path.dirname(fluksio_nb.__file__)
watched = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
each_moment(watched, attempt, undo, check, generators=False)
"""


@pytest.mark.timeout(900)
def test_a_stop_at_any_moment_of_a_cell_on_ray_keeps_what_it_ran_and_no_claim_live():
    """Guards against the stop button landing as a claim on Ray noted itself among the
    kernel's live ones, which counted it live for good (the monitor showed it); and after
    the task had ended and before the kernel took its result, which lost what it bound."""
    pytest.importorskip("ray", reason="ray is not installed: pip install 'fluksio_nb[ray]'")
    # Short, because Ray puts Unix sockets under it, and their paths are short.
    state = tempfile.mkdtemp(prefix="fluksio-ray-")
    script = STOP_AT_EVERY_MOMENT_OF_A_CELL_ON_RAY.format(
        repo=str(REPO), environ=ray_env(state), ray_args=local_ray_args(state)
    )
    try:
        said = said_by(script, timeout=900)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    assert "stopped_at" in said, said
    # A cell on Ray is several hundred such moments: every one was tried.
    assert said["stopped_at"] > 500, said
