"""The worker ``%load_ext`` starts ahead of the first claim, in real kernels.

The failures guarded against: a first claimed cell that starts a worker of its
own anyway, a worker handed to a claim with the thread variables or BLAS
threads of another shape, a warm worker reused where a library loaded in it
would keep the old count, and the idle worker that holds a share, or outlives
a kernel that shut down or was killed.
"""

import ctypes.util
import signal

import psutil
import pytest

from fluksio_nb.env import THREAD_VARS
from tests.kernels import Kernel, started_kernel
from tests.waiting import gone, wait_until

pytestmark = pytest.mark.timeout(180)

#: Two claimable cores, so that cpus=1 and cpus=2 are shapes of their own.
TWO_CORES = {"FLUKSIO_CPUS": "2", "FLUKSIO_RESERVE_CPUS": "0"}

#: Run in a claimed cell: where it runs, its thread variables, and BLAS's
#: thread count as the main thread and another thread read it.
FACTS = """
import json, os, threading, numpy, threadpoolctl
def blas():
    return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
other = []
reader = threading.Thread(target=lambda: other.extend(blas()))
reader.start(); reader.join()
del reader
print(json.dumps({
    "pid": os.getpid(),
    "env": sorted({os.environ[var] for var in THREAD_VARS}),
    "blas": {"main": blas(), "other": other},
}))
""".replace("THREAD_VARS", repr(THREAD_VARS))


def children(kernel: Kernel) -> list[psutil.Process]:
    try:
        return psutil.Process(kernel.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def the_idle_worker(kernel: Kernel) -> int:
    """The pid of the kernel's one child, once it is a worker and the only process it started."""

    def one_worker() -> bool:
        found = children(kernel)
        return len(found) == 1 and "fluksio_nb.worker.main" in " ".join(found[0].cmdline())

    assert wait_until(one_worker, timeout=60), [p.cmdline() for p in children(kernel)]
    return children(kernel)[0].pid


def claimed(kernel: Kernel, line: str, before: str = "") -> dict:
    return kernel.run(f"%%claim {line}\n{before}{FACTS}", check=True).json()


def test_the_first_claimed_cell_runs_in_the_worker_started_at_load_ext(tmp_path):
    with started_kernel(tmp_path, **TWO_CORES) as kernel:
        prestarted = the_idle_worker(kernel)
        facts = claimed(kernel, "")
        assert facts == {"pid": prestarted, "env": ["1"], "blas": {"main": [1], "other": [1]}}
        assert [p.pid for p in children(kernel)] == [prestarted], "and no other was started"


def test_a_first_claim_of_another_thread_count_takes_the_prestarted_worker_too(tmp_path):
    """The worker is started for the default claim; nothing in it has read that count yet."""
    with started_kernel(tmp_path, **TWO_CORES) as kernel:
        prestarted = the_idle_worker(kernel)
        facts = claimed(kernel, "cpus=2")
        assert facts == {"pid": prestarted, "env": ["2"], "blas": {"main": [2], "other": [2]}}


def test_a_new_cpus_shape_after_a_warm_one_reuses_its_worker_and_holds_openblas_to_it(tmp_path):
    """numpy loaded OpenBLAS at one thread in the warm worker: the new share reaches it."""
    with started_kernel(tmp_path, **TWO_CORES) as kernel:
        first = claimed(kernel, "cpus=1")
        assert first["env"] == ["1"] and first["blas"] == {"main": [1], "other": [1]}
        second = claimed(kernel, "cpus=2")
        assert second == {"pid": first["pid"], "env": ["2"], "blas": {"main": [2], "other": [2]}}
        back = claimed(kernel, "cpus=1")
        assert back == first, "and back again"


@pytest.mark.skipif(ctypes.util.find_library("gomp") is None, reason="needs libgomp")
def test_a_new_cpus_shape_starts_a_fresh_worker_when_the_warm_one_loaded_openmp(tmp_path):
    """OpenMP's count set from one thread holds for that thread only: the old count would leak."""
    load_openmp = "import ctypes, ctypes.util\nctypes.CDLL(ctypes.util.find_library('gomp'))\n"
    with started_kernel(tmp_path, **TWO_CORES) as kernel:
        first = claimed(kernel, "cpus=1", before=load_openmp)
        second = claimed(kernel, "cpus=2")
        assert second["pid"] != first["pid"]
        assert second["env"] == ["2"] and second["blas"] == {"main": [2], "other": [2]}
        assert claimed(kernel, "cpus=1")["pid"] == first["pid"], "kept for its own shape"


def test_a_notebook_that_never_claims_holds_no_share_and_its_worker_dies_with_a_killed_kernel(
    tmp_path,
):
    """Guards against the warm worker being a claim in the books, or outliving a kill -9."""
    with started_kernel(tmp_path, **TWO_CORES) as kernel:
        worker = the_idle_worker(kernel)
        books = kernel.books()
        assert books["running"] == [] and books["waiting"] == []
        assert books["cpus"]["free"] == books["cpus"]["total"] == 2
        kernel.manager.signal_kernel(signal.SIGKILL)
        assert gone(worker, within=10)


def test_the_prestarted_worker_ends_when_the_kernel_shuts_down(tmp_path):
    kernel = Kernel(
        FLUKSIO_CONFIG=str(tmp_path / "fluksio_nb.json"),
        FLUKSIO_LEDGER=str(tmp_path / "ledger"),
    )
    try:
        worker = the_idle_worker(kernel)
    finally:
        kernel.shutdown()
    assert gone(worker, within=10)


def test_with_warm_start_off_loading_the_extension_starts_no_process(tmp_path):
    with started_kernel(tmp_path, FLUKSIO_WARM_START="0") as kernel:
        # Over, so that anything it was going to start has been started.
        assert kernel.facts("__import__('fluksio_nb.warm_start').warm_start.wait(60)")
        assert children(kernel) == []
        assert kernel.run("%%claim\nx = 1", check=True).status == "ok"
