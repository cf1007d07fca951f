"""``python -m bench``: every benchmark, side by side, into ``bench/results.md``.

``--smoke`` runs each section at a toy size in a few seconds, so that CI
keeps the benchmarks from rotting; its numbers mean nothing. ``--only``
runs the sections named, and prints them unless told ``--out``.

The results file also holds what people wrote about the runs: the figures
against the issues' targets, and why a target was missed. A run replaces
only what lies below :data:`KEPT_ABOVE` in it, so running the benchmarks
again never throws those findings away.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

from bench import books, cells, enforcement, hop, metrics, overload
from bench.harness import machine

#: The line in a results file above which everything is written by hand and kept.
KEPT_ABOVE = "<!-- python -m bench writes below this line; what is above it is kept -->"


#: Each section, by the name ``--only`` takes.
SECTIONS = {
    "overload": overload.main,
    "cells": cells.main,
    "hop": hop.main,
    "books": books.main,
    "enforcement": enforcement.main,
    "metrics": metrics.main,
}

#: The same at toy sizes, for ``--smoke``: seconds each, numbers meaningless.
SMOKE = {
    "overload": lambda: overload.main(n=100, k=2, repeats=1),
    "cells": lambda: cells.main(rounds=2, mib=8, others=False, first_rounds=1, idle_s=0.2),
    "hop": lambda: hop.main(rounds=2, gaps=(0.0, 0.001)),
    "books": lambda: books.main(cycles=40, rounds=3, most=2, floods=2),
    "enforcement": lambda: enforcement.main(seconds=0.2, repeats=1),
    "metrics": lambda: metrics.main(rounds=5),
}


def with_findings_kept(previous: str | None, run: str, when: str) -> str:
    """The results file after a run: ``previous``'s hand-written part, if it has one, then ``run``.

    ``run`` is the sections of the run, and ``when`` how the run is introduced
    (when, on what). Without a kept part, the run is the whole file.
    """
    above, marker, _ = (previous or "").partition(KEPT_ABOVE)
    if marker:
        return f"{above}{marker}\n\n## The latest run\n\n{when}{run}"
    return f"# Benchmarks\n\n{when}{run}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, to check it runs")
    parser.add_argument(
        "--only",
        choices=SECTIONS,
        action="append",
        help="this section only (again for more); every section without it",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write (default bench/results.md; with --only, printed only)",
    )
    options = parser.parse_args(argv)
    if options.out is None and not options.only:
        # Some sections alone would replace the last whole run's figures.
        options.out = Path(__file__).with_name("results.md")
    sections = []
    chosen = SMOKE if options.smoke else SECTIONS
    runs = [run for name, run in chosen.items() if name in (options.only or chosen)]
    for run in runs:
        sections.append(run())
        print(sections[-1], flush=True)
    if not options.smoke and not options.only:
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
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    when = (
        f"Run {now} on {machine()}"
        f"{' (smoke: toy sizes, numbers meaningless)' if options.smoke else ''}.\n"
        "Reproduce with `.venv/bin/python -m bench` from the repository root.\n\n"
    )
    if options.out is None:
        return 0
    previous = options.out.read_text() if options.out.exists() else None
    options.out.write_text(with_findings_kept(previous, "\n".join(sections), when))
    return 0


if __name__ == "__main__":
    sys.exit(main())
