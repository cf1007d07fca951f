"""A big array of the kernel's moved onto shared memory where it lies, read back from the OS.

The failures guarded against are the ones that would cost a user their
kernel or their data: an array that changes value, address or identity as
it moves; a change the kernel made after the move that a later send misses;
a file written under a receiver that still maps it; memory that is not given
back; a ``resize`` or a ``fork`` that the move breaks.
"""

from __future__ import annotations

import fcntl
import gc
import mmap
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from fluksio_nb import shared_in_place
from fluksio_nb.shared_in_place import MOVE_FROM, give_back, share, view_of
from fluksio_nb.written_pages import changed_runs

FLOATS = 8 * MOVE_FROM // 8  # 256 MiB of float64


@pytest.fixture
def big():
    array = np.arange(FLOATS, dtype=np.float64)
    yield array
    for path in list(shared_in_place._moved):
        give_back(path)


def send(array: np.ndarray) -> shared_in_place.Shared | None:
    raw = memoryview(array).cast("B")
    return share(raw, array.__array_interface__["data"][0])


def private_pages(array: np.ndarray) -> int:
    """Pages under ``array`` that are the process's own rather than a file's."""
    runs = changed_runs(array.__array_interface__["data"][0], array.nbytes)
    assert runs is not None, "this test needs /proc/self/pagemap"
    return sum(length for _, length in runs) // mmap.PAGESIZE


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def file_holds(path: str, offset: int, nbytes: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def test_a_moved_array_is_the_same_object_at_the_same_address_with_the_same_bytes(big):
    """Guards against the move changing anything a notebook can see, and against a second copy."""
    address, before = big.__array_interface__["data"][0], rss_anon()
    assert private_pages(big) == big.nbytes // mmap.PAGESIZE
    shared = send(big)
    assert shared is not None and shared.written >= big.nbytes
    assert big.__array_interface__["data"][0] == address
    assert big[12345] == 12345.0 and float(big[-1]) == FLOATS - 1
    assert private_pages(big) == 0, "every page is the file's now"
    assert before - rss_anon() >= big.nbytes - 16 * 2**20, "the private copy was given back"
    assert file_holds(shared.path, shared.offset + 8 * 7, 8) == np.float64(7).tobytes()


def test_an_array_sent_again_unchanged_costs_nothing_and_a_change_costs_its_pages(big):
    """Guards against a change the kernel made after the move being missed by the next send."""
    first = send(big)
    assert first is not None
    give_back(first.path)
    again = send(big)
    assert again is not None and (again.path, again.written) == (first.path, 0)
    give_back(again.path)
    big[1000] = -1.0
    assert private_pages(big) == 1
    changed = send(big)
    assert changed is not None and changed.written == mmap.PAGESIZE
    assert file_holds(changed.path, changed.offset + 8 * 1000, 8) == np.float64(-1).tobytes()
    assert private_pages(big) == 0
    assert big[1000] == -1.0 and big[999] == 999.0


def test_the_file_is_lent_to_one_parcel_at_a_time(big):
    """Guards against two workers mapping one file, one writing it under the other."""
    first = send(big)
    assert first is not None
    assert send(big) is None, "lent already: the second send copies"
    give_back(first.path)
    assert send(big) is not None


def test_a_file_a_receiver_maps_is_never_written_under_it(big):
    """Guards against the kernel's next send changing a worker's input as it runs."""
    first = send(big)
    assert first is not None
    give_back(first.path)
    receiver = os.open(first.path, os.O_RDONLY)  # a worker holds a shared lock while it maps
    try:
        fcntl.flock(receiver, fcntl.LOCK_SH)
        big[0] = 42.0
        assert send(big) is None, "changed, and held: copied instead"
        assert file_holds(first.path, first.offset, 8) == np.float64(0).tobytes()
    finally:
        os.close(receiver)
    assert send(big) is not None


def test_a_value_sent_back_on_the_file_is_rebuilt_as_a_view_of_the_array(big):
    """Guards against `b = data` coming back as a second mapping a later send would change."""
    shared = send(big)
    assert shared is not None
    tail = view_of(shared.path, shared.offset + 8 * 10, 8 * 100)
    assert tail is not None
    rebuilt = np.frombuffer(tail, dtype=np.float64)
    assert np.shares_memory(rebuilt, big) and rebuilt[0] == 10.0
    big[10] = -5.0
    assert rebuilt[0] == -5.0


def test_a_moved_array_can_still_be_resized_and_grows_without_a_fault(big):
    """Guards against realloc's mremap growing the file mapping past the file's end (SIGBUS),
    and against the move making ``resize`` refuse (numpy refuses arrays with weak references).
    """
    shared = send(big)
    assert shared is not None
    give_back(shared.path)
    big.resize(FLOATS * 4, refcheck=False)
    big[-1] = 3.0
    assert big[FLOATS - 1] == FLOATS - 1 and big[FLOATS] == 0.0 and big[-1] == 3.0
    assert send(big) is None, "its memory is no longer known to be its alone: copied"
    assert shared.path not in shared_in_place._moved, "the old file is let go of"


def test_the_file_goes_with_the_array():
    """Guards against a moved array's memory outliving it by more than a look."""
    array = np.ones(FLOATS)
    shared = send(array)
    assert shared is not None
    give_back(shared.path)
    fd = int(shared.path.rsplit("/", 1)[1])
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:fluksio-")
    del array
    gc.collect()
    deadline = time.monotonic() + 3 * shared_in_place.LOOK_AGAIN_S
    while shared.path in shared_in_place._moved and time.monotonic() < deadline:
        time.sleep(0.05)
    assert shared.path not in shared_in_place._moved, "its file is let go of once it is freed"
    with pytest.raises(OSError):
        os.readlink(f"/proc/self/fd/{fd}")


def test_a_new_array_where_a_freed_one_lay_is_sent_with_its_own_bytes():
    """Guards against the quick look at a moved array's mapping taking a new array, made
    where a freed one lay, for the old one: its send would be the old file's stale bytes.
    """
    old = np.ones(FLOATS)
    shared = send(old)
    assert shared is not None
    give_back(shared.path)
    address = old.__array_interface__["data"][0]
    del old
    gc.collect()
    new = np.zeros(FLOATS)  # calloc: fresh pages, none of them written
    assert new.__array_interface__["data"][0] == address, "glibc maps the freed hole again"
    again = send(new)
    assert again is not None
    give_back(again.path)
    last = again.offset + new.nbytes - 8
    assert file_holds(again.path, last, 8) == np.float64(0).tobytes(), "the old array's bytes"


def test_an_array_changed_in_pieces_is_still_sent_by_reference():
    """Guards against a moved array whose mapping a change split into pieces being let go of
    (its file closed, its next send a copy) because it is no longer one mapping.
    """
    big = np.arange(FLOATS, dtype=np.float64)
    first = send(big)
    assert first is not None
    give_back(first.path)
    big[1000] = -1.0
    big[FLOATS // 2] = -2.0
    changed = send(big)
    assert changed is not None and changed.path == first.path
    give_back(changed.path)
    again = send(big)
    assert again is not None and (again.path, again.written) == (first.path, 0)
    give_back(again.path)


#: Run in a process of its own: this one has threads (the look for freed
#: arrays is one), and forking a process with threads is what a notebook's
#: multiprocessing does, not what a test should.
FORKED = """
import os, numpy as np
from fluksio_nb.shared_in_place import give_back, share
big = np.arange(2**25, dtype=np.float64)
shared = share(memoryview(big).cast("B"), big.__array_interface__["data"][0])
assert shared is not None, "not moved"
give_back(shared.path)
child = os.fork()
if child == 0:
    big[5] = -1.0
    os._exit(0 if big[5] == -1.0 else 1)
_, status = os.waitpid(child, 0)
assert os.waitstatus_to_exitcode(status) == 0, "the child's write did not land in its own copy"
assert big[5] == 5.0, "the child's write reached the parent"
print("ok")
"""


def test_a_fork_of_the_kernel_keeps_its_writes_to_a_moved_array_its_own():
    """Guards against the move making a forked child's writes the parent's, as sharing would."""
    ran = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr


def test_arrays_whose_memory_is_not_known_stay_where_they_are():
    """Guards against mapping a file over memory that is not the array's alone."""
    small = np.ones(MOVE_FROM // 8 - 1)
    assert send(small) is None, "under the size glibc always maps alone"
    borrowed = np.frombuffer(bytearray(MOVE_FROM * 2), dtype=np.uint8)
    assert send(borrowed) is None, "a bytearray's memory, not the array's"
    whole = np.ones(FLOATS)
    assert share(memoryview(whole[:10]).cast("B"), whole.__array_interface__["data"][0]) is None, (
        "a few rows of a big array do not move all of it"
    )
