"""A share the OS enforces, against one only the thread variables ask for.

A greedy cell ignores every variable: it starts four busy processes and
forces eight BLAS threads. With enforcement on (the defaults: ``pin_cores``,
and kernels started through the fair-share provisioner, as a Jupyter server
with fluksio_nb starts them), its whole process tree runs on the claim's one
core and the kernel's threads stay off it; with it off (``pin_cores`` and
``fair_share`` false), everything runs wherever the scheduler puts it.
Measured side by side in one run, the two alternating, each against its
own baseline:

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
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from bench.harness import percentile, scratch, table
from bench.overload import alone, probe_while
from fluksio_nb.budget import human
from tests.kernels import Kernel

#: Everything a cell can do to take more than its share, until ``stop`` exists.
GREEDY = """%%claim cpus=1 --background --label greedy
import multiprocessing, os, threadpoolctl, numpy

def spin(stop):
    while not os.path.exists(stop):
        for _ in range(10_000):
            pass

threadpoolctl.threadpool_limits(8)
with multiprocessing.get_context("fork").Pool(4) as pool:
    waiting = pool.map_async(spin, [{stop!r}] * 4)
    a = numpy.random.rand(500, 500)
    a @ a
    open({ready!r}, "w").close()
    while not os.path.exists({stop!r}):
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


#: One call that asks for far more than its budget, faster than any poll:
#: how it ended, which one stopped it, and the peak the claim reports.
FAST_ALLOCATOR = """
import json, numpy
from fluksio_nb import claim
from fluksio_nb.errors import ClaimHalted
ending, by = "ok", "-"
try:
    with claim(ram="300M") as c:
        c.run(numpy.ones, 2 * 10**9 // 8)
except ClaimHalted as halted:
    ending, by = "halted", halted.decision.enforced_by
print(json.dumps({"ending": ending, "by": by, "peak": c.status.readings.peak_rss_bytes,
                  "budget": c.budget.applied_bytes, "held": str(c.status.memory_enforcement)}))
"""


def _kernel(directory: str, name: str, **env: str) -> Kernel:
    """A kernel started as a Jupyter server with fluksio_nb starts one."""
    from jupyter_client.provisioning import KernelProvisionerFactory

    from fluksio_nb.provisioner import PROVISIONER_NAME

    KernelProvisionerFactory.instance().default_provisioner_name = PROVISIONER_NAME
    config = Path(directory) / f"{name}.json"
    return Kernel(
        FLUKSIO_LEDGER=f"{directory}/{name}-ledger",
        FLUKSIO_CONFIG=str(config),
        **env,
    )


@contextmanager
def greedy(kernel: Kernel) -> Iterator[None]:
    """A greedy claim in the background, all of it busy, for as long as the block lasts."""
    with tempfile.TemporaryDirectory() as marks:
        ready, stop = Path(marks) / "ready", Path(marks) / "stop"
        kernel.start_job(GREEDY.format(ready=str(ready), stop=str(stop)), "greedy")
        while not ready.exists():
            time.sleep(0.01)
        try:
            yield
        finally:
            stop.touch()
            kernel.run("greedy.result()", check=True)


def greedy_beside_the_kernel(kernel: Kernel, seconds: float) -> list[float]:
    """The kernel's round trips while a greedy claim runs."""
    with greedy(kernel):
        until = time.monotonic() + seconds
        return probe_while(kernel, lambda: time.monotonic() < until)


def polite_rate(kernel: Kernel, seconds: float, beside_greedy: bool) -> float:
    """The polite claim's throughput, alone or with a greedy claim on the other core."""
    with greedy(kernel) if beside_greedy else nullcontext():
        kernel.run(POLITE.format(seconds=seconds), check=True)
    return kernel.facts("rate")


def fast_allocations(directory: str, repeats: int) -> list[list[str]]:
    """The fast allocator's peak against its budget, with the memory cap on and off."""
    rows = []
    for on in (True, False):
        kernel = _kernel(directory, f"cap-{on}", FLUKSIO_MEMORY_CAP=str(on).lower())
        try:
            runs = [kernel.run(FAST_ALLOCATOR, check=True).json() for _ in range(repeats)]
        finally:
            kernel.shutdown()
        peaks = sorted(run["peak"] for run in runs)
        budget = runs[0]["budget"]
        rows.append(
            [
                f"memory cap {'on' if on else 'off'}: {runs[0]['held']}",
                ", ".join(sorted({f"{run['ending']} by {run['by']}" for run in runs})),
                f"{human(budget)}",
                " / ".join(human(peak) for peak in peaks),
                f"{peaks[-1] / budget:.2f}",
            ]
        )
    return rows


def main(seconds: float = 3.0, repeats: int = 3) -> str:
    idle = {True: [], False: []}
    busy = {True: [], False: []}
    alone_rate = {True: [], False: []}
    beside_rate = {True: [], False: []}
    with scratch() as directory:
        switches = {
            on: {"FLUKSIO_PIN_CORES": str(on).lower(), "FLUKSIO_FAIR_SHARE": str(on).lower()}
            for on in (True, False)
        }
        kernels = {on: _kernel(directory, f"pin-{on}", **switches[on]) for on in (True, False)}
        unreserved = {
            on: _kernel(directory, f"unreserved-{on}", FLUKSIO_RESERVE_CPUS="0", **switches[on])
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
        memory = fast_allocations(directory, repeats)
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
    text += "\n\n" + table(
        [
            f"2 GB in one numpy.ones under ram=300M ({repeats} runs)",
            "ended",
            "budget",
            "peak per run",
            "worst peak / budget",
        ],
        memory,
    )
    return f"### A share the OS enforces\n\n{text}\n"


if __name__ == "__main__":
    print(main())
