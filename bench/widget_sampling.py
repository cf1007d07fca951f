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
- the same eight, sampled, each holding a card that the kernel reads (at
  most every 2 s) with ``nvidia-smi``, or with NVML; and with ``nvidia-smi``
  while every card's figures move, so that every pass over the cards is news.
  Both are the tests' stand-ins (``tests/gpu_standins.py``), card or no card
  (the figures in ``results.md`` come from a machine with none), and each
  pass over the cards is timed in the thread that runs it
  (``time.thread_time``), with the CPU of the processes it ran.

Costs are the difference from the baseline, as a percentage of one core,
taken from each configuration's least disturbed window: on a shared machine
other work only ever adds to a window's CPU time.
Run from the repository root: ``.venv/bin/python -m bench.widget_sampling``
(or ``python bench/widget_sampling.py``; ``--only card`` for the card readings
and their baselines alone); ``python -m bench`` includes it.
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from bench.harness import machine, table
from tests.gpu_standins import PYNVML_SITE, StandInNvml, StandInSmi, card
from tests.kernels import Kernel
from tests.real_cards import first_card

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

def _bench_hold(index, sampled, widgets, varying, gpus):
    view = WidgetView() if widgets else None
    work = VARYING if varying else ["sleep", "3600"]
    with Claim(ask(cpus=1, gpus=int(gpus), label=f"bench {index}"), view=view) as held:
        child = None
        if sampled:
            process = held.popen(work)
            _bench["held"].append(
                {"pid": process.pid, "cards": list(held.allocation.gpus), "claim": held}
            )
        else:
            child = subprocess.Popen(work)
        _bench["ready"].release()
        _bench["stop"].wait()
        if child is not None:
            child.kill()
            child.wait()

