"""A result the kernel has no room for is refused by name, and the kernel lives.

The failure guarded against: a claimed cell whose worker may hold more than
the kernel may makes a big value, and rebuilding it in the kernel is the
allocation past the kernel's memory limit, so the OOM killer takes the
kernel and every variable the notebook had.

The kernel is given little room honestly: a memory cgroup of its own with a
small limit, as a hub's pod or an admin's kernel limit gives it. It is moved
in alone, after its worker has started, so that the worker stays outside, as
cgroup v2 puts claims beside the kernel; pages are charged where they were
first touched, so the kernel's cgroup holds only what the kernel allocates
from then on. Making the cgroup takes a memory controller this process may
write to (root, in CI); elsewhere the test skips and says what is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fluksio_nb.claim_cgroups import remove_cgroup
from fluksio_nb.memory_cap import find_cap_place
from tests.kernels import Kernel

#: The kernel's room once moved in: what it allocates from then on.
KERNEL_LIMIT = 300 << 20


@pytest.fixture
def small_cgroup():
    """A memory cgroup limited to :data:`KERNEL_LIMIT`, removed at the end."""
    place = find_cap_place()
    if not place.available:
        pytest.skip(f"needs a memory cgroup this process may make: {place.why_not}")
    # v1: under the process's own memory cgroup; v2: beside it, where memory is handed down.
    cgroup = place.parent.parent / f"fluksio-room-test-{os.getpid()}"
    cgroup.mkdir()
    try:
        limit_file = "memory.max" if (cgroup / "memory.max").exists() else "memory.limit_in_bytes"
        (cgroup / limit_file).write_text(str(KERNEL_LIMIT))
        yield cgroup
    finally:
        remove_cgroup(cgroup)


def shm_files_of(pid: int) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"fluksio-{pid}-"))


def test_a_result_bigger_than_the_kernel_may_hold_is_refused_and_the_kernel_answers(
    small_cgroup: Path,
):
    """Ten million floats pickle to 90 MB and rebuild to 400: past the kernel's cgroup limit.

    Guards against the kernel being killed by its cgroup's OOM killer while
    rebuilding a result, and against the refusal taking the other names with it.
    """
    kernel = Kernel(
        FLUKSIO_CPUS="2", FLUKSIO_RAM="8G", FLUKSIO_RESERVE_CPUS="0", FLUKSIO_LEDGER="kernel"
    )
    try:
        kernel.run("%%claim cpus=1\nimport os\nfirst_worker = os.getpid()", check=True)
        (small_cgroup / "cgroup.procs").write_text(str(kernel.pid))
        ran = kernel.run(
            "%%claim cpus=1\nimport os\nsame_worker = os.getpid()\nsmall = 42\n"
            "floats = [float(i) for i in range(10_000_000)]",
            timeout=90,
        )
        assert ran.error is not None, f"the cell should end with an error: {ran.so_far()}"
        assert ran.error["ename"] == "NotBroughtBack", ran.so_far()
        said = ran.error["evalue"]
        assert "floats (too big for the kernel" in said, said
        assert "MiB" in said and str(small_cgroup) in said, "the sizes and the room, named"
        assert "del" in said and "--out" in said, "what to do, said"
        facts = kernel.facts(
            "{'small': small, 'same': same_worker == first_worker, 'floats': 'floats' in globals()}"
        )
        assert facts == {"small": 42, "same": True, "floats": False}
        assert kernel.run("6 * 7", check=True).texts == ["42"], "the kernel must answer"
        worker = kernel.facts("same_worker")
        assert shm_files_of(kernel.pid) == shm_files_of(worker) == [], "no file left in /dev/shm"
    finally:
        kernel.shutdown()
