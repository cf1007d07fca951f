"""Which pages of a copy-on-write mapping a process wrote, as the OS tells it.

The failure guarded against is a change taken for no change: an input a
cell wrote to that is not sent back loses the user's change. Both ways of
asking (``PAGEMAP_SCAN`` and reading ``/proc/self/pagemap`` whole) must give
the same runs, however many, and clipped to the range asked about.
"""

from __future__ import annotations

import mmap
import os
import platform

import numpy as np
import pytest

from fluksio_nb import written_pages
from fluksio_nb.written_pages import changed_runs

PAGE = mmap.PAGESIZE


@pytest.fixture
def mapped():
    """64 MiB of a shared-memory file, mapped copy-on-write, as bytes one can write."""
    nbytes = 64 << 20
    fd = os.memfd_create("written-pages-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    os.pwrite(fd, b"\1" * nbytes, 0)
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE)
    array = np.frombuffer(mapping, dtype=np.uint8)
    os.close(fd)  # the mapping keeps the file; it goes with the array
    return array


@pytest.fixture(params=["scan", "read"])
def way(request, monkeypatch):
    """Each way of asking, forced; the scan only where this kernel has it."""
    if request.param == "scan":
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
        try:
            can = written_pages._scanned(fd, mmap.PAGESIZE, mmap.PAGESIZE) is not None
        finally:
            os.close(fd)
        if not can:
            pytest.skip(f"PAGEMAP_SCAN needs Linux 6.7 or later; this is {platform.release()}")
        monkeypatch.setattr(written_pages, "_can_scan", True)
    else:
        monkeypatch.setattr(written_pages, "_can_scan", False)
    return request.param


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_pages_only_read_are_not_written(mapped, way):
    """Reading every page of the mapping makes none of them the process's own."""
    assert int(mapped.sum()) == mapped.nbytes
    assert changed_runs(address(mapped), mapped.nbytes) == []


def test_every_written_run_is_found_however_many_there_are(mapped, way):
    """200 separate writes come back as 200 runs, more than one scan returns at once."""
    expected = []
    for run in range(200):
        at = run * 3 * PAGE
        mapped[at : at + 2 * PAGE] = 7
        expected.append((address(mapped) + at, 2 * PAGE))
    assert changed_runs(address(mapped), mapped.nbytes) == expected


def test_runs_are_clipped_to_the_range_asked_about(mapped, way):
    """A range starting and ending inside written pages gives only its own bytes."""
    mapped[: 4 * PAGE] = 3
    start = address(mapped) + PAGE + 100
    assert changed_runs(start, PAGE) == [(start, PAGE)]
    assert changed_runs(address(mapped) + 4 * PAGE, PAGE) == []


def test_one_written_byte_counts_as_its_page(mapped, way):
    """Writing a single byte is a change: the page it lies on is the process's own."""
    mapped[5 * PAGE + 17] = 9
    assert changed_runs(address(mapped), mapped.nbytes) == [(address(mapped) + 5 * PAGE, PAGE)]
