"""The books: what a claim and its give-back cost, and how fast a waiter hears.

Every claimed cell pays for one claim and one give-back, on the kernel's own
books or on the machine's ledger, so their latency under contention is what
the accounting adds to a cell. The ledger's other number is how long freed
capacity takes to reach a waiter in another kernel: the sleep-and-wake path.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

from bench.harness import percentile, table
from fluksio_nb.books import ResourceAccountant
from fluksio_nb.queue import ClaimQueue
from fluksio_nb.resources import Resources

SETUP = """
import json, sys, time
from fluksio_nb.inventory import Gpu, Inventory
from fluksio_nb.ledger import MachineQueue
from fluksio_nb.resources import Resources
inv = Inventory(cpus=64, machine_cpus=64, ram_bytes=0, machine_ram_bytes=0, gpus=())
q = MachineQueue(sys.argv[1], inv)
wanted = Resources(cpus=1)
"""

CYCLES = (
    SETUP
    + """
samples = []
sys.stdin.readline()
for _ in range(int(sys.argv[2])):
    started = time.perf_counter()
    q.release(q.enqueue(wanted))
    samples.append(time.perf_counter() - started)
print(json.dumps(samples), flush=True)
"""
)

WAITER = (
    SETUP
    + """
one = Resources(cpus=64)
for _ in range(int(sys.argv[2])):
    sys.stdin.readline()
    t = q.enqueue(one)
    print(json.dumps({"state": t.state}), flush=True)
    q.wait(t)
    print(json.dumps({"granted": time.time()}), flush=True)
    q.release(t)
"""
)


def kernel_books(threads: int, cycles: int) -> list[float]:
    queue = ClaimQueue(ResourceAccountant(cpus=64))
    wanted = Resources(cpus=1)
    samples: list[float] = []
    lock = threading.Lock()

    def work() -> None:
        mine = []
        for _ in range(cycles):
            started = time.perf_counter()
            queue.release(queue.enqueue(wanted))
            mine.append(time.perf_counter() - started)
        with lock:
            samples.extend(mine)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return samples


def ledger_books(processes: int, cycles: int, directory: str) -> list[float]:
    started = [
        subprocess.Popen(
            [sys.executable, "-c", CYCLES, directory, str(cycles)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    for process in started:  # all start contending at once, imports done
        process.stdin.write("\n")
        process.stdin.flush()
    samples: list[float] = []
    for process in started:
        samples += json.loads(process.stdout.readline())
        process.wait()
    return samples


def wake_latency(rounds: int, directory: str) -> list[float]:
    from fluksio_nb.inventory import Inventory
    from fluksio_nb.ledger import MachineQueue

    inventory = Inventory(cpus=64, machine_cpus=64, ram_bytes=0, machine_ram_bytes=0)
    mine = MachineQueue(directory, inventory)
    waiter = subprocess.Popen(
        [sys.executable, "-c", WAITER, directory, str(rounds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    latencies = []
    for _ in range(rounds):
        held = mine.enqueue(Resources(cpus=64))
        mine.wait(held)
        waiter.stdin.write("\n")  # now queue behind us
        waiter.stdin.flush()
        assert json.loads(waiter.stdout.readline())["state"] == "waiting"
        time.sleep(0.05)
        freed = time.time()
        mine.release(held)
        latencies.append(json.loads(waiter.stdout.readline())["granted"] - freed)
    waiter.wait()
    return latencies


def main(cycles: int = 500, rounds: int = 30) -> str:
    rows = []
    results: dict[str, float] = {}

    def row(name: str, samples: list[float]) -> None:
        med, p99 = statistics.median(samples), percentile(samples, 0.99)
        results[name] = med
        rows.append([name, f"{med * 1e3:.3f} ms", f"{p99 * 1e3:.3f} ms"])

    row("kernel books, 1 thread", kernel_books(1, cycles))
    row("kernel books, 8 threads", kernel_books(8, cycles // 8 or 1))
    with tempfile.TemporaryDirectory() as directory:
        row("ledger, 1 process", ledger_books(1, cycles, directory))
        row("ledger, 8 processes", ledger_books(8, cycles // 8 or 1, directory))
    with tempfile.TemporaryDirectory() as directory:
        row("freed share reaches a waiter in another process", wake_latency(rounds, directory))
    text = table(["claim plus give-back", "median", "p99"], rows)
    return textwrap.dedent(f"### The books\n\n{text}\n")


if __name__ == "__main__":
    print(main())
