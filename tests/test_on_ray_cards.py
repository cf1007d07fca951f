"""A card memory budget on a Ray node: ``gpu_ram=`` handed to the frameworks and held there,
and ``gpu_ram=`` alone granted by Ray as the fraction of the node's card it is.

A module of its own because it starts a Ray cluster of its own (its node
must read a stand-in nvidia-smi): the cluster of ``test_on_ray`` is gone by
then, and two clusters starting on a two-core machine that runs another
suite beside them left a raylet short of its 30 s to register.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time

import pytest

from tests.gpu_standins import MPS_DAEMON, StandInSmi, card
from tests.kernels import printed, started_kernel
from tests.local_ray import START_TIMEOUT_S, ray_env, starting_ray
from tests.suite_locks import held_across_suites
from tests.waiting import gone, processes_using

pytestmark = pytest.mark.timeout(240 + START_TIMEOUT_S)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A kernel with a Ray of one node whose workers read two stand-in 40 GB cards."""
    pytest.importorskip("ray", reason="ray is not installed: pip install 'fluksio_nb[ray]'")
    where = tmp_path_factory.mktemp("node")
    cards = StandInSmi(where / "smi", [card(0), card(1)])
    state = tempfile.mkdtemp(prefix="fluksio-ray-")
    try:
        with started_kernel(where / "kernel", **ray_env(state), **cards.env()) as kernel:
            kernel.run(starting_ray(state), timeout=START_TIMEOUT_S, check=True)
            yield kernel, cards
            kernel.run("ray.shutdown()", timeout=60)
    finally:
        deadline = time.monotonic() + 15
        while processes_using(state) and time.monotonic() < deadline:
            time.sleep(0.2)
        for straggler in processes_using(state):
            straggler.kill()
        shutil.rmtree(state, ignore_errors=True)


def test_a_gpu_ram_budget_is_handed_to_the_frameworks_and_held_on_the_ray_node(node):
    """The node reads its cards (a stand-in nvidia-smi on the PATH its workers inherit),
    hands JAX and torch their share of the card, and halts the cell past gpu_ram=."""
    kernel, cards = node
    msg_id = kernel.client.execute(
        "%%claim gpus=1 gpu_ram=2G --on ray --background --label trainer\n"
        "import json, os, time\n"
        "print(json.dumps({'pid': os.getpid(), "
        "'card': int(os.environ['CUDA_VISIBLE_DEVICES']), "
        "'share': os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'), "
        "'torch': os.environ.get('FLUKSIO_GPU_MEMORY_FRACTION')}), flush=True)\n"
        "time.sleep(120)"
    )
    said = kernel.messages_of(msg_id, until=printed("}"), timeout=120, past_idle=True).stdout
    kernel.run("job = _", check=True)
    worker = json.loads(said[said.index("{") :])
    share = f"{2 * 10**9 / (40960 * 2**20):.3f}"
    assert (worker["share"], worker["torch"]) == (share, share)

    # The node reads the card memory of the cell's worker; the monitor says so.
    held = cards.cards[worker["card"]]
    cards.set_apps([{"uuid": held["uuid"], "pid": worker["pid"], "used_mib": 1000}])
    shown = f"GPU 1.0GB of 2.0GB on card {worker['card']}"
    monitor = kernel.run(
        "import time\n"
        "from fluksio_nb.overview import describe_monitor, kernel_snapshot, ray_now\n"
        "deadline = time.monotonic() + 60\n"
        "said = lambda: describe_monitor(kernel_snapshot(), ray_now())\n"
        f"while {shown!r} not in (text := said()):\n"
        "    assert time.monotonic() < deadline, text\n"
        "    time.sleep(0.1)\n"
        "print(text)",
        check=True,
    ).stdout
    assert "ray running  trainer:" in monitor, monitor

    # Over its gpu_ram=: halted on the node, in the one paragraph.
    cards.set_apps([{"uuid": held["uuid"], "pid": worker["pid"], "used_mib": 3000}])
    halted = kernel.run(
        "try:\n    job.result(60)\nexcept Exception as e:\n    print(type(e).__name__, e)",
        check=True,
    ).stdout
    assert halted.startswith("ClaimHalted"), halted
    assert f"on card {worker['card']}" in halted, halted
    assert "over its card memory budget of 2.0GB a card" in halted
    assert gone(worker["pid"])
    cards.set_apps([])


def test_gpu_ram_alone_on_ray_is_granted_as_the_fraction_of_the_nodes_card_it_is(node):
    """Guards against ``gpu_ram=`` without ``gpus=`` refused on Ray, or granted a whole
    card: the node's own card says how big it is, Ray grants that share of a card, and
    the frameworks and the budget on the node hold the claim to its bytes."""
    kernel, _ = node
    go = tempfile.mktemp(prefix="fluksio-go-")
    msg_id = kernel.client.execute(
        "%%claim gpu_ram=10G --on ray --background --label slice\n"
        "import json, os, time\n"
        "print(json.dumps({'cards': os.environ['CUDA_VISIBLE_DEVICES'], "
        "'share': os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'), "
        "'torch': os.environ.get('FLUKSIO_GPU_MEMORY_FRACTION')}), flush=True)\n"
        f"while not os.path.exists({go!r}):\n"
        "    time.sleep(0.05)\n"
    )
    said = kernel.messages_of(msg_id, until=printed("}"), timeout=120, past_idle=True).stdout
    kernel.run("job = _", check=True)
    worker = json.loads(said[said.index("{") :])
    card_bytes = 40960 * 2**20
    assert worker["cards"] in ("0", "1"), "one card, Ray's to pick"
    share = f"{10 * 10**9 / card_bytes:.3f}"
    assert (worker["share"], worker["torch"]) == (share, share)
    # Ray holds that share of a card while it runs, rounded up to its precision.
    asked = math.ceil(10 * 10**9 / card_bytes * 10_000) / 10_000
    held = kernel.facts("round(2 - ray.available_resources().get('GPU', 0), 4)")
    assert held == asked
    budget = kernel.facts(
        "job._claim.status.budget.gpu_bytes if job._claim.status.budget else None"
    )
    assert budget == 10 * 10**9
    # Which says whether an MPS control daemon runs: none of another test's.
    with held_across_suites(MPS_DAEMON, shared=True):
        said = kernel.facts("__import__('fluksio_nb.status').status.describe(job._claim.status)")
    assert f"a slice of card {worker['cards']} (gpu_ram=10.0GB, compute shared by time, " in said
    assert "CUDA_VISIBLE_DEVICES only)" in said, "Ray holds a task's cards by the variable alone"
    open(go, "w").close()
    try:
        assert kernel.run("job.result(60); print('done')", check=True).stdout.strip() == "done"
    finally:
        os.unlink(go)
