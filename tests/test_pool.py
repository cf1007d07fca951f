"""The warm pool: reuse by environment, and never a worker kept that should go.

The failures guarded against: a cell run in a worker whose thread variables
belong to another claim shape, a CUDA context kept alive on a card after its
claim gave it back, idle interpreters piling up, and workers outliving the pool.
"""

import time

import pytest

from fluksio_nb.worker.pool import WorkerPool

pytestmark = pytest.mark.timeout(60)

ONE = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
TWO = {"OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""}
CARD = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0"}


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


def test_another_environment_gets_another_worker(pool):
    first = pool.checkout(ONE)
    pool.checkin(first, ONE)
    second = pool.checkout(TWO)
    assert second is not first
    assert second.run("import os\nt = os.environ['OMP_NUM_THREADS']", outputs=["t"]).outputs == {
        "t": "2"
    }
    pool.checkin(second, TWO)


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
