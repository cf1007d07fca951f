"""Several real kernels on one machine, one card between them.

This is the case the project exists for: notebooks that each believe they own
"GPU 0". Each test starts real ipykernels sharing one books service, as JupyterLab
would, and checks what the users of those notebooks would see.
"""

import signal
import time
from pathlib import Path

import pytest

from tests.kernels import Kernel, shut_down_at_the_end, until_it_exists

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


def start_gpu_job(kernel: Kernel, label: str, until: Path) -> None:
    """A ``gpus=1`` background claim that holds the card until the file ``until`` exists."""
    kernel.start_job(
        f"%%claim gpus=1 --background --label {label}\n"
        f"import time\nstart = time.time()\n{until_it_exists(until)}end = time.time()",
        "job",
    )


@pytest.fixture
def released(tmp_path) -> Path:
    """A file that is there from the start: a job told to hold until it exists ends at once."""
    path = tmp_path / "released"
    path.touch()
    return path


def test_a_second_kernels_gpu_cell_waits_for_the_first(kernels, tmp_path, released):
    first, second = kernels(), kernels()
    go = tmp_path / "go"
    start_gpu_job(first, "first", until=go)
    start_gpu_job(second, "second", until=released)
    books = second.books()
    assert [w["label"] for w in books["waiting"]] == ["second"]
    assert [r["label"] for r in books["running"]] == ["first"]
    go.touch()
    first_end = first.facts("job.result(30)['end']")
    second_start = second.facts("job.result(30)['start']")
    assert second_start >= first_end


def test_killing_the_holding_kernel_lets_the_next_one_run(kernels, tmp_path, released):
    first, second = kernels(), kernels()
    start_gpu_job(first, "doomed", until=tmp_path / "never")
    start_gpu_job(second, "next", until=released)
    assert second.facts("job.status") == "waiting"
    first.manager.signal_kernel(signal.SIGKILL)
    killed = time.time()
    # How soon is bench.books' to measure; here, that it comes at all, and only
    # once the holder is gone.
    start = second.facts("job.result(30)['start']")
    assert start >= killed, "the next claim ran while the killed kernel still held the share"


def test_claims_queue_first_come_first_served_across_three_kernels(kernels, tmp_path, released):
    holder, *others = kernels(), kernels(), kernels()
    go = tmp_path / "go"
    start_gpu_job(holder, "holder", until=go)
    for index, kernel in enumerate(others):
        # Its place is taken before the cell returns: the next one queues behind it.
        start_gpu_job(kernel, f"k{index}", until=released)
    waiting = holder.books()["waiting"]
    assert [w["label"] for w in waiting] == ["k0", "k1"]
    go.touch()
    starts = [kernel.facts("job.result(30)['start']") for kernel in others]
    assert starts == sorted(starts)


def test_the_books_record_who_holds_what(kernels, tmp_path):
    kernel = kernels()
    go = tmp_path / "go"
    start_gpu_job(kernel, "recorded", until=go)
    running = kernel.books()["running"]
    assert running[0]["pid"] == kernel.pid
    assert running[0]["kernel_id"] and running[0]["user"]
    assert running[0]["allocation"]["gpus"] == [0]
    go.touch()
    kernel.facts("job.result(30) and 1")
