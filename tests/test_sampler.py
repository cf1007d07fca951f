"""Readings of a real worker's process tree.

The failures guarded against: memory held by a child process that the sampler
never sees (a cell running ``!python train.py``), a busy tree read as idle,
and a worker that exits turning the sampler into an exception.
"""

import os
import subprocess
import sys
import time

import pytest

from fluksio_nb.budget import Budget, HaltReason, halt_decision
from fluksio_nb.sampler import Readings, Sampler

MIB = 2**20

# Allocates and touches N MiB, says so, then waits to be killed.
_HOLD = (
    "import sys, time\n"
    "block = bytearray({mib} * 2**20)\n"
    "for i in range(0, len(block), 4096): block[i] = 1\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def start(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return process


def wait_ready(process: subprocess.Popen, lines: int = 1) -> None:
    for _ in range(lines):
        assert process.stdout.readline().strip() == "ready"


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def test_the_memory_a_worker_holds_is_read(processes):
    worker = start(_HOLD.format(mib=200))
    processes.append(worker)
    wait_ready(worker)
    reading = Sampler(worker.pid).sample()
    assert 200 * MIB <= reading.rss_bytes < 300 * MIB
    assert reading.processes == 1
    assert reading.host_total_bytes >= reading.host_available_bytes > 0


def test_memory_held_by_a_grandchild_counts_against_the_worker(processes):
    """The work is often done two processes down: a cell that runs a script."""
    grandchild = _HOLD.format(mib=150)
    middle = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "child.wait()\n"
    )
    worker = start(middle)
    processes.append(worker)
    wait_ready(worker)
    reading = Sampler(worker.pid).sample()
    assert reading.processes == 2
    assert reading.rss_bytes >= 150 * MIB


def test_a_busy_worker_reads_as_about_one_core(processes):
    worker = start("print('ready', flush=True)\nwhile True: pass\n")
    processes.append(worker)
    wait_ready(worker)
    sampler = Sampler(worker.pid, machine_cpus=4)
    time.sleep(0.6)
    reading = sampler.sample()
    assert 0.6 <= reading.cpu_cores <= 1.2
    # A share of the whole machine: one busy core of four is about a quarter.
    assert 15 <= reading.cpu_percent <= 30


def test_cpu_of_a_child_that_came_and_went_is_not_lost(processes):
    """A short `!cmd` between two readings still used the machine."""
    code = (
        "import subprocess, sys, time\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "subprocess.run([sys.executable, '-c', 'import time\\nt=time.time()\\n"
        "while time.time()-t < 0.5: pass'])\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    processes.append(worker)
    wait_ready(worker)
    sampler = Sampler(worker.pid, machine_cpus=1)
    worker.stdin.write("go\n")
    worker.stdin.flush()
    wait_ready(worker)
    assert sampler.sample().cpu_cores >= 0.3


def test_a_worker_that_has_gone_is_a_state_not_an_error(processes):
    worker = start("print('ready', flush=True)")
    wait_ready(worker)
    worker.wait()
    sampler = Sampler(worker.pid)
    assert sampler.sample() is None
    assert not sampler.alive


def test_a_worker_killed_while_sampled_stops_the_sampler(processes):
    worker = start(_HOLD.format(mib=1))
    wait_ready(worker)
    sampler = Sampler(worker.pid)
    assert sampler.sample() is not None
    worker.kill()
    worker.wait()
    assert sampler.sample() is None
    assert not sampler.alive


def test_the_cadence_is_half_a_second():
    clock = [100.0]
    sampler = Sampler(os.getpid(), clock=lambda: clock[0])
    assert sampler.due()
    assert sampler.poll() is not None
    clock[0] += 0.3
    assert not sampler.due()
    assert sampler.poll() is None
    clock[0] += 0.2
    assert sampler.due()


def test_a_real_worker_over_its_budget_is_halted(processes):
    worker = start(_HOLD.format(mib=120))
    processes.append(worker)
    wait_ready(worker)
    reading = Sampler(worker.pid).sample()
    decision = halt_decision(reading, Budget(64 * MIB, 64 * MIB))
    assert decision.reason is HaltReason.OVER_BUDGET


def test_readings_keep_the_peak_and_the_mean(processes):
    worker = start(_HOLD.format(mib=50))
    processes.append(worker)
    wait_ready(worker)
    sampler, readings = Sampler(worker.pid, interval_s=0), Readings()
    for _ in range(3):
        readings.add(sampler.sample())
    assert readings.count == 3
    assert readings.peak_rss_bytes >= 50 * MIB
    assert readings.latest is readings.history[-1]
    assert 0 <= readings.mean_cpu_percent <= 100
