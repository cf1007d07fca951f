"""What fluksio_nb reads off the cards, beside what nvidia-smi prints, on a machine with a card.

Per card: utilisation, memory used and total, and each process with memory
on it, as fluksio_nb reads them with every source it can use here (NVML,
``nvidia-smi``), beside ``nvidia-smi --query-gpu`` and
``--query-compute-apps``. A process of its own first takes 256 MiB on the
first card through the driver's own library (:mod:`tests.cuda_memory`: the
driver is all it needs, no torch or cupy), so that there is a known amount
to find. Then what one pass over the cards costs, with each source: the
figure behind "at most every 2 s" in ``fluksio_nb/gpu_usage.py``, which the
sampling benchmark can only measure against stand-ins.

``--with-tests`` first runs the real-card tests (``tests/test_gpu_real.py``:
readings, slices, the device hold). Either way it ends with one summary line
per check, passed, failed or skipped, and a skipped one says what is
missing: no card, no driver, no NVML, each in its own words. ``make
gpu-check`` runs it so, from a wheel folder, on a machine that reaches no
package registry (:mod:`bench.wheelhouse`).

Exits 1 if a check failed: fluksio_nb's figure for the allocating process
more than 5% from nvidia-smi's, or a test. Takes well under a minute. Run
from the repository root: ``.venv/bin/python -m bench.gpu_check``.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import machine, table
from fluksio_nb.gpu_usage import CardProcess, CardReader, CardsReading
from tests.real_cards import (
    ALLOCATE_MIB,
    MIB,
    CannotAllocate,
    SmiQuery,
    absences,
    first_card,
    holding,
    readers,
    smi_query,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent

#: How far apart fluksio_nb's and nvidia-smi's figures for the allocation may be.
WITHIN = 0.05

#: Passes timed per source, for what one costs.
PASSES = 5


def mib(value: float | None, *, scale: int = MIB) -> str:
    return "n/a" if value is None else f"{value / scale:,.0f} MiB"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}%"


def cost_of_a_pass(reader: CardReader) -> tuple[float, float, float]:
    """Median CPU of one pass in this process, in the processes it ran, and wall, in ms."""
    here, children, wall = [], [], []
    for _ in range(PASSES):
        before = (time.thread_time(), _children_cpu(), time.perf_counter())
        reader.read(max_age_s=0)
        here.append(time.thread_time() - before[0])
        children.append(_children_cpu() - before[1])
        wall.append(time.perf_counter() - before[2])
    return tuple(1000 * statistics.median(values) for values in (here, children, wall))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def who(process: CardProcess | None, driver_pid: int) -> str:
    if process is None or process.pid is None:
        return f"pid {driver_pid} (not visible here)"
    here = "" if process.pid == driver_pid else f", {process.pid} here"
    return f"pid {driver_pid} ({process.user or 'unknown user'}{here})"


def holds(reading: CardsReading | None, pid: int) -> bool:
    """Whether ``reading`` has ``pid`` holding memory on some card."""
    return reading is not None and any(
        p.pid == pid for card in reading.cards for p in card.processes
    )


def compare(
    readings: dict[str, CardsReading | None], smi: SmiQuery, allocator: int | None
) -> list[str]:
    """One table per card: a row per figure, a column per source, nvidia-smi's last."""
    sources = list(readings)
    out = []
    indices = sorted(
        {c.index for c in smi.cards}
        | {c.index for r in readings.values() if r is not None for c in r.cards}
    )
    for index in indices:
        theirs = smi.card(index)
        ours = {name: None if r is None else r.card(index) for name, r in readings.items()}
        uuid = theirs.uuid if theirs else next((c.uuid for c in ours.values() if c), "?")
        rows = [
            ["utilisation"]
            + [percent(c.utilisation_percent) if c else "-" for c in ours.values()]
            + [percent(theirs.utilisation_percent) if theirs else "-"],
            ["memory used"]
            + [mib(c.used_bytes) if c else "-" for c in ours.values()]
            + [mib(theirs.used_mib, scale=1) if theirs else "-"],
            ["memory total"]
            + [mib(c.total_bytes) if c else "-" for c in ours.values()]
            + [mib(theirs.total_mib, scale=1) if theirs else "-"],
        ]
        apps = {app.pid: app for app in smi.apps_on(uuid)}
        held = {(name, p.driver_pid): p for name, c in ours.items() if c for p in c.processes}
        for driver in sorted(apps.keys() | {pid for _, pid in held}):
            process = next((p for (_, pid), p in held.items() if pid == driver), None)
            label = who(process, driver)
            if process is not None and allocator is not None and process.pid == allocator:
                label += f", holding the {ALLOCATE_MIB} MiB allocated"
            rows.append(
                [label]
                + [
                    mib(held[(name, driver)].used_bytes) if (name, driver) in held else "-"
                    for name in sources
                ]
                + [mib(apps[driver].used_mib, scale=1) if driver in apps else "-"]
            )
        name = theirs.name if theirs else ""
        out.append(
            f"card {index}  {uuid}  {name}\n\n"
            + table(["", *(f"fluksio_nb ({s})" for s in sources), "nvidia-smi"], rows)
        )
    return out


