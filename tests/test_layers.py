"""The package's shape: its layers, no import cycles, no module too long or long without a reason.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and are
checked by import-linter, which counts imports inside functions too. A test
plants a cycle in a copy of the package, so that a contract that could never
fail would fail here.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fluksio_nb"

#: Past this, a module's docstring says why it is one module.
LONGEST_WITHOUT_A_REASON = 600
REASON = "It is long because"
#: Past this, no reason will do: the module is split where its concerns part.
LONGEST = 700


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """import-linter over the ``fluksio_nb`` found under ``root``, with ``root``'s contracts."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_its_layers_and_has_no_import_cycles():
    ran = lint_imports(ROOT)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "2 kept, 0 broken" in ran.stdout


def top_floor_modules() -> list[Path]:
    """The package's own modules and subpackages, one level down."""
    return [
        path
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" and path.name != "__init__.py")
        or (path.is_dir() and (path / "__init__.py").exists())
    ]


def test_every_module_of_the_package_has_a_layer():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layered,) = [c for c in contracts["contracts"] if c["type"] == "layers"]
    placed = {name.strip() for layer in layered["layers"] for name in layer.split("|")}
    modules = {path.stem if path.is_file() else path.name for path in top_floor_modules()}
    assert modules - placed == set(), "modules in no layer of pyproject.toml"
    assert placed - modules == set(), "layers naming modules that do not exist"


def test_the_package_page_names_every_module_of_the_package():
    """Guards against a module nobody can place: docs/package.md names each one."""
    table = (ROOT / "docs" / "package.md").read_text()
    named = {path.name + ("/" if path.is_dir() else "") for path in top_floor_modules()}
    assert {name for name in named if f"`{name}`" not in table} == set()


def test_a_cycle_planted_in_a_function_breaks_the_contracts(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "fluksio_nb", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    errors = tmp_path / "fluksio_nb" / "errors.py"
    # The bottom floor reaching for the top one, lazily, as a shortcut would.
    errors.write_text(
        errors.read_text() + "\n\ndef _shortcut():\n    from fluksio_nb import magics\n"
    )
    ran = lint_imports(tmp_path)
    assert ran.returncode != 0
    assert "fluksio_nb.errors -> fluksio_nb.magics" in ran.stdout
    assert "0 kept, 2 broken" in ran.stdout


def test_a_module_over_600_lines_says_in_its_docstring_why():
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") <= LONGEST_WITHOUT_A_REASON:
            continue
        if REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert unexplained == [], f"say why in the docstring ({REASON!r}) or split them"


def test_no_module_of_the_package_is_over_700_lines():
    too_long = [
        f"{path.relative_to(ROOT)} ({lines} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := path.read_text().count("\n")) > LONGEST
    ]
    assert too_long == [], (
        f"over {LONGEST} lines: {', '.join(too_long)}; split them where their concerns part"
    )
