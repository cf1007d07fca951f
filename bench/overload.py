"""The overload story: BLAS jobs at twice the cores, unmanaged and claimed.

This is why the project exists. Each numpy process sizes its thread pool to
every core, so 2 × cores jobs run 2 × cores² threads on the machine and the
kernel the user is typing into stops answering. The same jobs as
``%%claim cpus=1 --background`` cells run one thread each, as many at a time
as the books allow, with the reserve kept for the kernel.

Measured side by side in one run: the kernel's round trip for a trivial
cell, every 50 ms while the jobs run (p50, p99), and the jobs' throughput
(matrix products per second over all of them). The two phases alternate
for a few runs and their probes are pooled, and the same probes of the
kernel with nothing running give the floor: no claim can make the kernel
answer faster than it does alone.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import percentile, scratch, table
from tests.kernels import Kernel

JOB = """
import time, numpy as np
a = np.random.default_rng(0).random(({n}, {n}))
start = time.time()
for _ in range({k}):
    a @ a
end = time.time()
"""

PROBE_EVERY_S = 0.05


def probe_while(kernel: Kernel, busy) -> list[float]:
    """Round trips of a trivial cell, one every 50 ms, while ``busy()`` is true.

    One probe at least: at a toy size the jobs may all be done before the
    first probe, and a phase with no probes has no percentiles.
    """
    samples: list[float] = []
    while not samples or busy():
        started = time.perf_counter()
        kernel.run("pass", check=True)
        took = time.perf_counter() - started
        samples.append(took)
        time.sleep(max(0.0, PROBE_EVERY_S - took))
    return samples


def unmanaged(kernel: Kernel, jobs: int, n: int, k: int) -> tuple[list[float], float]:
    code = JOB.format(n=n, k=k)
    started = time.time()
    processes = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(jobs)]
    latencies = probe_while(kernel, lambda: any(p.poll() is None for p in processes))
    wall = time.time() - started
    return latencies, jobs * k / wall


def claimed(kernel: Kernel, jobs: int, n: int, k: int) -> tuple[list[float], float]:
    kernel.run("jobs = []", check=True)
    with tempfile.TemporaryDirectory() as marks:
        # Each job marks its end in a file, so that telling whether they are
        # done costs the kernel nothing: asking it with a cell before every
        # probe doubled the cells it ran, and with them IPython's history
        # writes, whose lock a probe then waited on.
        done = Path(marks) / "done"
        tail = f"\nwith open({str(done)!r}, 'a') as mark:\n    mark.write('.')"
        started = time.time()
        for _ in range(jobs):
            cell = f"%%claim cpus=1 --background --out end\n{JOB.format(n=n, k=k)}{tail}"
            kernel.run(cell, check=True)
            kernel.run("jobs.append(_)", check=True)
        latencies = probe_while(kernel, lambda: not done.exists() or len(done.read_text()) < jobs)
    ends = kernel.facts("[j.result()['end'] for j in jobs]")
    return latencies, jobs * k / (max(ends) - started)


def alone(kernel: Kernel, seconds: float) -> list[float]:
    """The same probes with nothing else running: the floor both phases are read against."""
    until = time.monotonic() + seconds
    return probe_while(kernel, lambda: time.monotonic() < until)


def main(n: int = 1000, k: int = 20, repeats: int = 3) -> str:
    cores = os.cpu_count() or 1
    jobs = 2 * cores
    idle_latency: list[float] = []
    free_latency: list[float] = []
    claim_latency: list[float] = []
    free_rates: list[float] = []
    claim_rates: list[float] = []
    with scratch() as ledger:
        kernel = Kernel(FLUKSIO_LEDGER=ledger, FLUKSIO_CONFIG=f"{ledger}/none.json")
        try:
            # Alternated and pooled: one phase's p99 is its worst probe or
            # two, and how bad an unmanaged run gets varies several-fold from
            # one run to the next on a shared machine.
            for _ in range(repeats):
                idle_latency += alone(kernel, 1.0 if k >= 10 else 0.1)
                latencies, rate = unmanaged(kernel, jobs, n, k)
                free_latency, free_rates = free_latency + latencies, [*free_rates, rate]
                latencies, rate = claimed(kernel, jobs, n, k)
                claim_latency, claim_rates = claim_latency + latencies, [*claim_rates, rate]
            books = kernel.books()
        finally:
            kernel.shutdown()
    free_rate, claim_rate = statistics.median(free_rates), statistics.median(claim_rates)
    claimable = books["cpus"]["total"]
    rows = [
        [
            "no jobs: the kernel alone",
            f"{percentile(idle_latency, 0.5) * 1e3:.1f} ms",
            f"{percentile(idle_latency, 0.99) * 1e3:.1f} ms",
            "",
        ],
        [
            "unmanaged (library defaults)",
            f"{percentile(free_latency, 0.5) * 1e3:.1f} ms",
            f"{percentile(free_latency, 0.99) * 1e3:.1f} ms",
            f"{free_rate:.2f}/s",
        ],
        [
            "claimed (cpus=1, --background)",
            f"{percentile(claim_latency, 0.5) * 1e3:.1f} ms",
            f"{percentile(claim_latency, 0.99) * 1e3:.1f} ms",
            f"{claim_rate:.2f}/s",
        ],
    ]
    p99_ratio = percentile(claim_latency, 0.99) / percentile(free_latency, 0.99)
    rate_ratio = claim_rate / free_rate
    floor = 0.9 * claimable / cores
    text = table(
        [
            f"{jobs} matmul jobs ({n}×{n}, {k} each), {repeats} runs pooled",
            "kernel p50",
            "kernel p99",
            "throughput (median run)",
        ],
        rows,
    )
    text += (
        f"\n\n- claimed p99 / unmanaged p99: {p99_ratio:.3f} (target ≤ 0.2)\n"
        f"- claimed p99 / the kernel alone's p99: "
        f"{percentile(claim_latency, 0.99) / percentile(idle_latency, 0.99):.3f}\n"
        f"- claimed / unmanaged throughput: {rate_ratio:.3f} "
        f"(target ≥ 0.9 × {claimable}/{cores} claimable cores = {floor:.2f})\n"
    )
    return f"### The overload story\n\n{text}"


if __name__ == "__main__":
    print(main())
