"""A kernel's values in shared memory are its user's alone.

fluksio_nb moves big values between a kernel and its worker through shared
memory: named files in ``/dev/shm`` made ``O_EXCL`` with mode 0600, and
anonymous memfd files the worker opens through ``/proc/<pid>/fd/<n>``. On a
machine shared by several people, another user must reach neither while a
claimed cell holds its inputs there. These tests run the kernel as one real
Unix user and the attempt as another, so they need root; they skip otherwise.
"""

import json
import os
from pathlib import Path

import psutil
import pytest

from fluksio_nb.segments import SEGMENT_DIR, SEGMENT_PREFIX
from tests.kernels import started_kernel
from tests.unix_users import USER_A, USER_B, ready_user, run_as, shared_tmp_dir
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not os.path.isdir("/proc/self/fd"), reason="reads /proc/<pid>/fd of the kernel"
    ),
]

#: 64 MB of float64: far over the size that goes through shared memory.
BIG_ITEMS = 8 * 2**20

#: Tries every path it is given, and the whole shared-memory directory, as
#: whoever runs it; what each attempt gave, by path.
PROBE = """
import json, os, sys
asked = json.loads(os.environ["PROBE"])
paths = list(asked["paths"])
if asked["scan"]:
    paths += sorted(
        os.path.join(asked["dir"], name)
        for name in os.listdir(asked["dir"])
        if name.startswith(asked["prefix"])
    )
opened, listed = {}, {}
for path in dict.fromkeys(paths):
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        opened[path] = "opened"
    except OSError as error:
        opened[path] = type(error).__name__
for directory in asked["dirs"]:
    try:
        os.listdir(directory)
        listed[directory] = "listed"
    except OSError as error:
        listed[directory] = type(error).__name__
print(json.dumps({"opened": opened, "listed": listed}))
"""


def probe(user, paths, dirs=(), scan=False):
    asked = {
        "paths": list(paths),
        "dirs": list(dirs),
        "scan": scan,
        "dir": SEGMENT_DIR,
        "prefix": SEGMENT_PREFIX,
    }
    tried = run_as(user, PROBE, env={"PROBE": json.dumps(asked)})
    assert tried.returncode == 0, tried.stderr
    return json.loads(tried.stdout)


@pytest.fixture(scope="module")
def users():
    return ready_user(USER_A), ready_user(USER_B)


@pytest.fixture(scope="module")
def shared():
    with shared_tmp_dir() as directory:
        yield directory


@pytest.fixture(scope="module")
def kernel(users, shared):
    with started_kernel(
        user=users[0],
        FLUKSIO_CPUS="2",
        FLUKSIO_RESERVE_CPUS="0",
        # The kernel keeps its books to itself: nothing here is about the books.
        FLUKSIO_LEDGER="kernel",
        FLUKSIO_CONFIG=str(shared / "fluksio_nb.json"),
    ) as k:
        yield k


def processes_of(kernel) -> list[psutil.Process]:
    """The kernel and everything it started: its workers."""
    top = psutil.Process(kernel.pid)
    return [top, *top.children(recursive=True)]


def is_segment(target: str) -> bool:
    """Whether a descriptor or mapping refers to a shared-memory segment, named or memfd."""
    named = os.path.join(SEGMENT_DIR, SEGMENT_PREFIX)
    return target.startswith((named, f"/memfd:{SEGMENT_PREFIX}"))


def segment_mappings(process: psutil.Process) -> list[str]:
    """The ``/proc/<pid>/map_files`` entries of the process's shared-memory segments."""
    found = []
    try:
        with open(f"/proc/{process.pid}/maps") as maps:
            lines = maps.readlines()
    except FileNotFoundError:
        return []  # ended since it was listed
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and is_segment(fields[5].strip()):
            found.append(f"/proc/{process.pid}/map_files/{fields[0]}")
    return found


def named_segments(pids: set[int]) -> list[str]:
    """The files in the shared-memory directory that these processes created."""
    return [
        str(path)
        for path in Path(SEGMENT_DIR).glob(f"{SEGMENT_PREFIX}*")
        if path.name[len(SEGMENT_PREFIX) :].partition("-")[0] in {str(pid) for pid in pids}
    ]


def descriptors(process: psutil.Process) -> dict[str, str]:
    """Each open descriptor's ``/proc`` path, and what it refers to."""
    found = {}
    directory = f"/proc/{process.pid}/fd"
    for fd in os.listdir(directory):
        path = os.path.join(directory, fd)
        try:
            found[path] = os.readlink(path)
        except FileNotFoundError:
            continue  # closed since the listing
    return found


def test_another_user_cannot_open_a_kernels_shared_memory_while_a_claimed_cell_holds_it(
    kernel, users, shared
):
    """Guards against one user reading or writing another's arrays on a shared machine.

    User A's kernel sends a 64 MB array to a claimed cell, which holds it,
    mapped, until the test lets it go; the kernel also holds a parcel packed
    the way a worker sends its results back, in a named file. User B then
    tries every ``/dev/shm/fluksio*`` file and every descriptor and segment
    mapping of A's kernel and workers, and must be refused each one. A tries
    the segments too, and must get them: the paths are real, so B's refusal
    is the permissions and not a wrong path.
    """
    user_a, user_b = users
    release = shared / "release"
    kernel.run(f"import numpy as np\nbig = np.ones({BIG_ITEMS})", check=True)
    kernel.run("from fluksio_nb import transfer\nheld = transfer.pack({'big': big})", check=True)
    kernel.start_job(
        "%%claim cpus=1 --background --in big\nimport os, time\n"
        "total = float(big.sum())\n"
        "deadline = time.monotonic() + 180\n"
        f"while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)",
        "job",
    )
    try:
        # The worker has the array mapped once a segment shows in its maps.
        assert wait_until(
            lambda: any(segment_mappings(p) for p in processes_of(kernel)[1:]), timeout=60
        ), "the claimed cell's worker never mapped its input"
        processes = processes_of(kernel)
        assert all(p.uids().effective == user_a.uid for p in processes)

        mine = {p.pid for p in processes}
        named = named_segments(mine)
        open_files = {path: target for p in processes for path, target in descriptors(p).items()}
        held_open = [path for path, target in open_files.items() if is_segment(target)]
        mappings = [path for p in processes for path in segment_mappings(p)]
        assert named, f"A's kernel holds no named segment in {SEGMENT_DIR}"
        assert held_open, "A's kernel holds no segment open for the claimed cell's input"
        assert mappings, "A's worker has no segment mapped"

        as_b = probe(
            user_b,
            [*named, *open_files, *mappings],
            dirs=[f"/proc/{pid}/{kind}" for pid in mine for kind in ("fd", "map_files")],
            scan=True,
        )
        as_a = probe(user_a, [*named, *held_open])
    finally:
        release.touch()
        total = kernel.facts("job.result(60)['total']")
        kernel.run("held.discard()", check=True)

    assert total == BIG_ITEMS
    of_a = set(named) | set(open_files) | set(mappings)
    assert {path: as_b["opened"][path] for path in of_a} == dict.fromkeys(of_a, "PermissionError")
    # Anyone else's segments in the directory, which may come and go meanwhile.
    others = {path: how for path, how in as_b["opened"].items() if path not in of_a}
    assert not [path for path, how in others.items() if how == "opened"], others
    assert set(as_b["listed"].values()) == {"PermissionError"}, as_b["listed"]
    assert set(as_a["opened"].values()) == {"opened"}, as_a["opened"]
