"""``python -m bench``: every benchmark, side by side, into ``bench/results.md``.

``--smoke`` runs each section at a toy size in a few seconds, so that CI
keeps the benchmarks from rotting; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import sys
from pathlib import Path

from bench import books, cells, overload
from bench.harness import machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, to check it runs")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("results.md"), help="where to write"
    )
    options = parser.parse_args(argv)
    sections = []
    if options.smoke:
        sections.append(overload.main(n=100, k=2))
        sections.append(cells.main(rounds=2, mib=8, others=False))
        sections.append(books.main(cycles=40, rounds=3))
    else:
        sections.append(overload.main())
        sections.append(cells.main())
        sections.append(books.main())
        for name in ("bench.widget_sampling", "bench.ray_overhead"):
            if importlib.util.find_spec(name) is not None:
                module = importlib.import_module(name)
                if hasattr(module, "main"):
                    sections.append(module.main())
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = (
        f"# Benchmarks\n\nRun {when} on {machine()}"
        f"{' (smoke: toy sizes, numbers meaningless)' if options.smoke else ''}.\n"
        "Reproduce with `.venv/bin/python -m bench` from the repository root.\n\n"
        + "\n".join(sections)
    )
    options.out.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
