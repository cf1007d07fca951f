"""Which cards this machine has, as this process may hand them out.

Cards come from NVML (``nvidia-ml-py``), then ``nvidia-smi -L``, then none,
narrowed by a ``CUDA_VISIBLE_DEVICES`` already set on the kernel, since a
kernel that was started seeing two cards has no business handing out the
other six.

Cards are identified by their physical index, the one NVML and
``nvidia-smi`` print. The derived env sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
so that CUDA numbers them the same way, which is what lets the books and the
worker agree on which card "1" is.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

#: A card may only be claimed whole; its id is the physical index.
GpuId = int


@dataclass(frozen=True)
class Gpu:
    """One card as detection saw it."""

    index: GpuId
    name: str = ""
    uuid: str = ""
    memory_bytes: int | None = None


def gpus_from_nvml() -> list[Gpu] | None:
    """The cards NVML reports, or ``None`` when NVML is not there to ask."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        cards = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = pynvml.nvmlDeviceGetName(handle)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
            except pynvml.NVMLError:
                # Lost, or walled off from this process: not a card to hand out.
                continue
            try:
                memory: int | None = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            except pynvml.NVMLError:
                memory = None  # unified memory (the GB10): a card all the same
            cards.append(
                Gpu(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else name,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    memory_bytes=memory,
                )
            )
        return cards
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


_SMI_LINE = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]+)\))?$")


def gpus_from_nvidia_smi() -> list[Gpu] | None:
    """The cards ``nvidia-smi -L`` lists, or ``None`` when it cannot be run."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        listing = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    cards = []
    for line in listing.splitlines():
        match = _SMI_LINE.match(line.strip())
        if match:
            cards.append(Gpu(index=int(match[1]), name=match[2], uuid=match[3] or ""))
    return cards


def visible_to_kernel(cards: list[Gpu], cuda_visible: str | None) -> list[Gpu]:
    """The cards a ``CUDA_VISIBLE_DEVICES`` on the kernel leaves claimable.

    It may name cards by index or by UUID (or a UUID's prefix), as CUDA
    accepts. CUDA stops reading the list at the first entry it cannot match,
    and so does this, so the two agree on what the kernel could have used.
    """
    if cuda_visible is None:
        return cards
    chosen: list[Gpu] = []
    for entry in (part.strip() for part in cuda_visible.split(",")):
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            found = [card for card in cards if card.index == int(entry)]
        else:
            found = [card for card in cards if card.uuid and card.uuid.startswith(entry)]
        if len(found) != 1 or found[0] in chosen:
            break
        chosen.append(found[0])
    return chosen


def detect_gpus(cuda_visible: str | None = None) -> tuple[list[Gpu], str]:
    """The claimable cards, and which source said so."""
    for source, probe in (("nvml", gpus_from_nvml), ("nvidia-smi", gpus_from_nvidia_smi)):
        cards = probe()
        if cards is not None:
            return visible_to_kernel(cards, cuda_visible), source
    return [], "none found"
