"""The memory a claimed cell's data path uses, read from the OS in real kernels.

A notebook's data is often the biggest thing on the machine, and a claim
promises that a cell uses what it asked for and no more: what it was sent
is not kept between cells, what it did not change does not travel back, and
a kernel that stopped running claimed cells gives its shared memory back.

Memory is read per process, never machine-wide, so that another suite on
the same machine cannot move the numbers: the shared-memory files the
kernel and its workers hold open or mapped (each counted once, at its size),
and the worker's resident memory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from fluksio_nb.segments import SEGMENT_PREFIX
from tests.kernels import Kernel

MB = 1 << 20

#: How much a warm worker's memory, or the shared memory a kernel holds, may
#: move over cells that leave nothing behind: allocator noise, not a value.
NOISE_BYTES = 16 * MB


@pytest.fixture(scope="module")
def kernel():
    started = Kernel(FLUKSIO_LEDGER="kernel")
    try:
        yield started
    finally:
        started.shutdown()


def workers_of(kernel: Kernel) -> list[psutil.Process]:
    return [
        child
        for child in psutil.Process(kernel.pid).children(recursive=True)
        if "fluksio_nb.worker" in " ".join(child.cmdline())
    ]


def shared_memory_held(pids: list[int]) -> int:
    """The memory of every transfer file these processes hold open or mapped, each file once.

    A file a process holds open is counted by the pages it has (a moved
    array's file is sparse, and far larger than its pages); one it only maps,
    by the mapping.
    """
    held: dict[int, int] = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if SEGMENT_PREFIX in os.readlink(fd):
                    stat = os.stat(fd)
                    held[stat.st_ino] = stat.st_blocks * 512
            except OSError:
                continue
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and SEGMENT_PREFIX in fields[5]:
                low, high = (int(bound, 16) for bound in fields[0].split("-"))
                held.setdefault(int(fields[4]), high - low)
    return sum(held.values())


def memory_used(kernel: Kernel) -> int:
    """What the kernel and its workers take of the machine's memory: private, and shared once."""
    pids = [kernel.pid, *(w.pid for w in workers_of(kernel))]
    private = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                private += int(line.split()[1]) * 1024
    return private + shared_memory_held(pids)


def held_by(kernel: Kernel) -> int:
    return shared_memory_held([kernel.pid, *(w.pid for w in workers_of(kernel))])


def the_line(ran) -> str:
    """The claim's one line of facts, as the cell shows it once it ended."""
    return next(text for text in reversed(ran.texts) if ": ok" in text or ": error" in text)


def test_cells_that_only_read_a_big_input_keep_nothing_and_send_nothing_back(kernel):
    """Guards against a warm worker keeping every cell's inputs, and a read sending them back.

    ``data.sum()`` hands ``data`` to a call, so the kernel asks the worker to
    send it back if the cell changed it. It did not: 20 cells of it once kept
    10 GB in the worker and sent 512 MB back each time.
    """
    kernel.run("import numpy as np\ndata = np.ones(64 * 2**20)\nbefore = id(data)", check=True)
    first = kernel.run("%%claim\nm = float(data.sum())", check=True)
    assert "sent 536.9MB in" in the_line(first)
    assert " back" not in the_line(first), the_line(first)
    (worker,) = workers_of(kernel)
    rss, shared = worker.memory_info().rss, held_by(kernel)
    for _ in range(19):
        ran = kernel.run("%%claim\nm = float(data.sum())", check=True)
        assert " back" not in the_line(ran), the_line(ran)
    assert workers_of(kernel) == [worker], "the same warm worker ran every cell"
    assert worker.memory_info().rss - rss <= NOISE_BYTES
    assert held_by(kernel) - shared <= NOISE_BYTES
    assert kernel.facts("[m, id(data) == before]") == [64 * 2**20, True]


@pytest.mark.parametrize(
    ("setup", "cell", "check"),
    [
        (
            "import numpy as np\ndata = np.arange(32 * 2**20, dtype=np.float64)",
            "data *= 2",
            "[float(data[3]), float(data[-1])] == [6.0, 2 * (32 * 2**20 - 1)]",
        ),
        (
            "import numpy as np\ndata = np.arange(32 * 2**20, dtype=np.float64)[::-1].copy()",
            "data.sort()",
            "[float(data[0]), float(data[-1])] == [0.0, 32 * 2**20 - 1]",
        ),
        (
            "import numpy as np, pandas as pd\n"
            "df = pd.DataFrame({'a': np.zeros(4 * 2**20), 'b': np.ones(4 * 2**20)})",
            'df.loc[0, "a"] = 1',
            "[float(df.loc[0, 'a']), float(df['a'].sum()), float(df['b'].sum())] "
            "== [1.0, 1.0, 4 * 2**20]",
        ),
        ("lst = [0] * 1000", "lst.append(1)", "len(lst) == 1001 and lst[-1] == 1"),
        (
            "import numpy as np\ndata = np.zeros(32 * 2**20)",
            "data[12345] = 7",
            "float(data[12345]) == 7.0 and float(data.sum()) == 7.0",
        ),
    ],
    ids=["multiply", "sort", "dataframe-loc", "list-append", "one-element"],
)
def test_a_change_made_in_place_by_a_claimed_cell_is_in_the_kernel(kernel, setup, cell, check):
    """Guards against an input changed in place being taken for unchanged and left behind."""
    kernel.run(setup, check=True)
    kernel.run(f"%%claim\n{cell}", check=True)
    assert kernel.facts(check) is True


def test_a_change_to_a_few_pages_of_a_big_input_moves_only_those_pages(kernel):
    """Guards against one element changed in a 256 MB input moving all of it back."""
    kernel.run("import numpy as np\ndata = np.zeros(32 * 2**20)", check=True)
    ran = kernel.run("%%claim\ndata[12345] = 7", check=True)
    line = the_line(ran)
    assert "sent 268.4MB in" in line
    # Said from a megabyte on: one page is not worth a word.
    assert " back" not in line, line


def test_an_idle_kernel_keeps_no_memory_for_moving_values_beyond_the_values(kernel):
    """Guards against a kernel keeping a GB of shared memory for minutes after moving values.

    A 1 GB value in and a 1 GB value out: ten seconds on, the kernel and its
    worker take the memory of the two values and no more than 64 MB besides,
    however the values are held (a moved input's memory is a shared file's
    now, and ``big_out`` lies on the file it came back on).
    """
    kernel.run("%%claim\nwarm = 1", check=True)  # its worker's own memory, before any value
    kernel.run("import numpy as np\nbig_in = np.ones(128 * 2**20)", check=True)
    before = memory_used(kernel)
    kernel.run("%%claim\nbig_out = big_in * 2", check=True)
    value = kernel.facts("big_out.nbytes")
    deadline = time.monotonic() + 10
    while (extra := memory_used(kernel) - before - value) > 64 * MB:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert extra <= 64 * MB, f"{extra / MB:.0f} MB beside the values, 10 s after the cell"
    assert kernel.facts("[float(big_out[7]), float(big_in[7])]") == [2.0, 1.0]


def test_a_name_bound_to_an_input_in_a_claimed_cell_shares_its_memory(kernel):
    """Guards against `b = data` coming back as a copy, or as a mapping a later cell changes.

    As in a normal cell, ``b`` is the same memory as ``data``: a change to
    one, in the kernel or in a later claimed cell, is in the other.
    """
    kernel.run("import numpy as np\ndata = np.zeros(8 * 2**20)", check=True)
    kernel.run("%%claim\nb = data", check=True)
    assert kernel.facts("bool(np.shares_memory(b, data))") is True
    kernel.run("data[3] = 1.0", check=True)
    kernel.run("%%claim\ndata[4] = 2.0", check=True)
    assert kernel.facts("[float(b[3]), float(b[4]), float(data.sum())]") == [1.0, 2.0, 3.0]
