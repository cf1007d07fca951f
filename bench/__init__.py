"""Benchmarks, run by hand: ``python -m bench``. Every figure is a ratio against a
baseline measured in the same run, on the same machine, a moment apart."""