def _bench_start(n, sampled, widgets, varying, gpus):
    _bench["stop"].clear()
    _bench["held"] = []
    _bench["threads"] = [
        threading.Thread(
            target=_bench_hold, args=(i, sampled, widgets, varying, gpus), daemon=True
        )
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

#: The kernel's reader of the cards, swapped for one that reads with the stand-in
#: asked for and counts its passes, their CPU in the thread running each (from the start
#: of a pass to its reading, pids matched to processes), the part of it spent in
#: the source's read (running nvidia-smi and parsing what it printed, or the NVML
#: calls), and the CPU of the processes a pass ran (nvidia-smi's), not the kernel's.
#: A pass runs in a thread of its own, so its thread_time is the pass's alone.
CARDS = """
import importlib.util, os, resource, sys, time
from fluksio_nb.gpu_usage import CardReader, _Nvml, _NvidiaSmi
from fluksio_nb.watch import kernel_watch

def _bench_children_cpu():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime

class _BenchCards(CardReader):
    passes, cpu_s, source_s, children_s, wall_s = 0, 0.0, 0.0, 0.0, 0.0

    def _read_now(self):
        cpu, children = time.thread_time(), _bench_children_cpu()
        wall = time.perf_counter()
        try:
            return super()._read_now()
        finally:
            self.passes += 1
            self.cpu_s += time.thread_time() - cpu
            self.children_s += _bench_children_cpu() - children
            self.wall_s += time.perf_counter() - wall

class _BenchSource:
    def __init__(self, inner, reader):
        self.inner, self.source, self.reader = inner, inner.source, reader

    def read(self):
        cpu = time.thread_time()
        try:
            return self.inner.read()
        finally:
            self.reader.source_s += time.thread_time() - cpu

def _bench_cards(source, where, state=None):
    if source == "nvidia-smi":
        make = lambda: _NvidiaSmi(where)
    else:
        # The stand-in by its file: the real nvidia-ml-py may be installed too.
        os.environ["STANDIN_PYNVML_STATE"] = state
        spec = importlib.util.spec_from_file_location("_bench_pynvml", where)
        standin = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(standin)
        # It reads and parses its JSON file on every call, some fifty a pass,
        # where NVML answers from the driver in microseconds: read again only
        # when the file changed, it costs about what a call into a library does.
        load, kept = standin._state, {}
        def _state():
            found = os.stat(state)
            changed = found.st_ino, found.st_mtime_ns  # rewritten whole: a new file
            if kept.get("at") != changed:
                kept["at"], kept["state"] = changed, load()
            return kept["state"]
        standin._state = _state
        make = lambda: _Nvml(standin)
    reader = _BenchCards(opener=lambda: _BenchSource(make(), reader))
    kernel_watch().cards = reader
"""


@dataclass
class CardCosts:
    """What the kernel's reader of the cards did over one window."""

    passes: int
    #: CPU of the thread running those passes, the part of it in the source's
    #: reads, the CPU of the processes they ran, and how long a pass took (in a
    #: thread of its own: no claim's reading or halt waits on it).
    cpu_s: float
    source_s: float
    children_s: float
    pass_wall_s: float
    wall_s: float


class Bench:
    def __init__(self, claims: int) -> None:
        self.claims = claims
        self.kernel = Kernel(
            FLUKSIO_CPUS=str(claims),
            # Declared: a claim of gpus=1 gets one of these, read from a stand-in.
            FLUKSIO_GPUS=str(claims),
            FLUKSIO_RAM="8G",
            FLUKSIO_RESERVE_CPUS="0",
            FLUKSIO_CONFIG=str(Path(tempfile.mkdtemp()) / "fluksio_nb.json"),
            FLUKSIO_LEDGER=tempfile.mkdtemp(),
        )
        self.kernel.run(SETUP, check=True)
        self.kernel.run(CARDS, check=True)
        self.process = psutil.Process(self.kernel.pid)
        self.monitor_id: str | None = None
        # This machine has no card: the cards are stand-ins, as in the tests.
        cards = [card(index) for index in range(claims)]
        place = Path(tempfile.mkdtemp(prefix="fluksio-bench-cards-"))
        self.standins = {
            "nvidia-smi": StandInSmi(place / "smi", cards),
            "nvml": StandInNvml(place / "nvml", cards),
        }
        self._busy = random.Random(0)

    def read_cards_with(self, source: str) -> None:
        """A fresh reader of the cards in the kernel, reading with ``source``'s stand-in."""
        standin = self.standins[source]
        if isinstance(standin, StandInSmi):
            where, state = standin.path, None
        else:
            where, state = PYNVML_SITE / "pynvml.py", standin.state_file
        args = f"{source!r}, {str(where)!r}, {None if state is None else str(state)!r}"
        self.kernel.run(f"_bench_cards({args})", check=True)

    def hold_cards(self, source: str, held: list[dict]) -> None:
        """Each sampled process holds a GiB on its card, and the cards are half busy."""
        standin = self.standins[source]
        cards = [{**c, "utilisation": 50, "used_mib": 1024} for c in standin.cards]
        standin.set_cards(cards)
        standin.set_apps(
            {"uuid": cards[index]["uuid"], "pid": one["pid"], "used_mib": 1024}
            for one in held
            for index in one["cards"]
        )

    def move_cards(self, source: str) -> None:
        """Every figure of every card and process anew: cards at work, every reading news."""
        standin, pick = self.standins[source], self._busy.randint
        standin.set_cards({**c, "utilisation": pick(0, 100)} for c in standin.cards)
        standin.set_apps({**a, "used_mib": pick(900, 1100)} for a in standin.apps)

    def card_costs(self) -> tuple[int, float, float, float, float, float]:
        passes, cpu, source, children, wall = self.kernel.facts(
            "[kernel_watch().cards.passes, kernel_watch().cards.cpu_s, "
            "kernel_watch().cards.source_s, kernel_watch().cards.children_s, "
            "kernel_watch().cards.wall_s]"
        )
        return passes, cpu, source, children, wall, time.monotonic()

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

    def window(
        self, seconds: float, every_second: Callable[[], None] | None = None
    ) -> tuple[float, float]:
        """Cores of CPU the kernel used, and widget messages it sent per second, over a window.

        ``every_second`` is done once a second, here, outside the kernel.
        """
        before = self.cpu_seconds()
        started = time.monotonic()
        next_ping, pushes, next_second = started, 0, started
        while (now := time.monotonic()) < started + seconds:
            if self.monitor_id is not None and now >= next_ping:
                self.ping_monitor()
                next_ping = now + 30
            if every_second is not None and now >= next_second:
                every_second()
                next_second = now + 1
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
        cards: str | None = None,
        busy: bool = False,
    ) -> tuple[float, float, CardCosts | None]:
        """The kernel's CPU in cores, its widget messages a second, and its reader's passes.

        ``cards`` gives each claim a card, read with that stand-in
        (``"nvidia-smi"`` or ``"nvml"``); ``busy`` changes every card's
        figures every second.
        """
        if monitor:
            self.open_monitor()
        if cards is not None:
            self.read_cards_with(cards)
        if claims:
            holding = cards is not None
            self.kernel.run(
                f"_bench_start({self.claims}, {sampled}, {widgets}, {varying}, {holding})",
                check=True,
            )
        if cards is not None:
            held = self.kernel.facts('[{**h, "claim": None} for h in _bench["held"]]')
            self.hold_cards(cards, held)
        moving = (lambda: self.move_cards(cards)) if busy and cards is not None else None
        # Settle: first samples taken, widgets made and drawn, and the watch
        # thread of the previous configuration gone (it lingers 2 s).
        self.window(3.0, moving)
        before = self.card_costs() if cards is not None else None
        used, sent = self.window(seconds, moving)
        costs = None
        if before is not None:
            after = self.card_costs()
            costs = CardCosts(*(b - a for a, b in zip(before, after, strict=True)))
            # Measured with the cards read, or not at all.
            read = self.kernel.facts('[h["claim"].readings.peak_gpu_bytes for h in _bench["held"]]')
            assert all(read), f"the claims' card memory was not read: {read}"
        if claims:
            self.kernel.run("_bench_stop()", check=True, timeout=60)
        self.close_monitor()
        return used, sent, costs

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
    "claims sampled, a card each: nvidia-smi": {
        "claims": True,
        "sampled": True,
        "widgets": False,
        "monitor": False,
        "cards": "nvidia-smi",
    },
    "claims sampled, a card each: NVML": {
        "claims": True,
        "sampled": True,
        "widgets": False,
        "monitor": False,
        "cards": "nvml",
    },
    "cards busy (figures moving): nvidia-smi": {
        "claims": True,
        "sampled": True,
        "widgets": False,
        "monitor": False,
        "cards": "nvidia-smi",
        "busy": True,
    },
}

