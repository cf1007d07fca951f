"""What watching costs the kernel: sampling eight running claims, their widgets, the monitor.

The kernel is where the user's work and data live, so whatever fluksio_nb
does there while claims run is taken from the user. The target is at most
1% of one core for eight running claims, sampled, each with its live status
widget, and a monitor open.

Measured from the kernel process's own CPU time (all its threads, from the
scheduler's accounting), over windows of wall time, each configuration beside its baseline
in the same run and alternated in rounds:

- idle kernel; idle kernel with a monitor open (a front end pinging it);
- eight claims held, each with a ``sleep`` child that nobody samples;
- the same eight, sampled (``Claim.popen``: the kernel's one watch thread);
- the same, sampled, each with its live status widget;
- the same, with a monitor open as well;
- the same again with children whose memory moves every half second, so
  that every reading is news: each status widget is pushed once a second and
  the monitor on every tick. (A ``sleep`` never changes: its widget is
  pushed once in five seconds, and an unchanged machine is never pushed.)

Costs are the difference from the baseline, as a percentage of one core,
taken from each configuration's least disturbed window: on a shared machine
other work only ever adds to a window's CPU time.
Run from the repository root: ``.venv/bin/python -m bench.widget_sampling``
(or ``python bench/widget_sampling.py``); ``python -m bench`` includes it.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench.harness import machine, table
from tests.kernels import Kernel

#: Holders run in kernel threads, so the cells that start and stop them
#: return at once and the kernel's main thread is idle while it is measured.
SETUP = """
import subprocess, sys, threading
from fluksio_nb.local_claim import Claim
from fluksio_nb.resources import ask
from fluksio_nb.widget import WidgetView, monitor
_bench = {"stop": threading.Event(), "threads": [], "ready": threading.Semaphore(0)}

# A child whose memory moves every half second, so that every reading differs
# and every monitor tick is pushed, as with real work; its CPU is its own.
VARYING = [sys.executable, "-c", (
    "import random, time\\n"
    "while True:\\n"
    "    block = bytearray(random.randint(1, 40) * 2**20)\\n"
    "    time.sleep(0.5)"
)]

def _bench_hold(index, sampled, widgets, varying):
    view = WidgetView() if widgets else None
    work = VARYING if varying else ["sleep", "3600"]
    with Claim(ask(cpus=1, label=f"bench {index}"), view=view) as held:
        child = None
        if sampled:
            held.popen(work)
        else:
            child = subprocess.Popen(work)
        _bench["ready"].release()
        _bench["stop"].wait()
        if child is not None:
            child.kill()
            child.wait()

def _bench_start(n, sampled, widgets, varying):
    _bench["stop"].clear()
    _bench["threads"] = [
        threading.Thread(target=_bench_hold, args=(i, sampled, widgets, varying), daemon=True)
        for i in range(n)
    ]
    for thread in _bench["threads"]:
        thread.start()
    for _ in range(n):
        assert _bench["ready"].acquire(timeout=60), "a bench claim did not start"

def _bench_stop():
    _bench["stop"].set()
    for thread in _bench["threads"]:
        thread.join(30)
