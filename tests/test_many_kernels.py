"""Several real kernels on one machine, one card between them.

This is the case the project exists for: notebooks that each believe they own
"GPU 0". Each test starts real ipykernels sharing one ledger, as JupyterLab
would, and checks what the users of those notebooks would see.
"""

import signal
import time

import pytest

from tests.kernels import Kernel, shut_down_at_the_end

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def kernels(tmp_path):
    def start() -> Kernel:
        return Kernel(
            FLUKSIO_CPUS="4",
            FLUKSIO_GPUS="1",
            FLUKSIO_RESERVE_CPUS="0",
            FLUKSIO_CONFIG=str(tmp_path / "fluksio_nb.json"),
            FLUKSIO_LEDGER=str(tmp_path / "ledger"),
        )

    with shut_down_at_the_end(start) as started:
        yield started


def start_gpu_job(kernel: Kernel, seconds: float, label: str) -> None:
    kernel.start_job(
        f"%%claim gpus=1 --background --label {label}\n"
        f"import time\nstart = time.time()\ntime.sleep({seconds})\nend = time.time()",
        "job",
    )


def test_a_second_kernels_gpu_cell_waits_for_the_first(kernels):
    first, second = kernels(), kernels()
    start_gpu_job(first, 2, "first")
    time.sleep(0.5)
    start_gpu_job(second, 0.1, "second")
    books = second.books()
    assert [w["label"] for w in books["waiting"]] == ["second"]
    assert [r["label"] for r in books["running"]] == ["first"]
    first_end = first.facts("job.result(30)['end']")
    second_start = second.facts("job.result(30)['start']")
    assert second_start >= first_end


def test_killing_the_holding_kernel_lets_the_next_one_run(kernels):
    first, second = kernels(), kernels()
    start_gpu_job(first, 60, "doomed")
    time.sleep(0.5)
    start_gpu_job(second, 0.1, "next")
    assert second.facts("job.status") == "waiting"
    first.manager.signal_kernel(signal.SIGKILL)
    killed = time.time()
    start = second.facts("job.result(30)['start']")
    assert start - killed < 2.0, "a dead kernel's share must be reclaimed within two seconds"


def test_claims_queue_first_come_first_served_across_three_kernels(kernels):
    holder, *others = kernels(), kernels(), kernels()
    start_gpu_job(holder, 1.5, "holder")
    for index, kernel in enumerate(others):
        time.sleep(0.3)
        start_gpu_job(kernel, 0.2, f"k{index}")
    waiting = holder.books()["waiting"]
    assert [w["label"] for w in waiting] == ["k0", "k1"]
    starts = [kernel.facts("job.result(30)['start']") for kernel in others]
    assert starts == sorted(starts)


def test_the_ledger_records_who_holds_what(kernels):
    kernel = kernels()
    start_gpu_job(kernel, 1, "recorded")
    running = kernel.books()["running"]
    assert running[0]["pid"] == kernel.pid
    assert running[0]["kernel_id"] and running[0]["user"]
    assert running[0]["allocation"]["gpus"] == [0]
    kernel.facts("job.result(30) and 1")
