"""The overload story: BLAS jobs at twice the cores, unmanaged and claimed.

This is why the project exists. Each numpy process sizes its thread pool to
every core, so 2 × cores jobs run 2 × cores² threads on the machine and the
kernel the user is typing into stops answering. The same jobs as
``%%claim cpus=1 --background`` cells run one thread each, as many at a time
as the books allow, with the reserve kept for the kernel.

Measured side by side in one run: the kernel's round trip for a trivial
cell, every 50 ms while the jobs run (p50, p99), and the jobs' throughput
(matrix products per second over all of them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import percentile, table
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
    """Round trips of a trivial cell, one every 50 ms, while ``busy()`` is true."""
    samples = []
    while busy():
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


def main(n: int = 1000, k: int = 20) -> str:
    cores = os.cpu_count() or 1
    jobs = 2 * cores
    with tempfile.TemporaryDirectory() as ledger:
        kernel = Kernel(FLUKSIO_LEDGER=ledger, FLUKSIO_CONFIG=f"{ledger}/none.json")
        try:
            free_latency, free_rate = unmanaged(kernel, jobs, n, k)
            claim_latency, claim_rate = claimed(kernel, jobs, n, k)
            books = kernel.books()
        finally:
            kernel.shutdown()
    claimable = books["cpus"]["total"]
    rows = [
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
        [f"{jobs} matmul jobs ({n}×{n}, {k} each)", "kernel p50", "kernel p99", "throughput"],
        rows,
    )
    text += (
        f"\n\n- claimed p99 / unmanaged p99: {p99_ratio:.3f} (target ≤ 0.2)\n"
        f"- claimed / unmanaged throughput: {rate_ratio:.3f} "
        f"(target ≥ 0.9 × {claimable}/{cores} claimable cores = {floor:.2f})\n"
    )
    return f"### The overload story\n\n{text}"


if __name__ == "__main__":
    print(main())