"""


class Bench:
    def __init__(self, claims: int) -> None:
        self.claims = claims
        self.kernel = Kernel(
            FLUKSIO_CPUS=str(claims),
            FLUKSIO_GPUS="0",
            FLUKSIO_RAM="8G",
            FLUKSIO_RESERVE_CPUS="0",
            FLUKSIO_CONFIG=str(Path(tempfile.mkdtemp()) / "fluksio_nb.json"),
            FLUKSIO_LEDGER=tempfile.mkdtemp(),
        )
        self.kernel.run(SETUP, check=True)
        self.process = psutil.Process(self.kernel.pid)
        self.monitor_id: str | None = None

    def open_monitor(self) -> None:
        ran = self.kernel.run(
            "_bench_monitor = monitor()\ndisplay(_bench_monitor)\nprint(_bench_monitor.model_id)",
            check=True,
        )
        self.monitor_id = ran.stdout.strip()

    def close_monitor(self) -> None:
        if self.monitor_id is not None:
            self.kernel.run("_bench_monitor.close()", check=True)
            self.monitor_id = None

    def ping_monitor(self) -> None:
        """What a monitor's view in a browser sends every 30 s."""
        client = self.kernel.client
        content = {"type": "ping", "view": "bench"}
        message = client.session.msg(
            "comm_msg",
            {"comm_id": self.monitor_id, "data": {"method": "custom", "content": content}},
        )
        client.shell_channel.send(message)

    def cpu_seconds(self) -> float:
        """CPU time of every thread of the kernel so far.

        From the scheduler's own accounting (``/proc/<pid>/task/*/schedstat``,
        in nanoseconds) where there is one: the user/system times that psutil
        reads are sampled at the timer tick, which charges a whole tick to
        whichever thread happens to be running, and a thread that wakes for a
        millisecond twice a second is then over- or under-counted wholesale.
        """
        tasks = Path(f"/proc/{self.kernel.pid}/task")
        try:
            total = 0
            for task in tasks.iterdir():
                try:
                    total += int((task / "schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    continue  # a thread that ended since the listing
            return total / 1e9
        except OSError:
            times = self.process.cpu_times()
            return times.user + times.system

    def window(self, seconds: float) -> tuple[float, float]:
        """Cores of CPU the kernel used, and widget messages it sent per second, over a window."""
        before = self.cpu_seconds()
        started = time.monotonic()
        next_ping, pushes = started, 0
        while (now := time.monotonic()) < started + seconds:
            if self.monitor_id is not None and now >= next_ping:
                self.ping_monitor()
                next_ping = now + 30
            try:
                message = self.kernel.client.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            pushes += message["msg_type"] == "comm_msg"
        used = self.cpu_seconds() - before
        wall = time.monotonic() - started
        return used / wall, pushes / wall

    def measure(
        self,
        seconds: float,
        *,
        claims: bool,
        sampled: bool,
        widgets: bool,
        monitor: bool,
        varying: bool = False,
    ) -> tuple[float, float]:
        if monitor:
            self.open_monitor()
        if claims:
            self.kernel.run(
                f"_bench_start({self.claims}, {sampled}, {widgets}, {varying})", check=True
            )
        # Settle: first samples taken, widgets made and drawn, and the watch
        # thread of the previous configuration gone (it lingers 2 s).
        self.window(3.0)
        result = self.window(seconds)
        if claims:
            self.kernel.run("_bench_stop()", check=True, timeout=60)
        self.close_monitor()
        return result

    def shutdown(self) -> None:
        self.kernel.shutdown()


CONFIGURATIONS = {
    "idle kernel": {"claims": False, "sampled": False, "widgets": False, "monitor": False},
    "idle kernel, monitor open": {
        "claims": False,
        "sampled": False,
        "widgets": False,
        "monitor": True,
    },
    "claims held, not sampled": {
        "claims": True,
        "sampled": False,
        "widgets": False,
        "monitor": False,
    },
    "claims sampled": {"claims": True, "sampled": True, "widgets": False, "monitor": False},
    "claims sampled, status widgets": {
        "claims": True,
        "sampled": True,
        "widgets": True,
        "monitor": False,
    },
    "claims sampled, widgets + monitor": {
        "claims": True,
        "sampled": True,
        "widgets": True,
        "monitor": True,
    },
    "memory moving: sampled, widgets + monitor": {
        "claims": True,
        "sampled": True,
        "widgets": True,
        "monitor": True,
        "varying": True,
    },
}

#: Each cost is against the configuration that differs from it only in what is measured.
BASELINES = {
    "idle kernel, monitor open": "idle kernel",
    "claims sampled": "claims held, not sampled",
    "claims sampled, status widgets": "claims held, not sampled",
    "claims sampled, widgets + monitor": "claims held, not sampled",
    "memory moving: sampled, widgets + monitor": "claims held, not sampled",
}


def main(rounds: int = 3, window_s: float = 10.0, claims: int = 8) -> str:
    bench = Bench(claims)
    cores: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    pushes: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    try:
        for _ in range(rounds):
            for name, configuration in CONFIGURATIONS.items():
                used, sent = bench.measure(window_s, **configuration)
                cores[name].append(used)
                pushes[name].append(sent)
    finally:
        bench.shutdown()
    # Other work on a shared machine only ever adds to a window's CPU time, so
    # the least of a configuration's windows is its least disturbed estimate;
    # the median is shown beside it for how much the rest varied.
    median = {name: statistics.median(values) for name, values in cores.items()}
    least = {name: min(values) for name, values in cores.items()}
    rows = []
    for name in CONFIGURATIONS:
        base = BASELINES.get(name)
        cost = "" if base is None else f"{100 * (least[name] - least[base]):+.2f}%"
        rows.append(
            [
                name,
                f"{100 * least[name]:.2f}% / {100 * median[name]:.2f}%",
                cost,
                f"{statistics.median(pushes[name]):.1f}",
            ]
        )

    def cost(name: str) -> float:
        return 100 * (least[name] - least[BASELINES[name]])

    return (
        "### Watching running claims\n\n"
        f"{claims} claims of `sleep`, FLUKSIO_CPUS={claims}; the kernel's own CPU time over "
        f"{rounds} × {window_s:g} s windows per configuration, alternated. "
        "Cost is the least window against the baseline's least in the same run, as a "
        "share of one core.\n\n"
        + table(["configuration", "kernel CPU, least / median", "cost", "widget msgs/s"], rows)
        + f"\n\n- sampling {claims} claims: {cost('claims sampled'):.2f}% of one core "
        "(target ≤ 1%)"
        + f"\n- with their status widgets: {cost('claims sampled, status widgets'):.2f}%"
        + f"\n- and a monitor open: {cost('claims sampled, widgets + monitor'):.2f}%"
        + "\n- the same, each claim's memory moving (every reading differs, so the monitor "
        f"is pushed on every tick): {cost('memory moving: sampled, widgets + monitor'):.2f}%"
        + f"\n- a monitor open on an idle kernel: {cost('idle kernel, monitor open'):.2f}%\n"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--claims", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, to check it runs")
    options = parser.parse_args()
    if options.smoke:
        options.rounds, options.window, options.claims = 1, 1.0, 2
    print(f"Run on {machine()}.\n")
    print(main(options.rounds, options.window, options.claims))
