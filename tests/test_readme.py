"""The README's examples run, and the reference in docs/ is the code's own help, word for word.

The failure guarded against is documentation that drifts: an option added to
the parser but not to docs/reference.md, a README example the code no longer
accepts, or a figure docs/measured.md quotes that the benchmark results no
longer say. tests/test_doc_links.py holds the links between the pages.
"""

import inspect
import re
from pathlib import Path

import pytest

from bench.__main__ import KEPT_ABOVE
from fluksio_nb.claim_line import claim_parser
from fluksio_nb.context import claim
from fluksio_nb.settings import load_settings
from tests.kernels import started_kernel

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
MEASURED = (ROOT / "docs" / "measured.md").read_text()


def section(page: str, heading: str) -> str:
    """A page's ``## heading`` section, up to the next one or the page's end."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", page, re.S | re.M)
    assert match, f"no section {heading!r}"
    return match[1]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def quoted(marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\n```text\n(.*?)```\n<!-- /{marker} -->", REFERENCE, re.S)
    assert match, f"docs/reference.md has no {marker} block"
    return match[1]


def test_the_reference_quotes_claim_help_exactly():
    assert quoted("claim-help") == claim_parser().format_help()


def test_the_reference_quotes_the_context_managers_signature_and_doc():
    expected = f"claim{inspect.signature(claim)}\n\n{inspect.getdoc(claim)}\n"
    assert quoted("claim-doc") == expected


def test_the_readme_opens_with_the_two_commands():
    commands = re.search(r"```bash\n(.*?)```", README, re.S)[1].splitlines()
    assert [line.split()[0:2] for line in commands] == [["make", "lab"], ["make", "test"]]


@pytest.mark.timeout(180)
def test_the_first_claims_cells_run_as_pasted_each_into_a_cell_of_its_own(tmp_path):
    """Guards against the first example a newcomer pastes failing: three cells shown as one
    block failed with `Line magic function %%claim not found`. On two cores, its cpus=2 is
    given the one core past the reserve, with the warning the README promises, and OpenBLAS
    starts the one thread it says, not the two an earlier text promised."""
    cells = blocks(section(README, "A first claim"), "python")
    assert len(cells) == 3
    with started_kernel(tmp_path, FLUKSIO_CPUS="2", FLUKSIO_RAM="8G") as kernel:
        ran = [kernel.run(cell) for cell in cells]
        assert [r.status for r in ran] == ["ok"] * 3, [r.so_far() for r in ran]
        assert "ClampedWarning" in ran[1].stderr and "running with cpus=1" in ran[1].stderr
        assert kernel.facts("[len(top), 'u' in dir()]") == [10, True]
        # The same claim line again, asking OpenBLAS how many threads it started with.
        claim_line = cells[1].splitlines()[0]
        kernel.run(
            f"{claim_line}\nimport numpy, threadpoolctl\n"
            "blas = [p['num_threads'] for p in threadpoolctl.threadpool_info()"
            " if p['internal_api'] == 'openblas']",
            check=True,
        )
        assert kernel.facts("blas") == [1]


def test_the_config_that_gives_up_the_reserve_is_one_fluksio_nb_reads(tmp_path):
    (setting,) = blocks(section(CONFIGURATION, "The reserve core"), "json")
    config = tmp_path / "fluksio_nb.json"
    config.write_text(setting)
    assert load_settings({"FLUKSIO_CONFIG": str(config)}).reserve_cpus == 0


def test_the_measured_figures_are_the_ones_bench_results_give():
    """docs/measured.md keeps nine figures and points at bench/results.md for the rest; a
    figure changed in one and not the other is a claim nobody measured."""
    rows = re.findall(r"^\| (?!target|---)(.*?) \| (.*?) \| (.*?) \|$", MEASURED, re.M)
    assert len(rows) == 9, rows
    assert "(../bench/results.md)" in MEASURED
    findings = (ROOT / "bench" / "results.md").read_text().partition(KEPT_ABOVE)[0]
    for _, measured, _ in rows:
        for figure in re.findall(r"\d+(?:\.\d+)?", measured):
            assert re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", findings), (
                f"{figure} (in {measured!r}) is not in bench/results.md's findings"
            )
