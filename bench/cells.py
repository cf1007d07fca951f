"""Running a cell elsewhere, and moving data into it and back.

What a notebook user pays for ``%%claim``: the round trip of a trivial cell
and of a cell that imports numpy, from a real kernel, against a plain cell
and ``%%script python3`` (a fresh interpreter per cell, the usual way to get
a separate process); and the bandwidth of shipping a 256 MiB array in and
back, against numpy's own copy of it.
"""

from __future__ import annotations

import itertools
import secrets
import tempfile

from bench.harness import interleaved, median, ms, percentile, table
from tests.kernels import Kernel

TRIVIAL = "x = 1"
NUMPY = "import numpy\nx = 1"


#: Started in the kernel before the round trips, when the packages are there:
#: one ipyparallel engine and a local Ray, both already running when timed.
START_IPYPARALLEL = (
    "import ipyparallel as ipp\n"
    "cluster = ipp.Cluster(n=1)\n"
    "rc = cluster.start_and_connect_sync()\n"
    "rc.wait_for_engines(1, timeout=60)\n"
    "rc[:].activate()"
)
START_RAY = (
    "import os, ray\n"
    "ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, "
    "_temp_dir=os.environ['RAY_TMPDIR'])\n"
    "@ray.remote\n"
    "def trivial():\n    x = 1\n"
    "@ray.remote\n"
    "def with_numpy():\n    import numpy\n    x = 1\n"
    "ray.get([trivial.remote(), with_numpy.remote()])"
)


def available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def round_trips(kernel: Kernel, rounds: int, others: bool = True) -> tuple[str, dict[str, float]]:
    counter = itertools.count()

    def run(code: str):
        return lambda: kernel.run(code, check=True)

    def cold(code: str):
        # A new environment each time cannot be served by a warm worker.
        return lambda: kernel.run(f"%%claim BENCH_COLD={next(counter)}\n{code}", check=True)

    for code in (TRIVIAL, NUMPY):
        kernel.run(f"%%claim\n{code}", check=True)  # warm the worker up
    subjects = {
        "plain cell": run(TRIVIAL),
        "%%script python3": run(f"%%script python3\n{TRIVIAL}"),
        "%%claim, warm worker": run(f"%%claim\n{TRIVIAL}"),
        "%%claim, cold worker": cold(TRIVIAL),
        "plain cell + numpy": run(NUMPY),
        "%%script python3 + numpy": run(f"%%script python3\n{NUMPY}"),
        "%%claim warm + numpy": run(f"%%claim\n{NUMPY}"),
    }
    others = {name: others and available(name) for name in ("ipyparallel", "ray")}
    if others["ipyparallel"]:
        kernel.run(START_IPYPARALLEL, check=True, timeout=120)
        subjects["ipyparallel %%px, one engine"] = run(f"%%px\n{TRIVIAL}")
        subjects["ipyparallel %%px + numpy"] = run(f"%%px\n{NUMPY}")
    if others["ray"]:
        kernel.run(START_RAY, check=True, timeout=120)
        subjects["Ray task, local cluster"] = run("ray.get(trivial.remote())")
        subjects["Ray task + numpy"] = run("ray.get(with_numpy.remote())")
    samples = interleaved(subjects, rounds)
    if others["ipyparallel"]:
        kernel.run("cluster.stop_cluster_sync()", check=True, timeout=60)
    if others["ray"]:
        kernel.run("ray.shutdown()", check=True, timeout=60)
    rows = [[name, ms(median(s)), ms(percentile(s, 0.9))] for name, s in samples.items()]
    medians = {name: median(s) for name, s in samples.items()}
    ratios = {
        "warm %%claim / %%script (trivial)": medians["%%claim, warm worker"]
        / medians["%%script python3"],
        "warm %%claim / %%script (numpy)": medians["%%claim warm + numpy"]
        / medians["%%script python3 + numpy"],
    }
    text = table(["cell", "median", "p90"], rows)
    text += "\n\n" + "\n".join(f"- {name}: {value:.3f}" for name, value in ratios.items())
    return text, ratios


#: Each alternative moves ``a`` into another process and back, timed inside
#: the kernel: the best of a few runs, in seconds.
PIPE_SETUP = '''
import pickle, subprocess, sys
ECHO = """
import pickle, sys
read, write = sys.stdin.buffer, sys.stdout.buffer
while (n := int.from_bytes(read.read(8), 'little')):
    value = pickle.loads(read.read(n))
    back = pickle.dumps(value, protocol=5)
    write.write(len(back).to_bytes(8, 'little')); write.write(back); write.flush()
"""
echo = subprocess.Popen([sys.executable, '-c', ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
def through_pipe(value):
    out = pickle.dumps(value, protocol=5)
    echo.stdin.write(len(out).to_bytes(8, 'little')); echo.stdin.write(out); echo.stdin.flush()
    return pickle.loads(echo.stdout.read(int.from_bytes(echo.stdout.read(8), 'little')))
'''
RAY_IDENTITY = "@ray.remote\ndef identity(value):\n    return value"


def best_of(kernel: Kernel, expression: str, rounds: int) -> float:
    return kernel.facts(
        f"min((lambda t: ({expression}, time.perf_counter() - t)[1])(time.perf_counter()) "
        f"for _ in range({rounds}))"
    )


