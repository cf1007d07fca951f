"""The benchmarks still run: every section, at a toy size; the card check, against stand-ins.

Benchmarks are run by hand, so nothing else would notice one that broke. The
numbers here mean nothing and are not looked at; that the table is whole is.
"""

import ctypes.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bench.__main__ import KEPT_ABOVE, SECTIONS, SMOKE, with_findings_kept
from bench.wheelhouse import requirements
from tests.gpu_standins import StandInNvml, StandInSmi, card

ROOT = Path(__file__).resolve().parent.parent


#: What each section's report must hold, run at its toy size.
SECTION_SAYS = {
    "overload": ["### The overload story"],
    "cells": [
        "### Running a cell elsewhere",
        "### The first claim of a notebook, and of a new shape",
        "### Moving data",
        "### Big values a claimed cell made",
        "%%claim, warm worker",
        "first %%claim after %load_ext",
        "8 × 100 MB in a list, made in a claimed cell",
    ],
    # The hop after its shortest idle gap.
    "hop": ["### A hop to a process that sat idle", "| 1 ms |"],
    "books": ["### The books", "freed share reaches a waiter in another process"],
    "enforcement": ["### A share the OS enforces"],
    "metrics": ["### A Prometheus scrape of the books service", "over HTTP: the loop's CPU"],
}


def test_every_benchmark_section_is_smoke_tested():
    assert SECTION_SAYS.keys() == SMOKE.keys() == SECTIONS.keys()


# One test a section, so that the sections run side by side under xdist and a
# broken one is named.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("section", SECTION_SAYS)
def test_each_benchmark_section_runs_at_a_toy_size(tmp_path, section):
    out = tmp_path / "results.md"
    ran = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--only", section, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert ran.returncode == 0, ran.stderr[-4000:]
    report = out.read_text()
    for said in SECTION_SAYS[section]:
        assert said in report, report


def test_a_new_run_replaces_only_the_last_run_and_keeps_what_was_written_above_it():
    """Guards against `python -m bench` wiping what people wrote about the runs: the
    figures against the issues' targets, and why each missed target was missed."""
    shipped = (ROOT / "bench" / "results.md").read_text()
    findings = shipped.partition(KEPT_ABOVE)[0]
    assert "## Against the targets" in findings
    after = with_findings_kept(shipped, "### A section\n", "Run now.\n\n")
    assert after == f"{findings}{KEPT_ABOVE}\n\n## The latest run\n\nRun now.\n\n### A section\n"
    # A file with nothing to keep, or none yet, is the run alone.
    fresh = "# Benchmarks\n\nRun now.\n\n### A section\n"
    assert with_findings_kept(None, "### A section\n", "Run now.\n\n") == fresh
    assert with_findings_kept("# Old\n", "### A section\n", "Run now.\n\n") == fresh


def run_the_card_check(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_card_check_says_there_is_no_card_where_there_is_none(tmp_path):
    ran = run_the_card_check(PATH=str(tmp_path))  # no nvidia-smi on it
    assert ran.returncode == 0, ran.stderr
    assert "There is no card to check here (no card: nvidia-smi" in ran.stdout


def test_every_card_check_says_in_the_summary_what_is_missing_for_it(tmp_path):
    """Guards against `make gpu-check` on a machine without a card, a driver or NVML
    reading as all well: every check, the real-card tests' and the benchmark's, has a
    line of its own, and a skipped one names each absence it met, in its own words."""
    if shutil.which("nvidia-smi") or ctypes.util.find_library("cuda"):
        pytest.skip("this machine has an NVIDIA driver: nothing here is absent")
    ran = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--with-tests"],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{tmp_path}{os.pathsep}{Path(sys.executable).parent}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    summary = ran.stdout.partition("Summary, a line per check:\n")[2].strip().splitlines()
    by_check = dict(line.split(": ", 1) for line in summary)
    real_card_tests = [c for c in by_check if c.startswith("SKIPPED  tests/test_gpu_real.py::")]
    assert len(real_card_tests) >= 6, summary
    no_card, no_driver, no_nvml = "no card: ", "no NVIDIA driver: libcuda.so.1", "no NVML: "
    for check, why in by_check.items():
        assert check.startswith("SKIPPED  "), summary
        assert no_card in why, (check, why)
        if "what a pass over the cards costs" not in check:
            assert no_driver in why, (check, why)
        if "nvml" in check:
            assert no_nvml in why, (check, why)


def test_the_card_check_sets_what_it_reads_beside_what_nvidia_smi_prints(tmp_path):
    """Against stand-ins: the tables are whole, and each process is in them."""
    smi = StandInSmi(tmp_path / "smi", [card(0, utilisation=37, used_mib=1500), card(1)])
    apps = [{"uuid": smi.cards[0]["uuid"], "pid": os.getpid(), "used_mib": 1234}]
    smi.set_apps(apps)
    nvml = StandInNvml(tmp_path / "nvml", smi.cards, apps)
    ran = run_the_card_check(**smi.env(), **nvml.env())
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "| fluksio_nb (nvml) | fluksio_nb (nvidia-smi) | nvidia-smi |" in ran.stdout
    assert "| utilisation | 37% | 37% | 37% |" in ran.stdout
    assert f"pid {os.getpid()} (" in ran.stdout
    assert "| 1,234 MiB | 1,234 MiB | 1,234 MiB |" in ran.stdout
    assert "card 1  " in ran.stdout


def test_the_wheelhouse_is_what_a_kernel_needs_and_pytest_and_no_ray_or_jupyterlab():
    """Guards against a wheel folder that drifts from the package (a new dependency
    missing on the machine with no registry), or that carries Ray or JupyterLab."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = requirements()
    assert set(project["dependencies"]) <= set(wanted)
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in wanted}
    assert {"pytest", "pytest-timeout"} <= names
    assert not names & {"ray", "jupyterlab", "torch", "cupy"}, names