#: Each cost is against the configuration that differs from it only in what is measured.
BASELINES = {
    "idle kernel, monitor open": "idle kernel",
    "claims sampled": "claims held, not sampled",
    "claims sampled, status widgets": "claims held, not sampled",
    "claims sampled, widgets + monitor": "claims held, not sampled",
    "memory moving: sampled, widgets + monitor": "claims held, not sampled",
    "claims sampled, a card each: nvidia-smi": "claims held, not sampled",
    "claims sampled, a card each: NVML": "claims held, not sampled",
    "cards busy (figures moving): nvidia-smi": "claims held, not sampled",
}

#: The configurations whose claims hold cards, and the source each reads them with.
WITH_CARDS = {name: c["cards"] for name, c in CONFIGURATIONS.items() if c.get("cards")}


def chosen(only: str | None) -> list[str]:
    """The configurations whose names hold ``only``, with what they are compared with."""
    if only is None:
        return list(CONFIGURATIONS)
    picked = {name for name in CONFIGURATIONS if only in name}
    picked |= {BASELINES[name] for name in picked if name in BASELINES}
    if picked & WITH_CARDS.keys():
        picked.add("claims sampled")  # the card readings alone are against it
        picked.add(BASELINES["claims sampled"])
    return [name for name in CONFIGURATIONS if name in picked]


