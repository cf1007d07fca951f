"""Kernels that claimed nothing, started by a real Jupyter server, get the fair share.

Each test starts kernels through a real JupyterLab server, which picks the
provisioner exactly as a user's server does: from the config file this
package installs into the venv's ``etc/jupyter``. Claims are held by separate
processes on the server's own books, as other kernels hold them. What a test
checks is read where it happens: the kernel's environment and numpy's thread
pools from inside the kernel (threadpoolctl), the affinity of every thread of
the kernel process from ``/proc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient

from fluksio_nb.env import THREAD_VARS
from fluksio_nb.fair_share import held_cores, unclaimed
from tests.browser.lab import JupyterLab
from tests.kernels import run_in
from tests.machines import wait_until

pytestmark = pytest.mark.timeout(180)

MACHINE = frozenset(os.sched_getaffinity(0))

needs_two_cores = pytest.mark.skipif(
    len(MACHINE) < 2, reason="a fair share differs from every core only with two cores or more"
)

#: Holds one claim in the server's books until its stdin closes, then gives it back.
HOLDER = """
import json, sys
from fluksio_nb import Resources, accountant
queue = accountant()
ticket = queue.enqueue(Resources(cpus=int(sys.argv[1])), label="held-elsewhere")
queue.wait(ticket, timeout=60)
print(json.dumps({"ticket": ticket.number}), flush=True)
sys.stdin.read()
queue.release(ticket)
"""

#: What a kernel's own cells see: its thread variables, and numpy's pools once imported.
REPORT = f"""
import json, os
import numpy
from threadpoolctl import threadpool_info
print(json.dumps({{
    "pid": os.getpid(),
    "env": {{var: os.environ.get(var) for var in {list(THREAD_VARS)!r}}},
    "pools": {{pool["internal_api"]: pool["num_threads"] for pool in threadpool_info()}},
}}))
"""

#: A kernelspec whose user set one thread variable themselves.
OWN_THREADS = {"OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    server = JupyterLab(tmp_path_factory.mktemp("fair-share"))
    # Whatever the developer's shell says about threads is not what is tested.
    for var in THREAD_VARS:
        server.env.pop(var, None)
    spec = Path(server.env["JUPYTER_DATA_DIR"]) / "kernels" / "own-threads"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3, its own thread count",
                "language": "python",
                "env": OWN_THREADS,
            }
        )
    )
    server.start()
    yield server
    server.stop()


@contextmanager
def kernel(lab: JupyterLab, name: str = "python3") -> Iterator[dict[str, Any]]:
    """A kernel the server started, with what its cells report (see ``REPORT``)."""
    started = lab.api("POST", "api/kernels", {"name": name})
    runtime = Path(lab.env["JUPYTER_RUNTIME_DIR"])
    client = BlockingKernelClient(connection_file=str(runtime / f"kernel-{started['id']}.json"))
    client.load_connection_file()
    # No heartbeat: on a loaded machine a kernel still starting misses its first beats
    # (1 s each), and the client takes it for dead. A dead kernel still fails the wait.
    client.start_channels(hb=False)
    try:
        client.wait_for_ready(timeout=60)
        yield json.loads(run_in(client, REPORT).strip().splitlines()[-1])
    finally:
        client.stop_channels()
        lab.api("DELETE", f"api/kernels/{started['id']}")


def thread_affinities(pid: int) -> set[frozenset[int]]:
    """The distinct CPU affinities of every thread of process ``pid``."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(frozenset(os.sched_getaffinity(int(tid))))
        except ProcessLookupError:
            continue
    return found


class Held:
    """A claim granted to another process, as the books show it."""

    def __init__(self, process: subprocess.Popen, claim: dict[str, Any]) -> None:
        self.process, self.claim = process, claim

    def give_back(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


@pytest.fixture
def hold(lab: JupyterLab) -> Iterator[Callable[[int], Held]]:
    """``hold(cpus)``: a claim granted to another process on the server's books."""
    held: list[Held] = []

    def make(cpus: int) -> Held:
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(cpus)],
            env=lab.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        line = process.stdout.readline()
        assert line, f"the claim could not be held (exit {process.wait()})"
        ticket = json.loads(line)["ticket"]
        running = lab.api("GET", "fluksio/api/snapshot")["running"]
        held.append(Held(process, next(c for c in running if c["ticket"] == ticket)))
        return held[-1]

    yield make
    for claim in held:
        claim.give_back()


