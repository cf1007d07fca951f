"""What ``%%claim --on ray`` costs over a bare Ray task on the same cluster.

Run by hand, not by the test suite: ``.venv/bin/python bench/ray_overhead.py``.

A real kernel starts a local Ray (2 CPUs, 256 MB of object store, its state
in a temporary directory) and runs each workload two ways, alternating, as
notebook cells: once as ``%%claim cpus=1 --on ray`` and once as the same code
in a function sent with ``ray.get(fn.options(num_cpus=1).remote(...))``. Both
are timed from the front end's side, execute request to idle, so what the
kernel's messaging costs is in both. Each way is warmed up first (Ray starts
worker processes on first use, and a claim's worker starts once per shape),
then the medians of the timed rounds are compared.

The bare task is what a user would write by hand: no thread variables in its
``runtime_env``, no output relayed while it runs, its result not brought back
as names. Those are what the claim adds, so they are what is measured.

The local Ray is one machine, so a claim's values go through the kernel's
shared memory rather than the object store (:mod:`fluksio_nb.ray.claim`); on a
cluster of several machines they go by the object store, as a bare task's do.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernels import Kernel

#: name -> (setup run once in the kernel, the cell's body, the names it reads)
WORKLOADS = {
    "empty cell": ("", "result = 1", ()),
    "0.1 s asleep": ("", "import time\ntime.sleep(0.1)\nresult = 1", ()),
    "0.5 s of numpy": (
        "import numpy as np\na = np.random.default_rng(0).random((300, 300))",
        "import time\n_t = time.perf_counter()\nb = a\n"
        "while time.perf_counter() - _t < 0.5:\n    b = (b @ a) / 300\nresult = float(b.sum())",
        ("a",),
    ),
    "8 MB in, 8 MB out": (
        "import numpy as np\nv = np.ones(1_000_000)",
        "result = v * 2",
        ("v",),
    ),
}


def timed(kernel: Kernel, cell: str) -> float:
    started = time.perf_counter()
    kernel.run(cell, check=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    arguments = parser.parse_args()

    state = tempfile.mkdtemp(prefix="fluksio-ray-")
    kernel = Kernel(
        RAY_TMPDIR=state, RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED="0"
    )
    try:
        kernel.run(
            "import ray\n"
            f"ray.init(num_cpus=2, include_dashboard=False, _temp_dir={state!r}, "
            "object_store_memory=256 * 2**20, _node_ip_address='127.0.0.1', log_to_driver=False)",
            check=True,
        )
        print(f"{'workload':<20} {'bare task':>10} {'--on ray':>10} {'ratio':>7} {'overhead':>9}")
        for name, (setup, body, reads) in WORKLOADS.items():
            if setup:
                kernel.run(setup, check=True)
            args = ", ".join(reads)
            fn = f"def _bare({args}):\n" + "".join(f"    {line}\n" for line in body.splitlines())
            kernel.run(f"{fn}    return result\n_bare_remote = ray.remote(_bare)", check=True)
            bare = f"result = ray.get(_bare_remote.options(num_cpus=1).remote({args}))"
            claimed = f"%%claim cpus=1 --on ray\n{body}"
            for _ in range(2):  # warm up both ways
                timed(kernel, bare)
                timed(kernel, claimed)
            bare_s, claimed_s = [], []
            for _ in range(arguments.rounds):
                bare_s.append(timed(kernel, bare))
                claimed_s.append(timed(kernel, claimed))
            b, c = statistics.median(bare_s), statistics.median(claimed_s)
            print(
                f"{name:<20} {b * 1000:>8.0f}ms {c * 1000:>8.0f}ms {c / b:>6.2f}x "
                f"{(c - b) * 1000:>7.0f}ms"
            )
        kernel.run("ray.shutdown()", check=True)
    finally:
        kernel.shutdown()
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