@dataclass(frozen=True)
class Outcome:
    """One check, how it went, and why where it did not pass."""

    check: str
    result: str  # "passed", "failed" or "skipped"
    why: str = ""

    def line(self) -> str:
        return f"{self.result.upper():<8} {self.check}" + (f": {self.why}" if self.why else "")


def read_as_smi(source: str) -> str:
    return f"fluksio_nb ({source}) reads a process's card memory as nvidia-smi does"


#: What each source's reading needs, beyond a card and the driver.
SOURCES = {"nvml": ("card", "driver", "NVML"), "nvidia-smi": ("card", "driver")}


def verdict(
    readings: dict[str, CardsReading | None], smi: SmiQuery, allocator: int
) -> list[Outcome]:
    """Whether each source's figure for the allocating process is nvidia-smi's, within 5%."""
    outcomes = []
    for name, reading in readings.items():
        check = read_as_smi(name)
        found = [
            (card.uuid, p)
            for card in (reading.cards if reading else ())
            for p in card.processes
            if p.pid == allocator
        ]
        if not found:
            if smi.app(allocator):
                why = f"finds no card memory held by pid {allocator}, which nvidia-smi lists"
                outcomes.append(Outcome(check, "failed", why))
            else:
                why = (
                    f"nvidia-smi does not name pid {allocator} either: the driver names it by "
                    "a pid of another namespace (a container?)"
                )
                outcomes.append(Outcome(check, "skipped", why))
            continue
        for uuid, process in found:
            theirs = [a.used_mib for a in smi.apps_on(uuid) if a.pid == process.driver_pid]
            if not theirs or theirs[0] is None or process.used_bytes is None:
                outcomes.append(Outcome(check, "skipped", "nvidia-smi gives no figure"))
                continue
            ours = process.used_bytes / MIB
            off = abs(ours - theirs[0]) / theirs[0]
            said = f"{ours:,.0f} MiB, nvidia-smi {theirs[0]:,.0f} MiB: {off:.1%} apart"
            print(f"- the allocating process: fluksio_nb ({name}) {said}")
            outcomes.append(Outcome(check, "passed" if off <= WITHIN else "failed", said))
    return outcomes


def skipped_for(needs: tuple[str, ...], gone: dict[str, str]) -> str:
    return "; ".join(gone[what] for what in needs if what in gone)


