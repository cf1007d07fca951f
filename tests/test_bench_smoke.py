"""The benchmarks still run: every section, at a toy size.

Benchmarks are run by hand, so nothing else would notice one that broke. The
numbers here mean nothing and are not looked at; that the table is whole is.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_every_benchmark_section_runs_at_a_toy_size(tmp_path):
    out = tmp_path / "results.md"
    subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=280,
    )
    report = out.read_text()
    for heading in (
        "The overload story",
        "Running a cell elsewhere",
        "Moving data",
        "A hop to a process that sat idle",
        "The books",
        "A share the OS enforces",
    ):
        assert f"### {heading}" in report
    assert "%%claim, warm worker" in report
    assert "freed share reaches a waiter in another process" in report
    assert "| 1 ms |" in report  # the hop after its shortest idle gap
