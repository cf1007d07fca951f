"""``%%claim --on ray://host:port``: a kernel that is not part of the cluster reaches it.

A notebook on a laptop talks to a cluster through Ray Client, which cannot do
everything a driver on the cluster can (no streaming generators, for one).
The cluster here is a one-node Ray with a Ray Client server, started by the
test in a process of its own (``tests/ray_head.py``); the kernel connects to it
only through the ``ray://`` address on its ``%%claim`` line.

The failures guarded against: a claim that only works from a driver on the
cluster, output or variables lost on the way through Ray Client, and a
feasibility check that does not reach the cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import psutil
import pytest

from tests.kernels import started_kernel, until_it_exists
from tests.local_ray import REPO, START_TIMEOUT_S, ray_env

# The first test also waits for Ray to start, which may wait for another suite's.
pytestmark = pytest.mark.timeout(240 + START_TIMEOUT_S)


@pytest.fixture(scope="module")
def cluster():
    """The ``ray://`` address of a running one-node cluster, and the environment to reach it."""
    pytest.importorskip("ray", reason="ray is not installed: pip install 'fluksio_nb[ray]'")
    pytest.importorskip("grpc", reason="Ray Client needs grpcio: pip install 'ray[client]'")
    state = tempfile.mkdtemp(prefix="fluksio-ray-")
    env = {**ray_env(state), "RAY_AUTH_MODE": "token"}
    head = subprocess.Popen(
        [sys.executable, "-m", "tests.ray_head", state],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **env},
        text=True,
    )
    try:
        said, _, port = head.stdout.readline().strip().partition(" ")
        assert said == "ready", "the Ray head did not start"
        yield f"ray://127.0.0.1:{port}", env
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
        for process in psutil.process_iter(["cmdline"]):
            if any(state in part for part in process.info["cmdline"] or ()):
                process.kill()
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel(cluster, tmp_path_factory):
    _, env = cluster
    with started_kernel(tmp_path_factory.mktemp("kernel"), **env) as k:
        yield k


def test_a_claim_on_a_ray_address_runs_there_with_its_share(kernel, cluster, tmp_path):
    address, _ = cluster
    kernel.run("import numpy as np\nv = np.arange(1_000_000.0)", check=True)
    go = tmp_path / "go"
    msg_id = kernel.client.execute(
        f"%%claim cpus=1 gpus=1 --on {address}\n"
        "import os\n"
        "print(os.environ['OPENBLAS_NUM_THREADS'], flush=True)\n"
        "print(os.environ['CUDA_VISIBLE_DEVICES'], flush=True)\n"
        f"{until_it_exists(go)}"
        "w = v * 2"
    )
    try:
        # The task waits for the file until its output has arrived: output
        # held back to the task's end would never let it go on.
        kernel.wait_for_output(msg_id, "0\n", timeout=60)
    finally:
        go.touch()
    ran = kernel.messages_of(msg_id, timeout=60)
    assert ran.error is None, ran.error
    assert ran.stdout.split() == ["1", "0"]
    assert kernel.facts("[float(w[1]), bool(w.flags.writeable)]") == [2.0, True]
    assert (
        kernel.facts(
            "__import__('fluksio_nb.ray.monitor').ray.monitor.ray_snapshot()['total']['gpus']"
        )
        == 1
    )


def test_a_claim_the_cluster_cannot_hold_is_refused_through_the_client(kernel, cluster):
    address, _ = cluster
    # Ray itself would keep the task pending: a cell that ends at all was refused.
    ran = kernel.run(f"%%claim cpus=16 --on {address}\n1", timeout=60)
    shown = ran.stderr + "".join((ran.error or {}).get("traceback", []))
    assert "cpus=16 cannot run on this Ray cluster: its largest node has cpus=2 gpus=1" in shown


def test_a_second_address_is_refused_while_connected_to_the_first(kernel):
    """Ray lets a process talk to one cluster; a silent switch would run the cell elsewhere."""
    ran = kernel.run("%%claim --on ray://127.0.0.1:1\n1")
    shown = ran.stderr + "".join((ran.error or {}).get("traceback", []))
    assert "already connected to the Ray cluster at ray://127.0.0.1:" in shown
    assert shown.strip().count("\n") == 0, shown
