"""A real NVIDIA card, for the checks that need one: what is missing, an allocation, nvidia-smi.

Used by ``tests/test_gpu_real.py`` and ``bench/gpu_check.py``. They need the
NVIDIA driver and nothing else: card memory is taken through the driver's
own library (:mod:`tests.cuda_memory`), in a process of its own
(:func:`holding`), the way a claim's work holds it. Nothing here imports
pynvml into the process that asks.

What is missing is said per thing (:func:`absences`): no card, no driver,
no NVML, each in its own words, so that a check skipped here says which.

nvidia-smi's output is parsed here on its own, not with fluksio_nb's parser:
the point is to compare fluksio_nb's reading with what the driver's own tool
prints, and a shared parser would agree with itself.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from fluksio_nb.gpu_usage import CardReader, _NvidiaSmi, _Nvml
from fluksio_nb.gpus import detect_gpus
from tests.cuda_memory import PROGRAM, driver_missing

MIB = 1 << 20

#: What the allocating process holds on its card, beyond its CUDA context.
ALLOCATE_MIB = 256


def first_card() -> int | str:
    """The index of the first card this process may use, or why there is none.

    That is the first card NVML or ``nvidia-smi -L`` lists, narrowed by a
    ``CUDA_VISIBLE_DEVICES`` set on this process, as a kernel's would be.
    """
    cards = cards_here()
    return cards if isinstance(cards, str) else cards[0]


def cards_here() -> list[int] | str:
    """The cards this process may use, as fluksio_nb lists them, or why there are none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no card: nvidia-smi, which lists them, is not on PATH"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as error:
        return f"no card: nvidia-smi at {smi} cannot be run: {error}"
    if listed.returncode != 0 or "GPU " not in listed.stdout:
        said = (listed.stderr or listed.stdout).strip().splitlines()
        return f"no card: nvidia-smi at {smi} lists none: {said[0] if said else 'nothing printed'}"
    cards, _ = detect_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not cards:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"no card: none is visible to this process (CUDA_VISIBLE_DEVICES={visible})"
    return [card.index for card in cards]


def cuda_name_of(card: int) -> str:
    """How CUDA names card ``card``: its index, or, for a MIG instance, its UUID."""
    cards, _ = detect_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return next((gpu.cuda_name for gpu in cards if gpu.index == card), str(card))


def device_node_of(card: int) -> str:
    """The device node card ``card``'s processes open: its own, or its MIG instance's card's."""
    cards, _ = detect_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
    gpu = next((gpu for gpu in cards if gpu.index == card), None)
    return f"/dev/nvidia{card if gpu is None or gpu.parent is None else gpu.parent}"


def nvml_missing() -> str | None:
    """Why NVML cannot be asked here; ``None`` if it answers."""
    try:
        import pynvml
    except ImportError:
        return "no NVML: nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return f"no NVML: nvmlInit failed ({error})"
    pynvml.nvmlShutdown()
    return None


def absences() -> dict[str, str]:
    """What is missing here for the checks on a real card, each in its own words."""
    found = {"card": cards_here(), "driver": driver_missing(), "NVML": nvml_missing()}
    return {what: why for what, why in found.items() if isinstance(why, str)}


def missing() -> str | None:
    """What is missing for a check on a real card (a card and the driver); ``None`` if nothing."""
    gone = absences()
    return "; ".join(gone[what] for what in ("card", "driver") if what in gone) or None


# -- nvidia-smi's word -----------------------------------------------------------


@dataclass(frozen=True)
class SmiCard:
    index: int
    uuid: str
    utilisation_percent: float | None
    used_mib: float | None
    total_mib: float | None
    name: str


@dataclass(frozen=True)
class SmiApp:
    gpu_uuid: str
    pid: int
    used_mib: float | None
    name: str