def bench() -> list[Outcome]:
    """The comparison and the cost of a pass, printed; an outcome per check."""
    print(f"Run on {machine()}.\n")
    gone = absences()
    card = first_card()
    if isinstance(card, str):
        print(f"There is no card to check here ({card}). Nothing compared.")
        return [
            *(Outcome(read_as_smi(s), "skipped", skipped_for(n, gone)) for s, n in SOURCES.items()),
            Outcome("what a pass over the cards costs", "skipped", card),
        ]
    makers = readers()
    outcomes = [
        Outcome(read_as_smi(source), "skipped", skipped_for(needs, gone) or "no reader")
        for source, needs in SOURCES.items()
        if source not in makers
    ]
    with contextlib.ExitStack() as stack:
        allocator = None
        try:
            allocator = stack.enter_context(holding(card=card, timeout_s=30)).pid
            print(f"pid {allocator} holds {ALLOCATE_MIB} MiB on card {card}, from libcuda.")
        except CannotAllocate as error:
            cannot = gone.get("driver") or str(error)
            print(f"Nothing allocated to compare: {cannot}. The cards as they are:")
            outcomes += [
                Outcome(read_as_smi(source), "skipped", f"nothing allocated: {cannot}")
                for source in makers
            ]
        reader_of = {name: make() for name, make in makers.items()}
        if allocator is not None:
            # The driver lists a process once its memory is there; give it a moment.
            for reader in reader_of.values():
                wait_for(lambda reader=reader: holds(reader.read(), allocator), timeout_s=10)
        readings = {name: reader.read(max_age_s=0) for name, reader in reader_of.items()}
        smi = smi_query()
        print()
        if not readings:
            print("fluksio_nb has nothing to read the cards with here.\n")
        print("\n\n".join(compare(readings, smi, allocator)) + "\n")
        print("Utilisation moves between two reads; memory held by a process should not.")
        if allocator is not None:
            outcomes += verdict(readings, smi, allocator)
        print("\nWhat one pass over the cards costs (median of 5):\n")
        rows = []
        for name, reader in reader_of.items():
            here, children, wall = cost_of_a_pass(reader)
            rows.append(
                [
                    name,
                    f"{here:.2f} ms",
                    f"{children:.1f} ms",
                    f"{wall:.1f} ms",
                    f"{(here + children) / 2000 * 100:.2f}%",
                ]
            )
        print(
            table(
                [
                    "source",
                    "CPU of the reading thread",
                    "CPU of nvidia-smi runs",
                    "wall",
                    "share of a core at one pass per 2 s",
                ],
                rows,
            )
        )
        outcomes.append(
            Outcome("what a pass over the cards costs", "passed", "measured, above")
            if rows
            else Outcome("what a pass over the cards costs", "skipped", "nothing reads the cards")
        )
        print(f"\nnvidia-smi printed:\n\n{smi.printed}")
    return outcomes


#: The real-card tests, run by ``--with-tests``.
REAL_CARD_TESTS = "tests/test_gpu_real.py"


def the_tests() -> list[Outcome]:
    """``tests/test_gpu_real.py`` run by pytest, as it prints; an outcome per test."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        ran = subprocess.run(
            [
                *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs"),
                *(f"--junitxml={report}", REAL_CARD_TESTS),
            ],
            cwd=ROOT,
        )
        if not report.exists():
            return [
                Outcome(REAL_CARD_TESTS, "failed", f"pytest ran nothing (exit {ran.returncode})")
            ]
        outcomes = []
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            check = f"{REAL_CARD_TESTS}::{case.get('name')}"
            found = {child.tag: child for child in case}
            for tag, result in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
                if tag in found:
                    why = found[tag].get("message", "").removeprefix("Skipped: ")
                    outcomes.append(Outcome(check, result, why.splitlines()[0] if why else ""))
                    break
            else:
                outcomes.append(Outcome(check, "passed"))
        return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument(
        "--with-tests", action="store_true", help=f"run {REAL_CARD_TESTS} first (make gpu-check)"
    )
    args = parser.parse_args(argv)
    outcomes = the_tests() if args.with_tests else []
    if args.with_tests:
        print()
    outcomes += bench()
    print("\nSummary, a line per check:\n")
    for outcome in outcomes:
        print(outcome.line())
    return 1 if any(o.result == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
