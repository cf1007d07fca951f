"""Card memory taken through the driver's own library, for the checks on a real card.

A check on a real card needs something on the card to find: a process
holding a known amount of its memory. torch or cupy would do it in a line,
and bring a gigabyte and a registry with them, on the very machines that
have the cards and often no way to reach one. The NVIDIA driver ships its
CUDA library, ``libcuda.so.1``, beside the card; four of its calls through
``ctypes`` (``cuInit``, ``cuDeviceGet``, ``cuCtxCreate``, ``cuMemAlloc``)
take memory as a framework would, and a ``cuMemsetD8`` writes to all of it
so that it is really there.

Run as a program (``python tests/cuda_memory.py <MiB>``), with
``CUDA_VISIBLE_DEVICES`` naming the card: it takes that much on the first
card it sees, says ``READY`` and holds it until its stdin closes; or says
``CANNOT <why>`` and exits 3. Standard library only, so that it runs in a
claim's worker as it is. Shared by ``tests/real_cards.py`` (the tests) and
``bench/gpu_check.py``.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

#: The driver's CUDA library, as the driver installs it.
LIBRARY = "libcuda.so.1"
#: This file, to run as the allocating program.
PROGRAM = Path(__file__).resolve()


class CudaError(RuntimeError):
    """A driver call failed; says which, and the driver's name for the error."""


def driver_missing() -> str | None:
    """Why the driver's CUDA library cannot be used here; ``None`` if it can be loaded."""
    try:
        ctypes.CDLL(LIBRARY)
    except OSError as error:
        return f"no NVIDIA driver: {LIBRARY} cannot be loaded ({error})"
    return None


def _checked(cuda: ctypes.CDLL, call: str, result: int) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(result, ctypes.byref(name))
        said = name.value.decode() if name.value else "unknown"
        raise CudaError(f"{call} failed with {result} ({said})")


def take(mib: int) -> tuple[ctypes.CDLL, ctypes.c_void_p, ctypes.c_uint64]:
    """``mib`` MiB on the first visible card, written to; held as long as the process lives."""
    cuda = ctypes.CDLL(LIBRARY)
    size = ctypes.c_size_t(mib << 20)
    # The _v2 entry points are what cuda.h's names resolve to since CUDA 4; the
    # plain names are kept only for binaries built before it.
    cuda.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
    _checked(cuda, "cuInit", cuda.cuInit(0))
    device = ctypes.c_int()
    _checked(cuda, "cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(device), 0))
    context = ctypes.c_void_p()
    _checked(cuda, "cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device))
    pointer = ctypes.c_uint64()
    _checked(cuda, "cuMemAlloc", cuda.cuMemAlloc_v2(ctypes.byref(pointer), size))
    _checked(cuda, "cuMemsetD8", cuda.cuMemsetD8_v2(pointer.value, 1, size))
    _checked(cuda, "cuCtxSynchronize", cuda.cuCtxSynchronize())
    return cuda, context, pointer


def main(argv: list[str]) -> int:
    try:
        held = take(int(argv[0]))
    except (OSError, CudaError, AttributeError) as error:
        print(f"CANNOT {type(error).__name__}: {error}".replace("\n", " "), flush=True)
        return 3
    print("READY", flush=True)
    sys.stdin.read()
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