@dataclass(frozen=True)
class SmiQuery:
    cards: list[SmiCard]
    apps: list[SmiApp]
    #: The two queries and what nvidia-smi printed for each, as it printed it.
    printed: str

    def card(self, index: int) -> SmiCard | None:
        return next((card for card in self.cards if card.index == index), None)

    def apps_on(self, uuid: str) -> list[SmiApp]:
        return [app for app in self.apps if app.gpu_uuid == uuid]

    def app(self, pid: int) -> list[SmiApp]:
        return [app for app in self.apps if app.pid == pid]


GPU_QUERY = "--query-gpu=index,uuid,utilization.gpu,memory.used,memory.total,name"
APPS_QUERY = "--query-compute-apps=gpu_uuid,pid,used_memory,process_name"


def _figure(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # [N/A], [Not Supported]


def smi_query(smi: str | None = None) -> SmiQuery:
    """``nvidia-smi --query-gpu`` and ``--query-compute-apps``, in MiB and percent."""
    smi = smi or shutil.which("nvidia-smi") or "nvidia-smi"
    printed, rows = [], {}
    for query in (GPU_QUERY, APPS_QUERY):
        command = [smi, query, "--format=csv,noheader,nounits"]
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True)
        printed.append(f"$ nvidia-smi {query} --format=csv,noheader,nounits\n{out.stdout}")
        rows[query] = [line for line in out.stdout.splitlines() if line.strip()]
    cards = []
    for line in rows[GPU_QUERY]:
        index, uuid, busy, used, total, name = (f.strip() for f in line.split(",", 5))
        cards.append(SmiCard(int(index), uuid, _figure(busy), _figure(used), _figure(total), name))
    apps = []
    for line in rows[APPS_QUERY]:
        uuid, pid, used, name = (f.strip() for f in line.split(",", 3))
        apps.append(SmiApp(uuid, int(pid), _figure(used), name))
    return SmiQuery(cards, apps, "\n".join(printed))


# -- fluksio_nb's word -----------------------------------------------------------


def readers() -> dict[str, Callable[[], CardReader]]:
    """A fresh reader for each source fluksio_nb could read the cards with here.

    Both where both are there, not only the one a kernel would pick (NVML),
    so that each is checked against nvidia-smi.
    """
    found: dict[str, Callable[[], CardReader]] = {}
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            pass
        else:
            pynvml.nvmlShutdown()
            found["nvml"] = lambda: CardReader(interval_s=0, opener=lambda: _Nvml(pynvml))
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        found["nvidia-smi"] = lambda: CardReader(interval_s=0, opener=lambda: _NvidiaSmi(smi))
    return found


# -- something on the card to compare --------------------------------------------


class CannotAllocate(RuntimeError):
    """The driver could not put memory on the card (a driver in a bad state, no room...)."""


@contextmanager
def holding(
    card: int | str | None = None,
    mib: int = ALLOCATE_MIB,
    popen: Callable[..., subprocess.Popen] = subprocess.Popen,
    timeout_s: float = 45.0,
) -> Iterator[subprocess.Popen]:
    """A process holding ``mib`` MiB on a card while inside, taken through ``libcuda``.

    The card is ``card``, a physical index (or a CUDA name: a MIG
    instance's UUID), or whichever card the process's environment names:
    ``popen`` may be a claim's, whose environment names the card the claim
    was granted.
    """
    env = None
    if card is not None:
        env = {
            **os.environ,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": cuda_name_of(card) if isinstance(card, int) else card,
        }
    process = popen(
        [sys.executable, str(PROGRAM), str(mib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        said = _first_line(process, timeout_s)
        if said != "READY":
            raise CannotAllocate(said.removeprefix("CANNOT ") or "the allocating process ended")
        yield process
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _first_line(process: subprocess.Popen, timeout_s: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready:
        return f"CANNOT nothing said in {timeout_s:g} s"
    return process.stdout.readline().strip()


def wait_for(check: Callable[[], object], timeout_s: float = 15.0, every_s: float = 0.25):
    """``check()`` once it is truthy, or its last value after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(every_s)
