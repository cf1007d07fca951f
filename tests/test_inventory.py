"""What the machine has, as this process may use it.

The failure guarded against is handing out cores or memory the process cannot
have: a pod with a two-core quota on a 64-core node that believes it has 64.
The cgroup trees here are real files in the layout the kernel writes, and the
``nvidia-smi`` is a real executable on ``PATH``.
"""

import os
import stat

import pytest

from fluksio_nb.gpus import Gpu, detect_gpus, gpus_from_nvml, visible_to_kernel
from fluksio_nb.inventory import (
    _OwnMemory,
    cgroup_cpu_limit,
    cgroup_memory_limit,
    cores_past_reserve,
    host_memory,
    system_headroom_bytes,
    take_inventory,
    usable_cpus,
)
from fluksio_nb.settings import Settings
from tests.stops import said_by


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def v2_tree(tmp_path):
    """A cgroup v2 process in /user.slice/jupyter, with a quota set one level up."""
    root = tmp_path / "cgroup"
    proc = write(tmp_path / "proc-cgroup", "0::/user.slice/jupyter\n")
    write(root / "user.slice" / "cpu.max", "150000 100000\n")
    write(root / "user.slice" / "jupyter" / "cpu.max", "max 100000\n")
    write(root / "user.slice" / "jupyter" / "memory.max", str(3 * 2**30))
    write(root / "user.slice" / "jupyter" / "memory.current", str(2**30))
    return root, proc


def test_a_v2_quota_on_a_parent_limits_the_cores(v2_tree):
    root, proc = v2_tree
    assert cgroup_cpu_limit(root, proc) == 1.5
    # A 1.5-core quota still runs two threads at once, so it rounds up.
    assert usable_cpus(root, proc) == min(2, os.cpu_count(), len(os.sched_getaffinity(0)))


def test_a_v2_memory_limit_is_read(v2_tree):
    root, proc = v2_tree
    assert cgroup_memory_limit(root, proc) == 3 * 2**30


def test_a_v1_quota_and_memory_limit_are_read(tmp_path):
    root = tmp_path / "cgroup"
    proc = write(tmp_path / "proc-cgroup", "4:memory:/pod\n2:cpu,cpuacct:/pod\n")
    write(root / "cpu,cpuacct" / "pod" / "cpu.cfs_quota_us", "100000")
    write(root / "cpu,cpuacct" / "pod" / "cpu.cfs_period_us", "100000")
    write(root / "memory" / "pod" / "memory.limit_in_bytes", str(2 * 2**30))
    assert cgroup_cpu_limit(root, proc) == 1.0
    assert usable_cpus(root, proc) == 1
    assert cgroup_memory_limit(root, proc) == 2 * 2**30


def test_the_kept_open_memory_reader_agrees_with_the_one_that_looks_each_time(v2_tree, tmp_path):
    """The sampling thread's reader finds its files once, but reads what they say every time."""
    root, proc = v2_tree
    current = root / "user.slice" / "jupyter" / "memory.current"
    kept = _OwnMemory(root, proc)
    assert kept.read() == host_memory(root, proc) == (3 * 2**30, 2 * 2**30)
    current.write_text(str(int(2.5 * 2**30)))
    assert kept.read() == host_memory(root, proc) == (3 * 2**30, 2**29)

    v1_root = tmp_path / "v1"
    v1_proc = write(tmp_path / "v1-cgroup", "4:memory:/pod\n")
    write(v1_root / "memory" / "pod" / "memory.limit_in_bytes", str(2 * 2**30))
    write(v1_root / "memory" / "pod" / "memory.usage_in_bytes", str(2**30))
    assert (
        _OwnMemory(v1_root, v1_proc).read() == host_memory(v1_root, v1_proc) == (2 * 2**30, 2**30)
    )


def test_no_limits_means_none(tmp_path):
    root = tmp_path / "cgroup"
    proc = write(tmp_path / "proc-cgroup", "4:memory:/\n1:cpu:/\n")
    write(root / "cpu" / "cpu.cfs_quota_us", "-1")
    write(root / "cpu" / "cpu.cfs_period_us", "100000")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712")
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_memory_limit(root, proc) is None


def test_the_affinity_mask_limits_the_cores():
    """taskset or Slurm pinning: the cores outside the mask are not ours to hand out."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, before)


def test_claimed_work_is_kept_off_the_reserved_cores():
    """The reserve is a real core only if claimed work cannot run on it."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one to keep back and one to claim")
    assert cores_past_reserve(1) == frozenset(cores[1:])
    assert cores_past_reserve(0) is None, "no reserve: nothing to keep work off"
    assert cores_past_reserve(len(cores)) is None, "a reserve of every core pins nothing"


