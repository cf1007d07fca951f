"""Whether a warm worker can take another share's thread count, and giving it one.

A worker is started with its share's thread variables because libraries read
them once, when they load. A worker kept warm for one shape would be of no use
to a claim of another (``cpus=2`` after ``cpus=1``) if that were the end of it,
and every new shape would pay for a fresh interpreter. It is not quite the end:
what has not been loaded yet will read the environment as it is when it
loads, and some of what has been loaded can be told again.

So a worker takes a new thread count (:func:`take_threads`) when every thread
pool in it will hold that count, and refuses otherwise; a refused worker keeps
its old shape, and the claim gets a fresh worker, as before. What was
measured, and decided from it:

- **Nothing loaded yet** (a worker that has run no cell, or only cells that
  loaded no pool): the new variables in its environment are all it takes. It
  is checked, not assumed: a ``sitecustomize`` may import numpy at start.
- **OpenBLAS, MKL, BLIS**: threadpoolctl sets their count for the whole
  process, and OpenBLAS starts the threads a larger count needs. Each is set
  to what it would have read from the new environment at load
  (``OPENBLAS_NUM_THREADS``, else ``OMP_NUM_THREADS``, and so on), then read
  back; any pool not at its count after that is a refusal.
- **An OpenMP runtime** (libgomp, LLVM's, Intel's) is a refusal. Its count
  set through threadpoolctl holds for the calling thread only: measured with
  libgomp loaded at ``OMP_NUM_THREADS=1``, ``omp_set_num_threads(2)`` read back
  2 in the main thread and 1 in any other, so threadpoolctl's own reading
  looks right while every thread a cell starts keeps the old count.
- **Libraries that size a pool of their own at import** from these variables,
  which threadpoolctl cannot see or set (:data:`SIZED_AT_IMPORT`: numexpr,
  numba, torch, TensorFlow): a refusal once imported.

Only the thread variables change this way. A claim that differs in anything
else (its cards, a variable set on its line) still gets a worker born with it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

#: Modules that read a thread variable into a pool of their own as they are
#: imported, and whose pool threadpoolctl neither lists nor sets.
SIZED_AT_IMPORT = ("numexpr", "numba", "torch", "tensorflow")

#: The pools threadpoolctl sets for the whole process, and the variables each
#: reads at load, the first one set winning.
SET_FOR_THE_PROCESS = {
    "openblas": ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
    "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
}


def take_threads(environ: Mapping[str, str]) -> str | None:
    """Hold every loaded pool to ``environ``'s thread variables; None if done, else why not.

    ``environ`` is the process's environment to be. On a refusal nothing has
    changed; the caller sets the environment only once this said yes.
    """
    imported = [name for name in SIZED_AT_IMPORT if name in sys.modules]
    if imported:
        return f"{imported[0]} sized its threads when it was imported"
    from threadpoolctl import ThreadpoolController

    controller = ThreadpoolController()
    if not controller.lib_controllers:
        return None
    counts = []
    for pool in controller.lib_controllers:
        if pool.user_api == "openmp":
            return f"{pool.prefix} (OpenMP) holds a thread count per thread, not per process"
        names = SET_FOR_THE_PROCESS.get(pool.internal_api)
        if names is None:
            return f"threadpoolctl cannot set {pool.internal_api} ({pool.prefix}) for the process"
        count = _count_read(environ, names)
        if count is None:
            return f"{pool.internal_api} would read no thread count from {', '.join(names)}"
        counts.append((pool, count, pool.num_threads))
    for pool, count, _ in counts:
        pool.set_num_threads(count)
    wrong = [(pool, count, pool.num_threads) for pool, count, _ in counts]
    wrong = [(pool, count, got) for pool, count, got in wrong if got != count]
    if wrong:
        for pool, _, before in counts:
            pool.set_num_threads(before)
        pool, count, got = wrong[0]
        return f"{pool.internal_api} was set to {count} threads and reads back {got}"
    return None


def _count_read(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            try:
                return max(1, int(value))
            except ValueError:
                return None
    return None
