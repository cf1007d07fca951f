"""Benchmarks, run by hand: ``python -m bench``. Every figure is a ratio against a
baseline measured in the same run, on the same machine, a moment apart."""

import os

# A books service a benchmark's kernels started ends a second after they do,
# so the section's scratch directory can go (:func:`bench.harness.scratch`).
os.environ.setdefault("FLUKSIO_BOOKS_LINGER", "1")
