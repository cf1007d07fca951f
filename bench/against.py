"""This checkout against another, the same claimed cells interleaved: what a change cost.

Run by hand, for a change that should cost nothing (a restructure) or that
claims to save something: ``.venv/bin/python -m bench.against OTHER_CHECKOUT``.

One kernel runs this checkout's ``fluksio_nb`` and another the other
checkout's, each by its own ``PYTHONPATH`` and with books of its own, started
alike. Each cell runs once on each per round, in a shuffled order
(:func:`bench.harness.interleaved`), so drift in a noisy machine hits both
alike, and the ratio of the medians is the figure to read: about 1.0 is the
same speed. ``--ray`` adds a cell ``--on ray``, each kernel with a local Ray
of its own, since a Ray worker imports whichever ``fluksio_nb`` its raylet
sees.
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import interleaved, median, ms, scratch, table
from tests.kernels import Kernel

HERE = Path(__file__).resolve().parents[1]

#: name -> the cell, timed from execute request to idle.
CELLS = {
    "trivial claimed cell": "%%claim cpus=1\nx = 1",
    "claimed cell importing numpy": "%%claim cpus=1\nimport numpy\nx = 1",
    "64 MiB in and back": "%%claim cpus=1 --out b\nb = a",
    "with claim(): c.run(fn)": "with claim(cpus=1) as c:\n    c.run(int, '1')",
    "2000 prints": "%%claim cpus=1\nfor i in range(2000):\n    print(i)",
}
#: A claim no warm worker can take, a variable on its line that none was started
#: with (``{n}`` differs every time): what a cell pays for a fresh worker to start.
FRESH_WORKER_CELL = "%%claim cpus=1 BENCH_FRESH={n}\nx = 1"
FRESH_WORKER = "claimed cell on a fresh worker"
# The extension is loaded already: Kernel loads it as it starts.
SETUP = "import numpy\nfrom fluksio_nb import claim\na = numpy.ones(64 * 2**20 // 8)"
RAY_CELL = "%%claim cpus=1 --on ray\nresult = 1"


def start(checkout: Path, state: Path, ray: bool) -> Kernel:
    state.mkdir()
    kernel = Kernel(
        PYTHONPATH=str(checkout),
        FLUKSIO_LEDGER=str(state / "ledger"),
        FLUKSIO_CONFIG=str(state / "none.json"),
        RAY_TMPDIR=str(state),
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_USAGE_STATS_ENABLED="0",
    )
    kernel.run(SETUP, check=True)
    found = kernel.facts("__import__('fluksio_nb').__file__")
    if not str(found).startswith(str(checkout)):
        raise SystemExit(f"the kernel for {checkout} imported fluksio_nb from {found}")
    if ray:
        kernel.run(
            "import ray\n"
            f"ray.init(num_cpus=1, include_dashboard=False, _temp_dir={str(state)!r}, "
            "object_store_memory=128 * 2**20, _node_ip_address='127.0.0.1', "
            "log_to_driver=False)",
            check=True,
        )
    return kernel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.against", description=__doc__)
    parser.add_argument("other", type=Path, help="the other checkout (a git worktree)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--ray", action="store_true", help="add a cell --on ray")
    options = parser.parse_args(argv)
    other = options.other.resolve()
    cells = {**CELLS, **({"cell --on ray": RAY_CELL} if options.ray else {})}
    with scratch() as directory:
        # The kernels work outside both checkouts: an older worker looks for
        # its package in its working directory first.
        os.chdir(directory)
        kernels = {
            "this": start(HERE, Path(directory, "this"), options.ray),
            "other": start(other, Path(directory, "other"), options.ray),
        }
        try:
            actions = {
                (which, name): (lambda k=kernel, c=cell: k.run(c, check=True))
                for which, kernel in kernels.items()
                for name, cell in cells.items()
            }
            fresh = itertools.count()
            for which, kernel in kernels.items():
                actions[which, FRESH_WORKER] = lambda k=kernel: k.run(
                    FRESH_WORKER_CELL.format(n=next(fresh)), check=True
                )
            interleaved(actions, 2)  # warm: workers started, Ray's workers too
            samples = interleaved(actions, options.rounds)
        finally:
            for kernel in kernels.values():
                kernel.shutdown()
    rows = []
    # Each cell once, in the order the actions were made.
    for name in dict.fromkeys(name for _, name in samples):
        this, that = median(samples["this", name]), median(samples["other", name])
        rows.append([name, ms(that), ms(this), f"{this / that:.2f}"])
    print(f"this checkout ({HERE}) against {other}, {options.rounds} rounds, medians\n")
    print(table(["cell", "other", "this", "this / other"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
