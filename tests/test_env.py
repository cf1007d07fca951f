"""What a claim's worker is told, and that it really reaches a process.

The failure guarded against: a share that exists in the books but not in the
worker's environment, so numpy still starts a thread per core and CUDA still
sees every card.
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from fluksio_nb.books import Allocation, ResourceAccountant
from fluksio_nb.env import THREAD_VARS, derive_env, fair_share_env, worker_environ
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.resources import Resources


def test_the_share_becomes_every_thread_limit():
    env = derive_env(Resources(cpus=3), Allocation(cpus=3))
    assert {var: env[var] for var in THREAD_VARS} == dict.fromkeys(THREAD_VARS, "3")
    for var in ("BLIS_NUM_THREADS", "NUMBA_NUM_THREADS", "LOKY_MAX_CPU_COUNT"):
        assert env[var] == "3"


def test_a_gpu_claim_is_told_which_cards_are_its_own():
    env = derive_env(Resources(gpus=2), Allocation(cpus=1, gpus=(1, 3)))
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_gpu_claim_takes_card_memory_as_it_goes_unless_the_claim_says_otherwise():
    """JAX and TensorFlow otherwise take most of the card's memory the moment they start."""
    env = derive_env(Resources(gpus=1), Allocation(cpus=1, gpus=(0,)))
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    said = Resources(gpus=1, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})
    assert (
        derive_env(said, Allocation(cpus=1, gpus=(0,)))["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    )
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in derive_env(Resources(), Allocation(cpus=1))


def test_a_gpu_claim_may_not_name_its_own_card():
    """CUDA_VISIBLE_DEVICES beside gpus= silently replaced the card the books granted."""
    with pytest.raises(ValueError, match="drop it and let gpus= pick a free card"):
        Resources(gpus=1, env={"CUDA_VISIBLE_DEVICES": "7"})
    assert Resources(env={"CUDA_VISIBLE_DEVICES": "7"}).env == {"CUDA_VISIBLE_DEVICES": "7"}


def test_a_claim_without_gpus_sees_no_card_at_all():
    """Leaving every card visible would let a CPU cell create a context on card 0."""
    env = derive_env(Resources(), Allocation(cpus=1))
    assert env["CUDA_VISIBLE_DEVICES"] == ""


def test_what_the_claim_asked_for_wins():
    """A declaration outranks what the allocation implies; it is deliberate."""
    wanted = Resources(cpus=4, env={"OMP_NUM_THREADS": "1", "XLA_FLAGS": "--xla_cpu_x=false"})
    env = derive_env(wanted, Allocation(cpus=4))
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["XLA_FLAGS"] == "--xla_cpu_x=false"
    assert env["MKL_NUM_THREADS"] == "4"


def test_the_worker_environment_is_the_kernels_with_the_share_on_top():
    merged = worker_environ({"OMP_NUM_THREADS": "2"}, {"PATH": "/bin", "OMP_NUM_THREADS": "64"})
    assert merged == {"PATH": "/bin", "OMP_NUM_THREADS": "2"}


def test_work_that_declared_nothing_gets_a_fair_share():
    env = fair_share_env(cpus=8, workers=4)
    assert all(env[var] == "2" for var in THREAD_VARS)
    assert fair_share_env(cpus=2, workers=8)["OMP_NUM_THREADS"] == "1"


def test_a_user_who_set_one_keeps_it(monkeypatch):
    """An explicit value in the kernel's environment is an answer, not a default."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = fair_share_env(cpus=16, workers=2)
    assert "OMP_NUM_THREADS" not in env
    assert env["MKL_NUM_THREADS"] == "8"


def test_a_kernel_about_to_start_keeps_what_its_own_environment_says():
    """Guards against reading the server's environment for a kernel given another one."""
    env = fair_share_env(cpus=4, workers=1, environ={"OPENBLAS_NUM_THREADS": "3"})
    assert "OPENBLAS_NUM_THREADS" not in env
    assert env["OMP_NUM_THREADS"] == "4"


_REPORT = (
    "import json, os, time; time.sleep(0.2); "
    "print(json.dumps({v: os.environ.get(v) for v in "
    "['OMP_NUM_THREADS', 'XLA_FLAGS', 'CUDA_VISIBLE_DEVICES']}))"
)


def test_claimed_processes_are_held_to_their_share():
    """Four processes wanting two cores each, on books of four.

    The pair that together is the oversubscription: never more than the
    machine has in flight at once, and every process told what it was given.
    """
    q = ClaimQueue(ResourceAccountant(cpus=4))
    wanted = Resources(cpus=2, env={"XLA_FLAGS": "--x=false"})
    answers: list[dict] = []
    in_flight: list[int] = []
    finished = threading.Event()

    def once():
        with q.claim(wanted) as allocation:
            env = worker_environ(derive_env(wanted, allocation))
            out = subprocess.run(
                [sys.executable, "-c", _REPORT], env=env, capture_output=True, text=True
            )
            answers.append(json.loads(out.stdout))

    def watch():
        while not finished.is_set():
            in_flight.append(4 - q.snapshot()["cpus"]["free"])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=once) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a claim deadlocked"
    finished.set()
    watcher.join()

    expected = {
        "OMP_NUM_THREADS": "2",
        "XLA_FLAGS": "--x=false",
        "CUDA_VISIBLE_DEVICES": "",
    }
    assert answers == [expected] * 4
    assert max(in_flight) == 4, "two claims of two cores should have run together"
    assert q.snapshot()["cpus"]["free"] == 4
    assert os.environ.get("XLA_FLAGS") is None, "the kernel's own environment is untouched"


def test_a_card_memory_budget_is_handed_to_jax_and_torch_as_a_share_of_the_smallest_card():
    wanted = Resources(gpus=2, gpu_ram="4G")
    env = derive_env(wanted, Allocation(cpus=1, gpus=(0, 1)), {0: 16 * 10**9, 1: 8 * 10**9})
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.500"
    assert env["FLUKSIO_GPU_MEMORY_FRACTION"] == "0.500"


def test_a_card_memory_budget_without_the_cards_sizes_sets_no_share():
    env = derive_env(Resources(gpus=1, gpu_ram="4G"), Allocation(cpus=1, gpus=(0,)), {})
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
    assert "FLUKSIO_GPU_MEMORY_FRACTION" not in env
