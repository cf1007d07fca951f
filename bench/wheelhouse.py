"""A folder of wheels for checking real cards on a machine that reaches no package registry.

The machines with the cards are often the ones kept off the network. So the
check is made in two steps: ``make wheelhouse`` downloads, where a registry
is reachable, what a kernel needs at run time and what the checks run on
(pytest), and nothing else: no Ray, no JupyterLab, no torch; ``make
gpu-check`` then installs from that folder alone, into a venv of its own,
and runs the checks (:mod:`bench.gpu_check`).

What it decides:

- **What a kernel needs is what ``pyproject.toml`` says it needs**: its
  ``dependencies``, read from the file, so the folder cannot drift from the
  package. Plus pytest and pytest-timeout, named with the test extra's pins.
- **Under 60 MB in all**, checked after the download: a folder that grew
  past it fails, naming its biggest wheels, rather than quietly becoming
  the thing that was carried in by hand.
- **Wheels for the Python that downloads them**: compiled wheels (pydantic's
  core, psutil, pyzmq, tornado) are for one Python version and platform, so
  ``make wheelhouse`` is run with the Python version the card's machine has
  (``make wheelhouse PYTHON=python3.12``), on the same kind of machine.
- **The checkout is on the venv's path by a ``.pth`` file**, not installed:
  installing it would build the JupyterLab extension, which needs what the
  folder deliberately does not carry. A ``.pth`` is read under ``python
  -I`` too, so the books service a claim starts finds the same code.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: What the folder may weigh, all of it.
LIMIT_BYTES = 60 * 10**6

#: From the test extra: what the checks themselves run on.
FOR_THE_CHECKS = ("pytest", "pytest-timeout")


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The package's run-time dependencies, then pytest's, as ``pyproject.toml`` pins them."""
    project = tomllib.loads(pyproject.read_text())["project"]
    tests = project["optional-dependencies"]["test"]
    wanted = list(project["dependencies"])
    for name in FOR_THE_CHECKS:
        wanted += [r for r in tests if re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] == name]
    return wanted


def weight(folder: Path) -> tuple[int, list[tuple[int, str]]]:
    """The folder's bytes in all, and each file's, biggest first."""
    files = sorted(
        ((p.stat().st_size, p.name) for p in folder.iterdir() if p.is_file()), reverse=True
    )
    return sum(size for size, _ in files), files


def download(folder: Path) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    # Wheels only: a source package would need a compiler on the machine with the card.
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:"),
            *("--dest", str(folder), *requirements()),
        ],
        check=True,
    )
    total, files = weight(folder)
    for size, name in files:
        print(f"{size / 1e6:7.2f} MB  {name}")
    print(f"{len(files)} wheels, {total / 1e6:.1f} MB in all, in {folder}")
    if total > LIMIT_BYTES:
        print(
            f"wheelhouse: {total / 1e6:.1f} MB is over the {LIMIT_BYTES / 1e6:.0f} MB limit; "
            f"the biggest: {', '.join(name for _, name in files[:3])}",
            file=sys.stderr,
        )
        return 1
    return 0


def install(folder: Path, target: Path) -> int:
    """A venv at ``target`` with what ``folder`` holds, and this checkout on its path."""
    if not any(folder.glob("*.whl")):
        print(
            f"gpu-check: no wheels in {folder}: run `make wheelhouse` where a package "
            "registry is reachable, and bring the folder here",
            file=sys.stderr,
        )
        return 1
    if not (target / "bin" / "python").exists():
        venv.EnvBuilder(with_pip=True).create(target)
    python = target / "bin" / "python"
    subprocess.run(
        [
            *(str(python), "-m", "pip", "install", "--quiet", "--no-index"),
            *("--find-links", str(folder), *requirements()),
        ],
        check=True,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "fluksio_nb_checkout.pth").write_text(f"{ROOT}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wheelhouse", description=__doc__)
    parser.add_argument("action", choices=["download", "install"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("venv", type=Path, nargs="?", default=ROOT / ".gpu-venv")
    args = parser.parse_args(argv)
    if args.action == "download":
        return download(args.folder.resolve())
    return install(args.folder.resolve(), args.venv.resolve())


if __name__ == "__main__":
    sys.exit(main())
