"""A share the OS enforces, against one only the thread variables ask for.

A greedy cell ignores every variable: it starts four busy processes and
forces eight BLAS threads. With enforcement on (``pin_cores``, the default),
its whole process tree runs on the claim's one core; with it off, it runs
wherever the scheduler puts it. Measured side by side in one run, the two
alternating, each against its own baseline:

- the kernel's round trip for a trivial cell (p99) while the greedy claim
  runs, against the same kernel idle;
- with no reserve (``FLUKSIO_RESERVE_CPUS=0``), a well-behaved BLAS claim's
  throughput on one core while the greedy claim holds the other, against
  the same claim alone;
- the peak memory of a cell that allocates far past its ``ram=`` in one
  call, with the memory cap on and with only the sampler watching.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench.harness import percentile, table
from bench.overload import alone, probe_while
from tests.kernels import Kernel

#: Everything a cell can do to take more than its share, for ``seconds``.
GREEDY = """%%claim cpus=1 --background --label greedy
import multiprocessing, time, threadpoolctl, numpy

def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass

threadpoolctl.threadpool_limits(8)
with multiprocessing.get_context("fork").Pool(4) as pool:
    waiting = pool.map_async(spin, [{seconds}] * 4)
    a = numpy.random.rand(500, 500)
    a @ a
    open({ready!r}, "w").close()
    end = time.monotonic() + {seconds}
    while time.monotonic() < end:
        a @ a
    waiting.get()
"""

#: A claim that keeps to its share: matrix products per second on one thread.
POLITE = """%%claim cpus=1 --label polite --out rate
import time, numpy
a = numpy.random.default_rng(0).random((400, 400))
a @ a
done, started = 0, time.perf_counter()
while time.perf_counter() - started < {seconds}:
    a @ a
    done += 1
rate = done / (time.perf_counter() - started)
"""


def _kernel(directory: str, name: str, **env: str) -> Kernel:
    config = Path(directory) / f"{name}.json"
    return Kernel(
        FLUKSIO_LEDGER=f"{directory}/{name}-ledger",
        FLUKSIO_CONFIG=str(config),
        **env,
    )


def start_greedy(kernel: Kernel, seconds: float) -> None:
    """A greedy claim in the background, returning once all of it is busy."""
    with tempfile.TemporaryDirectory() as marks:
        ready = Path(marks) / "ready"
        kernel.start_job(GREEDY.format(seconds=seconds, ready=str(ready)), "greedy")
        while not ready.exists():
            time.sleep(0.01)


def greedy_beside_the_kernel(kernel: Kernel, seconds: float) -> list[float]:
    """The kernel's round trips while a greedy claim runs."""
    start_greedy(kernel, seconds + 0.5)
    until = time.monotonic() + seconds
    latencies = probe_while(kernel, lambda: time.monotonic() < until)
    kernel.run("greedy.result()", check=True)
    return latencies


def polite_rate(kernel: Kernel, seconds: float, beside_greedy: bool) -> float:
    """The polite claim's throughput, alone or with a greedy claim on the other core."""
    if beside_greedy:
        # Longer than the polite claim, counting its worker's start.
        start_greedy(kernel, seconds + 2.0)
    kernel.run(POLITE.format(seconds=seconds), check=True)
    rate = kernel.facts("rate")
    if beside_greedy:
        kernel.run("greedy.result()", check=True)
    return rate


def main(seconds: float = 3.0, repeats: int = 3) -> str:
    idle = {True: [], False: []}
    busy = {True: [], False: []}
    alone_rate = {True: [], False: []}
    beside_rate = {True: [], False: []}
    with tempfile.TemporaryDirectory() as directory:
        kernels = {
            on: _kernel(directory, f"pin-{on}", FLUKSIO_PIN_CORES=str(on).lower())
            for on in (True, False)
        }
        unreserved = {
            on: _kernel(
                directory,
                f"unreserved-{on}",
                FLUKSIO_PIN_CORES=str(on).lower(),
                FLUKSIO_RESERVE_CPUS="0",
            )
            for on in (True, False)
        }
        try:
            for _ in range(repeats):
                for on in (True, False):
                    idle[on] += alone(kernels[on], seconds / 2)
                    busy[on] += greedy_beside_the_kernel(kernels[on], seconds)
                    alone_rate[on].append(polite_rate(unreserved[on], seconds, False))
                    beside_rate[on].append(polite_rate(unreserved[on], seconds, True))
        finally:
            for kernel in [*kernels.values(), *unreserved.values()]:
                kernel.shutdown()
    rows = []
    for on in (True, False):
        name = "on (own cores)" if on else "off (thread variables only)"
        p99_idle, p99_busy = percentile(idle[on], 0.99), percentile(busy[on], 0.99)
        rate_alone = statistics.median(alone_rate[on])
        rate_beside = statistics.median(beside_rate[on])
        rows.append(
            [
                name,
                f"{p99_idle * 1e3:.1f} ms",
                f"{p99_busy * 1e3:.1f} ms",
                f"{p99_busy / p99_idle:.2f}",
                f"{rate_alone:.1f}/s",
                f"{rate_beside:.1f}/s",
                f"{rate_beside / rate_alone:.2f}",
            ]
        )
    text = table(
        [
            f"enforcement ({repeats} runs of {seconds:g} s)",
            "kernel p99 idle",
            "kernel p99, greedy claim running",
            "ratio (target ≤ 1.5)",
            "polite claim alone",
            "beside the greedy claim (no reserve)",
            "ratio (target ≥ 0.9)",
        ],
        rows,
    )
    return f"### A share the OS enforces\n\n{text}\n"


if __name__ == "__main__":
    print(main())