def main(rounds: int = 3, window_s: float = 10.0, claims: int = 8, only: str | None = None) -> str:
    names = chosen(only)
    bench = Bench(claims)
    cores: dict[str, list[float]] = {name: [] for name in names}
    pushes: dict[str, list[float]] = {name: [] for name in names}
    card_costs: dict[str, list[CardCosts]] = {name: [] for name in names if name in WITH_CARDS}
    try:
        for _ in range(rounds):
            for name in names:
                used, sent, costs = bench.measure(window_s, **CONFIGURATIONS[name])
                cores[name].append(used)
                pushes[name].append(sent)
                if costs is not None:
                    card_costs[name].append(costs)
    finally:
        bench.shutdown()
    # Other work on a shared machine only ever adds to a window's CPU time, so
    # the least of a configuration's windows is its least disturbed estimate;
    # the median is shown beside it for how much the rest varied.
    median = {name: statistics.median(values) for name, values in cores.items()}
    least = {name: min(values) for name, values in cores.items()}
    rows = []
    for name in names:
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

    def cost(name: str, against: str | None = None) -> float:
        return 100 * (least[name] - least[against or BASELINES[name]])

    said = {
        "claims sampled": f"sampling {claims} claims: {{:.2f}}% of one core (target ≤ 1%)",
        "claims sampled, status widgets": "with their status widgets: {:.2f}%",
        "claims sampled, widgets + monitor": "and a monitor open: {:.2f}%",
        "memory moving: sampled, widgets + monitor": (
            "the same, each claim's memory moving (every reading differs, so the monitor "
            "is pushed on every tick): {:.2f}%"
        ),
        "idle kernel, monitor open": "a monitor open on an idle kernel: {:.2f}%",
    }
    lines = [f"- {text.format(cost(name))}" for name, text in said.items() if name in least]
    for name, source in WITH_CARDS.items():
        if name not in least:
            continue
        busy = CONFIGURATIONS[name].get("busy")
        lines.append(
            f"- sampling {claims} claims holding a card each, read with {source}"
            + (", every card's figures moving" if busy else "")
            + f": {cost(name):.2f}% of one core (target ≤ 1%); the card readings alone, "
            f"against the same claims without cards: {cost(name, 'claims sampled'):+.2f}%"
        )
    passes: list[list[str]] = []
    summary: list[str] = []
    for name, costs in card_costs.items():
        count = sum(c.passes for c in costs)
        cpu, children = sum(c.cpu_s for c in costs), sum(c.children_s for c in costs)
        source, wall = sum(c.source_s for c in costs), sum(c.wall_s for c in costs)
        held_up = sum(c.pass_wall_s for c in costs)
        if not count:
            passes.append([name, "0", "", "", "", "", "", ""])
            continue
        if CONFIGURATIONS[name]["cards"] == "nvidia-smi":
            together = cost(name) + 100 * children / wall
            summary.append(
                f"- {name}: the kernel's cost and the nvidia-smi runs' together, "
                f"{together:.2f}% of a core: {'over' if together > 1 else 'within'} the 1% "
                "target, counting the runs (the stand-in's, not the real nvidia-smi's)"
            )
        passes.append(
            [
                name,
                f"{count / wall:.2f}/s",
                f"{1000 * cpu / count:.2f} ms",
                f"{1000 * source / count:.2f} ms",
                f"{100 * cpu / wall:.2f}%",
                f"{1000 * children / count:.1f} ms",
                f"{100 * children / wall:.2f}%",
                f"{1000 * held_up / count:.1f} ms",
            ]
        )
    cards_part = ""
    if card_costs:
        no_card = first_card()
        cards_part = (
            "\n#### With card readings on\n\n"
            + (
                f"This machine has no NVIDIA card ({no_card}): the cards are stand-ins"
                if isinstance(no_card, str)
                else "The cards are stand-ins, though this machine has one "
                "(`python -m bench.gpu_check` reads it)"
            )
            + ", as in the tests (`tests/gpu_standins.py`). "
            "`nvidia-smi` is a Python script (`python -IS`), run "
            "twice a pass by the kernel's reader as the real one would be; `pynvml` is a module "
            "in the kernel, answering from a JSON file it reads again only when the file "
            "changed (a `stat` a call), where real NVML asks the driver: each of its calls "
            "costs Python what a call into a library does, the driver's side is not measured. "
            f"Each of the {claims} sampled processes holds 1 GiB on its own card. The kernel's "
            "reader is swapped for one that times each pass over the cards in the thread "
            "that runs it (`time.thread_time`), and the processes a pass runs (`RUSAGE_CHILDREN`): "
            "theirs is the stand-in's CPU, not the kernel's and not the real nvidia-smi's "
            "(`python -m bench.gpu_check` measures that on a machine with a card).\n\n"
            + table(
                [
                    "configuration",
                    "passes over the cards",
                    "thread CPU a pass",
                    "of which the source's read",
                    "of a core",
                    "CPU of the processes a pass ran",
                    "of a core",
                    "wall a pass",
                ],
                passes,
            )
            + "\n\n"
            + "\n".join(summary)
            + ("\n" if summary else "")
            + "- a pass runs in a thread of its own, one at a time: its wall time holds up "
            "no claim's reading, halt or deadline\n"
        )
    return (
        "### Watching running claims\n\n"
        f"{claims} claims of `sleep`, FLUKSIO_CPUS={claims}; the kernel's own CPU time over "
        f"{rounds} × {window_s:g} s windows per configuration, alternated. "
        "Cost is the least window against the baseline's least in the same run, as a "
        "share of one core.\n\n"
        + table(["configuration", "kernel CPU, least / median", "cost", "widget msgs/s"], rows)
        + "\n\n"
        + "\n".join(lines)
        + "\n"
        + cards_part
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--claims", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, to check it runs")
    parser.add_argument(
        "--only",
        metavar="TEXT",
        help='only the configurations whose names hold TEXT ("card", say), and their baselines',
    )
    options = parser.parse_args()
    if options.smoke:
        options.rounds, options.window, options.claims = 1, 1.0, 2
    print(f"Run on {machine()}.\n")
    print(main(options.rounds, options.window, options.claims, options.only))