def transfer(
    kernel: Kernel, rounds: int, mib: int = 256, others: bool = True
) -> tuple[str, dict[str, float]]:
    kernel.run(f"import numpy as np, time\na = np.ones({mib} * 2**20 // 8)", check=True)
    kernel.run("%%claim --in a --out b\nb = a", check=True)
    copy_s = best_of(kernel, "a.copy()", rounds)
    samples = interleaved(
        {
            "in and back": lambda: kernel.run("%%claim --in a --out b\nb = a", check=True),
            "trivial": lambda: kernel.run("%%claim --in x --out y\ny = x", check=True),
        },
        rounds,
    )
    claim_s = max(1e-9, median(samples["in and back"]) - median(samples["trivial"]))
    # In and back moves the array twice; numpy's copy, once.
    rows = [["numpy copy (memcpy, one way)", copy_s, mib / copy_s]]
    rows.append(["%%claim, in and back", claim_s, 2 * mib / claim_s])
    kernel.run(PIPE_SETUP, check=True)
    pipe_s = best_of(kernel, "through_pipe(a)", rounds)
    rows.append(["pickle through a pipe, in and back", pipe_s, 2 * mib / pipe_s])
    if others and available("ipyparallel"):
        kernel.run(START_IPYPARALLEL, check=True, timeout=120)
        move = "(rc[:].push({'a': a}, block=True), rc[:].pull('a', block=True))"
        ipp_s = best_of(kernel, move, rounds)
        kernel.run("cluster.stop_cluster_sync()", check=True, timeout=60)
        rows.append(["ipyparallel push and pull", ipp_s, 2 * mib / ipp_s])
    ratios = {"claim transfer / memcpy bandwidth": (2 * mib / claim_s) / (mib / copy_s)}
    if others and available("ray"):
        kernel.run(f"{START_RAY}\n{RAY_IDENTITY}", check=True, timeout=120)
        ray_s = best_of(kernel, "ray.get(identity.remote(a))", rounds)
        kernel.run("ray.shutdown()", check=True, timeout=60)
        rows.append(["Ray task, in and back", ray_s, 2 * mib / ray_s])
        ratios["claim transfer / Ray bandwidth"] = ray_s / claim_s
    text = table(
        [f"{mib} MiB array", "time", "bandwidth"],
        [[name, ms(took), f"{rate:.0f} MiB/s"] for name, took, rate in rows],
    )
    text += "\n\n" + "\n".join(f"- {name}: {value:.3f}" for name, value in ratios.items())
    return text, ratios


#: What a cell makes, in words and in code for ``n`` float64s an array: 800 MB
#: in one array, and in eight of 100 MB in a list.
MADE = {
    "800 MB array": ("np.ones({n})", 100_000_000),
    "8 × 100 MB in a list": ("[np.ones({n}) for _ in range(8)]", 12_500_000),
}


def outputs(kernel: Kernel, rounds: int, scale: float = 1.0) -> tuple[str, dict[str, float]]:
    """Big values made in a claimed cell and bound in the kernel, against made in the kernel.

    Each subject binds a name of its own, again every round, as a cell run
    again does: the claimed cell's new value arrives while the kernel still
    holds the last one. ``scale`` shrinks the sizes for a smoke run.
    """
    kernel.run("import numpy as np", check=True)
    subjects = {}
    for index, (what, (code, n)) in enumerate(MADE.items()):
        made = code.format(n=int(n * scale))
        subjects[f"{what}, made in the kernel"] = _bind(kernel, f"k{index} = {made}")
        claimed = f"%%claim ram=8G --out c{index}\nimport numpy as np\nc{index} = {made}"
        subjects[f"{what}, made in a claimed cell"] = _bind(kernel, claimed)
    for action in subjects.values():
        action()  # a worker started, numpy imported, the first value bound
    samples = interleaved(subjects, rounds)
    rows, ratios = [], {}
    for what in MADE:
        here = samples[f"{what}, made in the kernel"]
        there = samples[f"{what}, made in a claimed cell"]
        rows.append([f"{what}, made in the kernel", ms(median(here)), ms(percentile(here, 0.9))])
        rows.append(
            [f"{what}, made in a claimed cell", ms(median(there)), ms(percentile(there, 0.9))]
        )
        ratios[f"{what}: claimed / kernel, p50"] = median(there) / median(here)
        ratios[f"{what}: claimed / kernel, p90 (target ≤ 2)"] = percentile(there, 0.9) / percentile(
            here, 0.9
        )
    text = table([f"bound in the kernel ({rounds} runs)", "p50", "p90"], rows)
    text += "\n\n" + "\n".join(f"- {name}: {value:.2f}" for name, value in ratios.items())
    return text, ratios


def _bind(kernel: Kernel, code: str):
    return lambda: kernel.run(code, check=True)


def main(rounds: int = 20, mib: int = 256, others: bool = True) -> str:
    with tempfile.TemporaryDirectory() as ledger, tempfile.TemporaryDirectory() as ray_state:
        # Ray's state, and the token it would otherwise write to ~/.ray, stay
        # in a directory of the run's own.
        kernel = Kernel(
            FLUKSIO_LEDGER=ledger,
            FLUKSIO_CONFIG=f"{ledger}/none.json",
            RAY_TMPDIR=ray_state,
            RAY_AUTH_TOKEN=secrets.token_hex(16),
            RAY_USAGE_STATS_ENABLED="0",
        )
        try:
            trips, _ = round_trips(kernel, rounds, others)
            moved, _ = transfer(kernel, max(3, rounds // 4), mib, others)
            made, _ = outputs(kernel, rounds, scale=mib / 256)
        finally:
            kernel.shutdown()
    return (
        f"### Running a cell elsewhere\n\n{trips}\n\n### Moving data\n\n{moved}\n\n"
        f"### Big values a claimed cell made\n\n{made}\n"
    )


if __name__ == "__main__":
    print(main())
