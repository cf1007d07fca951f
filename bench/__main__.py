"""``python -m bench``: every benchmark, side by side, into ``bench/results.md``.

``--smoke`` runs each section at a toy size in a few seconds, so that CI
keeps the benchmarks from rotting; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

from bench import books, cells, enforcement, hop, overload
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
        runs = [
            lambda: overload.main(n=100, k=2, repeats=1),
            lambda: cells.main(rounds=2, mib=8, others=False),
            lambda: hop.main(rounds=2, gaps=(0.0, 0.001)),
            lambda: books.main(cycles=40, rounds=3),
            lambda: enforcement.main(seconds=0.5, repeats=1),
        ]
    else:
        runs = [overload.main, cells.main, hop.main, books.main, enforcement.main]
    for run in runs:
        sections.append(run())
        print(sections[-1], flush=True)
    if not options.smoke:
        for name, heading in (
            ("bench.widget_sampling", "What the sampling thread costs the kernel"),
            ("bench.ray_overhead", "`%%claim --on ray` against a bare Ray task"),
        ):
            # Scripts of their own, with their own command lines: run as such.
            ran = subprocess.run(
                [sys.executable, "-m", name], capture_output=True, text=True, check=False
            )
            body = ran.stdout.strip() or ran.stderr.strip()[-2000:]
            sections.append(f"### {heading}\n\n```text\n{body}\n```\n")
            print(sections[-1], flush=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = (
        f"# Benchmarks\n\nRun {when} on {machine()}"
        f"{' (smoke: toy sizes, numbers meaningless)' if options.smoke else ''}.\n"
        "Reproduce with `.venv/bin/python -m bench` from the repository root.\n\n"
        + "\n".join(sections)
    )
    options.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
