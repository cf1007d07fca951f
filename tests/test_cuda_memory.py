"""The real-card checks' allocation, through a stand-in ``libcuda.so.1`` built by the test.

The real-card checks take card memory through the driver's library with
``ctypes`` (:mod:`tests.cuda_memory`), and only run where there is a card:
a mistake in a call's name or arguments would first show on the machine
with the card, the one place nobody can fix it from. So here a small C
library of the same name and calls, compiled by the test and found as the
real one is (``LD_LIBRARY_PATH``, by ``dlopen``), takes the calls: each is
logged with its arguments, and ``cuMemAlloc`` really allocates, so the
memset over it is real memory written. The failure guarded against: a
check that cannot allocate on a real card, or that says "READY" holding
nothing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.cuda_memory import LIBRARY
from tests.real_cards import CannotAllocate, holding

MIB = 1 << 20

_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void logged(const char *call, unsigned long long value) {
    const char *path = getenv("STANDIN_CUDA_CALLS");
    FILE *log = path ? fopen(path, "a") : NULL;
    if (log) { fprintf(log, "%s %llu\n", call, value); fclose(log); }
}

static int failing(const char *call) {
    const char *fail = getenv("STANDIN_CUDA_FAIL");
    return fail && strcmp(fail, call) == 0;
}

int cuInit(unsigned int flags) { logged("cuInit", flags); return 0; }
int cuDeviceGet(int *device, int ordinal) {
    logged("cuDeviceGet", ordinal); *device = ordinal; return 0;
}
int cuCtxCreate_v2(void **context, unsigned int flags, int device) {
    logged("cuCtxCreate_v2", device); *context = (void *)0x1; return 0;
}
int cuMemAlloc_v2(unsigned long long *pointer, size_t size) {
    logged("cuMemAlloc_v2", size);
    if (failing("cuMemAlloc_v2")) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    *pointer = (unsigned long long)malloc(size);
    return *pointer ? 0 : 2;
}
int cuMemsetD8_v2(unsigned long long pointer, unsigned char value, size_t size) {
    logged("cuMemsetD8_v2", size); memset((void *)pointer, value, size); return 0;
}
int cuCtxSynchronize(void) { logged("cuCtxSynchronize", 0); return 0; }
int cuGetErrorName(int error, const char **name) {
    *name = error == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_UNKNOWN"; return 0;
}
"""


@pytest.fixture
def standin_libcuda(tmp_path, monkeypatch) -> Path:
    """A ``libcuda.so.1`` of the test's, first on ``LD_LIBRARY_PATH``; its calls' log."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler (cc) to build a stand-in libcuda.so.1")
    source = tmp_path / "libcuda.c"
    source.write_text(_SOURCE)
    built = tmp_path / "lib" / LIBRARY
    built.parent.mkdir()
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(built), str(source)],
        check=True,
        capture_output=True,
    )
    calls = tmp_path / "calls"
    monkeypatch.setenv("LD_LIBRARY_PATH", str(built.parent))
    monkeypatch.setenv("STANDIN_CUDA_CALLS", str(calls))
    monkeypatch.delenv("STANDIN_CUDA_FAIL", raising=False)
    return calls


def test_card_memory_is_taken_through_libcuda_and_written_to(standin_libcuda):
    with holding(mib=64) as process:
        calls = standin_libcuda.read_text().splitlines()
        # Written to, so held: the allocation is in the process's memory, not promised.
        assert psutil.Process(process.pid).memory_info().rss >= 64 * MIB
    assert calls == [
        "cuInit 0",
        "cuDeviceGet 0",
        "cuCtxCreate_v2 0",
        f"cuMemAlloc_v2 {64 * MIB}",
        f"cuMemsetD8_v2 {64 * MIB}",
        "cuCtxSynchronize 0",
    ]


def test_a_driver_that_cannot_allocate_is_said_in_its_own_words(standin_libcuda, monkeypatch):
    monkeypatch.setenv("STANDIN_CUDA_FAIL", "cuMemAlloc_v2")
    said = r"cuMemAlloc failed with 2 \(CUDA_ERROR_OUT_OF_MEMORY\)"
    with pytest.raises(CannotAllocate, match=said), holding(mib=64):
        pass
