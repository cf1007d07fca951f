"""The warm pool: reuse by environment, and never a worker kept that should go.

The failures guarded against: a cell run in a worker whose thread variables
or thread pools belong to another claim shape, a new shape paying for a fresh
Python when a warm worker could have taken it, a CUDA context kept alive on a
card after its claim gave it back, idle interpreters piling up, and workers
outliving the pool.
"""

import ctypes.util
import time

import pytest

from fluksio_nb.env import THREAD_VARS
from fluksio_nb.worker.pool import WorkerPool
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

ONE = {**{var: "1" for var in THREAD_VARS}, "CUDA_VISIBLE_DEVICES": ""}
TWO = {**{var: "2" for var in THREAD_VARS}, "CUDA_VISIBLE_DEVICES": ""}
CARD = {**ONE, "CUDA_VISIBLE_DEVICES": "0"}

#: Run in a worker: its thread variables, and BLAS's thread count as the
#: main thread and another thread read it, once numpy is loaded.
POOLS_AFTER_NUMPY = """
import os, threading, numpy, threadpoolctl
def blas():
    return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
other = []
reader = threading.Thread(target=lambda: other.extend(blas()))
reader.start(); reader.join()
facts = {
    "env": {var: os.environ[var] for var in THREAD_VARS},
    "blas": {"main": blas(), "other": other},
}
""".replace("THREAD_VARS", repr(THREAD_VARS))


@pytest.fixture
def pool():
    pool = WorkerPool()
    yield pool
    pool.close()


def test_the_same_environment_gets_the_same_warm_worker(pool):
    worker = pool.checkout(ONE)
    assert worker.run(
        "import os\nthreads = os.environ['OMP_NUM_THREADS']", outputs=["threads"]
    ).outputs == {"threads": "1"}
    pool.checkin(worker, ONE)
    assert pool.checkout(ONE) is worker
    assert pool.started == 1


def test_an_environment_that_differs_beyond_threads_gets_another_worker(pool):
    """A variable set on the claim's line may be read at any import: only a new worker has it."""
    first = pool.checkout(ONE)
    pool.checkin(first, ONE)
    second = pool.checkout({**ONE, "HF_HOME": "/elsewhere"})
    assert second is not first
    assert second.run("import os\nh = os.environ['HF_HOME']", outputs=["h"]).outputs == {
        "h": "/elsewhere"
    }


def test_a_new_thread_count_reuses_a_worker_that_loaded_no_thread_pool(pool):
    """Guards against every new cpus= paying for a fresh Python when nothing read the old count."""
    first = pool.checkout(ONE)
    first.run("x = 1")
    pool.checkin(first, ONE)
    second = pool.checkout(TWO)
    assert second is first and pool.started == 1 and pool.reshaped == 1
    assert second.run(POOLS_AFTER_NUMPY, outputs=["facts"]).outputs["facts"] == {
        "env": {var: "2" for var in THREAD_VARS},
        "blas": {"main": [2], "other": [2]},
    }
    pool.checkin(second, TWO)
    assert pool.checkout(TWO) is first, "it is kept under the shape it holds now"


def test_a_worker_with_openblas_loaded_takes_a_new_thread_count_into_openblas(pool):
    """OpenBLAS read the old count at load: threadpoolctl must set it, in every thread."""
    first = pool.checkout(ONE)
    assert first.run(POOLS_AFTER_NUMPY, outputs=["facts"]).outputs["facts"]["blas"] == {
        "main": [1],
        "other": [1],
    }
    pool.checkin(first, ONE)
    second = pool.checkout(TWO)
    assert second is first, pool.last_refusal
    facts = second.run(POOLS_AFTER_NUMPY, outputs=["facts"]).outputs["facts"]
    assert facts == {"env": {var: "2" for var in THREAD_VARS}, "blas": {"main": [2], "other": [2]}}