@needs_two_cores
def test_an_unclaimed_kernel_gets_the_fair_share_of_the_cores_no_claim_holds(lab, hold):
    """Guards against an unclaimed ``import numpy`` that starts a thread for every core,
    the claimed ones included, beside a claim that was promised some of them."""
    claim = hold(1).claim
    held = set(claim["allocation"].get("cores", []))
    # The one kernel the server runs shares what the claim leaves over.
    fair = str(max(1, len(MACHINE) - 1))

    with kernel(lab) as seen:
        assert seen["env"] == dict.fromkeys(THREAD_VARS, fair)
        assert seen["pools"] and set(seen["pools"].values()) == {int(fair)}, seen["pools"]
        assert thread_affinities(seen["pid"]) == {MACHINE - held}


@needs_two_cores
def test_the_kernels_threads_stay_off_the_cores_a_claim_holds_while_it_holds_them(lab, hold):
    """Guards against a kernel started before a claim whose threads then run on the
    claim's cores, and against a kernel that never gets those cores back."""
    with kernel(lab) as seen:
        assert thread_affinities(seen["pid"]) == {MACHINE}

        held = hold(1)
        cores = frozenset(held.claim["allocation"]["cores"])
        assert cores and cores <= MACHINE, held.claim["allocation"]
        wait_until(
            lambda: thread_affinities(seen["pid"]) == {MACHINE - cores},
            what=f"every thread of the kernel off the claimed cores {sorted(cores)}",
        )

        held.give_back()
        wait_until(
            lambda: thread_affinities(seen["pid"]) == {MACHINE},
            what="the kernel back on every core once the claim was given back",
        )


@needs_two_cores
def test_opting_out_in_the_config_starts_kernels_as_jupyter_would(lab, hold):
    """Guards against a setting that cannot turn the fair share off, for a user whose
    kernels must see every core, claims or not."""
    config = Path(lab.env["FLUKSIO_CONFIG"])
    config.write_text(json.dumps({"fair_share": False}))
    try:
        hold(1)
        with kernel(lab) as seen:
            assert seen["env"] == dict.fromkeys(THREAD_VARS)
            assert set(seen["pools"].values()) == {len(MACHINE)}, seen["pools"]
            assert thread_affinities(seen["pid"]) == {MACHINE}
    finally:
        config.unlink()


@needs_two_cores
def test_a_thread_variable_the_user_set_for_the_kernel_wins(lab):
    """Guards against a fair share that overrides a user's deliberate thread count."""
    with kernel(lab, "own-threads") as seen:
        fair = str(len(MACHINE))
        assert seen["env"] == {**dict.fromkeys(THREAD_VARS, fair), **OWN_THREADS}
        assert seen["pools"]["openblas"] == 1


def test_the_unclaimed_share_is_the_machine_less_what_running_claims_hold():
    """Guards against the rule itself: claimed cores taken off, a claim that names
    no cores counted off, and a kernel left somewhere to run when all are claimed."""
    machine = frozenset({0, 1, 2, 3})
    with_cores = {"running": [{"allocation": {"cpus": 2, "cores": [2, 3]}}]}
    counted = {"running": [{"allocation": {"cpus": 1, "gpus": []}}]}
    everything = {"running": [{"allocation": {"cpus": 4, "cores": [0, 1, 2, 3]}}]}

    assert held_cores(with_cores) == {2, 3}
    assert unclaimed(with_cores, machine).cores == {0, 1}
    assert unclaimed(with_cores, machine).cpus == 2
    assert unclaimed(counted, machine).cores == machine
    assert unclaimed(counted, machine).cpus == 3
    assert unclaimed(everything, machine).cores == machine
    assert unclaimed(everything, machine).cpus == 0
    assert unclaimed({"running": []}, machine).cpus == 4
