"""Readings of a real worker's process tree.

The failures guarded against: memory held by a child process that the sampler
never sees (a cell running ``!python train.py``), a busy tree read as idle,
and a worker that exits turning the sampler into an exception.
"""

import os
import subprocess
import sys
import time

import psutil
import pytest

from fluksio_nb.budget import Budget, HaltReason, halt_decision
from fluksio_nb.gpu_usage import CardProcess, CardReading, CardsReading
from fluksio_nb.sampler import Readings, Sampler
from tests.stops import said_by

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


def test_a_busy_worker_reads_as_the_cores_it_used(processes):
    """Checked against the process's own CPU clock, so a loaded machine cannot fool it."""
    worker = start("print('ready', flush=True)\nwhile True: pass\n")
    processes.append(worker)
    wait_ready(worker)
    sampler = Sampler(worker.pid, machine_cpus=4)
    clock = psutil.Process(worker.pid)
    before, started = sum(clock.cpu_times()[:2]), time.monotonic()
    time.sleep(0.6)
    reading = sampler.sample()
    used = (sum(clock.cpu_times()[:2]) - before) / (time.monotonic() - started)
    # As much as its own clock says it had, which a loaded machine may make little.
    assert reading.cpu_cores > used / 2, "a spinning process read as idle"
    assert abs(reading.cpu_cores - used) < 0.15
    # A share of the whole machine: cores used over the four it has.
    assert reading.cpu_percent == pytest.approx(100 * reading.cpu_cores / 4, abs=1)


def test_cpu_of_a_child_that_came_and_went_is_not_lost(processes):
    """A short `!cmd` between two readings still used the machine."""
    code = (
        "import subprocess, sys, time\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "subprocess.run([sys.executable, '-c', 'import time\\n"
        "while time.process_time() < 0.5: pass'])\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    processes.append(worker)
    wait_ready(worker)
    sampler = Sampler(worker.pid, machine_cpus=1)
    started = time.monotonic()
    worker.stdin.write("go\n")
    worker.stdin.flush()
    wait_ready(worker)
    reading = sampler.sample()
    # The child spent half a second of CPU, however long the machine made it take.
    assert reading.cpu_cores * (time.monotonic() - started) >= 0.45


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


def card_reading(processes_on_card: dict[int, int], index: int = 0) -> CardsReading:
    """One pass over one card, as the driver would give it: pids and their card memory."""
    return CardsReading(
        cards=(
            CardReading(
                index=index,
                uuid=f"GPU-{index}",
                utilisation_percent=40.0,
                used_bytes=sum(processes_on_card.values()),
                total_bytes=16 * 2**30,
                processes=tuple(
                    CardProcess(driver_pid=pid, pid=pid, used_bytes=used)
                    for pid, used in processes_on_card.items()
                ),
            ),
        ),
        source="nvidia-smi",
        at=0.0,
    )


def test_card_memory_held_by_a_child_of_the_worker_counts_against_its_claim(processes):
    middle = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {_HOLD.format(mib=10)!r}]).wait()\n"
    )
    worker = start(middle)
    processes.append(worker)
    wait_ready(worker)
    child = psutil.Process(worker.pid).children()[0].pid
    stranger = os.getpid()
    reading = card_reading({child: 3 * 2**30, stranger: 5 * 2**30})
    sample = Sampler(worker.pid, gpus=(0,)).sample(cards=reading)
    assert [(c.index, c.held_bytes, c.used_bytes) for c in sample.cards] == [
        (0, 3 * 2**30, 8 * 2**30)
    ]
    assert sample.gpu_bytes == 3 * 2**30 and sample.gpu_percent == 40.0


def test_a_claim_without_cards_or_without_a_card_reading_says_nothing_of_cards(processes):
    worker = start(_HOLD.format(mib=10))
    processes.append(worker)
    wait_ready(worker)
    reading = card_reading({worker.pid: 2**30})
    assert Sampler(worker.pid).sample(cards=reading).gpu_bytes is None
    assert Sampler(worker.pid, gpus=(0,)).sample(cards=None).gpu_bytes is None
    readings = Readings()
    readings.add(Sampler(worker.pid).sample())
    assert readings.peak_gpu_bytes is None


def test_readings_keep_the_peak_card_memory(processes):
    worker = start(_HOLD.format(mib=10))
    processes.append(worker)
    wait_ready(worker)
    sampler, readings = Sampler(worker.pid, gpus=(0,)), Readings()
    for held in (2**30, 3 * 2**30, 2**29):
        readings.add(sampler.sample(cards=card_reading({worker.pid: held})))
    assert readings.peak_gpu_bytes == 3 * 2**30
    assert readings.latest.gpu_bytes == 2**29


#: A process sampled, the stop pressed at every moment of the sampler's code and
#: the tree listing's, one moment a round; after each, the sampler made is
#: closed and the stop forgotten, and no descriptor may be open that was not before.
STOP_AT_EVERY_MOMENT_OF_A_READING = """
import gc, os, subprocess, sys
import fluksio_nb.inventory as inventory
import fluksio_nb.sampler as sampler

# Ends when this script does, however it ends: its input closes.
child = subprocess.Popen(
    [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
)
sampler.Sampler(os.getpid()).sample()
# The machine's memory figures, opened once a process: opened every round.
inventory._own = None
gc.collect()
descriptors = len(os.listdir("/proc/self/fd"))

def attempt(made):
    made["sampler"] = sampler.Sampler(os.getpid())
    made["sampler"].sample()

def undo(made):
    if "sampler" in made:
        made["sampler"].close()
    inventory._own = None

def check():
    if len(os.listdir("/proc/self/fd")) > descriptors:
        return "a_descriptor_left_open"

each_moment([sampler.__file__, inventory.__file__], attempt, undo, check, forgotten=True)
child.kill()
"""


def test_a_stop_at_any_moment_of_a_reading_leaves_no_descriptor_open():
    """Guards against a stop landing as a process's stat file, or the machine's memory
    figures, were opened, which left the descriptor open for good with nothing holding its
    number: a claimed cell makes a sampler each time, and each opens its worker's file."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_A_READING, timeout=60)
    assert "stopped_at" in said, said
    assert said["stopped_at"] >= 20, said