@pytest.mark.skipif(ctypes.util.find_library("gomp") is None, reason="needs libgomp")
def test_a_worker_with_openmp_loaded_keeps_its_shape_and_a_new_shape_starts_fresh(pool):
    """OpenMP's count, set from the main thread, holds for that thread only: not safe to reuse."""
    first = pool.checkout(ONE)
    first.run("import ctypes, ctypes.util\nctypes.CDLL(ctypes.util.find_library('gomp'))")
    pool.checkin(first, ONE)
    second = pool.checkout(TWO)
    assert second is not first and pool.started == 2 and pool.reshaped == 0
    assert "OpenMP" in pool.last_refusal
    assert second.run(POOLS_AFTER_NUMPY, outputs=["facts"]).outputs["facts"]["blas"] == {
        "main": [2],
        "other": [2],
    }
    pool.checkin(second, TWO)
    assert first.alive, "refusing is not dying: it still serves its own shape"
    assert first.run("import os\nt = os.environ['OMP_NUM_THREADS']", outputs=["t"]).outputs == {
        "t": "1"
    }
    pool.checkin(first, ONE)
    pool.last_refusal = None
    third = pool.checkout(TWO)
    assert third is second, "the worker that holds the shape already"
    fourth = pool.checkout({**ONE, "OMP_NUM_THREADS": "2"})
    assert fourth is not first and pool.started == 3
    assert pool.last_refusal is None, "a worker that refused is not asked again"


def test_the_prestarted_worker_serves_the_first_checkout_of_any_thread_count(pool):
    started = pool.prestart(ONE)
    assert started is not None and pool.prestart(ONE) is None, "one is enough"
    # Asked before it is ready: the checkout waits for it rather than start another.
    worker = pool.checkout(TWO)
    assert worker is started and pool.started == 0
    assert worker.run(
        "import os, json\nt = os.environ['OMP_NUM_THREADS']", outputs=["t"]
    ).outputs == {"t": "2"}
    pool.checkin(worker, TWO)


def test_the_prestarted_worker_does_not_age_out_until_it_has_run_a_claim():
    pool = WorkerPool(idle_ttl_s=0.05)
    try:
        kept = pool.prestart(ONE)
        ordinary = pool.checkout({**ONE, "HF_HOME": "/elsewhere"})
        pool.checkin(ordinary, {**ONE, "HF_HOME": "/elsewhere"})
        assert wait_until(lambda: not ordinary.alive, timeout=10)
        assert kept.alive and pool.idle() == 1
        assert pool.checkout(ONE) is kept
        pool.checkin(kept, ONE)
        assert wait_until(lambda: not kept.alive, timeout=10), "used once, it ages as the rest"
    finally:
        pool.close()


def test_a_worker_that_named_a_card_is_ended_on_checkin(pool):
    worker = pool.checkout(CARD)
    pool.checkin(worker, CARD)
    assert not worker.alive
    assert pool.idle() == 0


def test_idle_workers_are_bounded_oldest_first():
    pool = WorkerPool(max_idle=1)
    try:
        old, new = pool.checkout(ONE), pool.checkout(TWO)
        pool.checkin(old, ONE)
        pool.checkin(new, TWO)
        assert pool.idle() == 1
        # Ended off the caller's path: give it a moment.
        deadline = time.monotonic() + 10
        while old.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not old.alive and new.alive
    finally:
        pool.close()


def test_idle_workers_age_out():
    pool = WorkerPool(idle_ttl_s=0.3)
    try:
        worker = pool.checkout(ONE)
        pool.checkin(worker, ONE)
        deadline = time.monotonic() + 10
        while worker.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker.alive
        assert pool.idle() == 0
    finally:
        pool.close()


def test_closing_the_pool_ends_every_idle_worker():
    pool = WorkerPool()
    workers = [pool.checkout(ONE), pool.checkout(TWO)]
    pool.checkin(workers[0], ONE)
    pool.checkin(workers[1], TWO)
    pool.close()
    assert not any(worker.alive for worker in workers)