def test_the_reserve_is_kept_back_but_one_core_is_always_claimable():
    assert take_inventory(Settings(cpus=8, reserve_cpus=2)).cpus == 6
    assert take_inventory(Settings(cpus=2, reserve_cpus=4)).cpus == 1


def test_detected_ram_keeps_the_host_headroom_back():
    """Handing out the last byte would only get a claim halted for using it."""
    inventory = take_inventory(Settings())
    assert inventory.ram_bytes == inventory.machine_ram_bytes - system_headroom_bytes(
        inventory.machine_ram_bytes
    )


def test_headroom_is_a_tenth_or_one_gibibyte_whichever_is_more():
    assert system_headroom_bytes(4 * 2**30) == 2**30
    assert system_headroom_bytes(100 * 2**30) == 10 * 2**30


def test_a_declared_inventory_replaces_detection():
    inventory = take_inventory(Settings(cpus=16, gpus=2, ram="64G", reserve_cpus=0))
    assert (inventory.cpus, inventory.gpu_ids, inventory.ram_bytes) == (
        16,
        (0, 1),
        64 * 10**9,
    )
    assert inventory.sources == {"cpus": "declared", "ram": "declared", "gpus": "declared"}


CARDS = [Gpu(0, "A", "GPU-aaaa"), Gpu(1, "B", "GPU-bbbb"), Gpu(2, "C", "GPU-cccc")]


@pytest.mark.parametrize(
    ("visible", "ids"),
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),
        ("GPU-bbbb", [1]),
        ("GPU-cc,1", [2, 1]),
        ("", []),
        ("-1", []),
        ("1,7,2", [1]),
    ],
)
def test_cuda_visible_devices_on_the_kernel_limits_the_claimable_cards(visible, ids):
    """A kernel started seeing two cards has no business handing out the others."""
    assert [card.index for card in visible_to_kernel(CARDS, visible)] == ids


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    """A real executable named nvidia-smi, printing what the real one prints for -L."""
    script = tmp_path / "bin" / "nvidia-smi"
    write(
        script,
        "#!/bin/sh\n"
        'echo "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-0a1b)"\n'
        'echo "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-2c3d)"\n',
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return script


def test_nvidia_smi_is_asked_when_nvml_is_not_there(fake_nvidia_smi):
    if gpus_from_nvml() is not None:
        pytest.skip("NVML answers on this machine, so nvidia-smi is never asked")
    cards, source = detect_gpus()
    assert source == "nvidia-smi"
    assert [(c.index, c.uuid) for c in cards] == [(0, "GPU-0a1b"), (1, "GPU-2c3d")]
    cards, _ = detect_gpus("GPU-2c")
    assert [c.index for c in cards] == [1]


def test_no_nvidia_tools_means_no_cards(monkeypatch, tmp_path):
    if gpus_from_nvml() is not None:
        pytest.skip("NVML answers on this machine: it has real cards")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus() == ([], "none found")


#: Every process below this one listed, a child there to be found, the stop
#: pressed at every moment of the listing, one moment a round; after each, no
#: descriptor may be open that was not before.
STOP_AT_EVERY_MOMENT_OF_LISTING_DESCENDANTS = """
import os, subprocess, sys
import fluksio_nb.inventory as inventory

# Ends when this script does, however it ends: its input closes.
child = subprocess.Popen(
    [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
)
descriptors = len(os.listdir("/proc/self/fd"))

def attempt(made):
    made["found"] = inventory.descendants(os.getpid())

def check():
    if len(os.listdir("/proc/self/fd")) > descriptors:
        return "a_descriptor_left_open"

each_moment([inventory.__file__], attempt, lambda made: None, check)
child.kill()
"""


def test_a_stop_at_any_moment_of_listing_a_processs_descendants_leaves_no_descriptor_open():
    """Guards against a stop landing as a task's list of children was opened, which left
    its descriptor open with nothing holding its number: the listing runs on every
    claimed cell and every reading of a running claim."""
    said = said_by(STOP_AT_EVERY_MOMENT_OF_LISTING_DESCENDANTS, timeout=60)
    assert "stopped_at" in said, said
    assert said["stopped_at"] >= 5, said
