"""Which cards this machine has, as this process may hand them out.

Cards come from NVML (``nvidia-ml-py``), then ``nvidia-smi -L``, then none,
narrowed by a ``CUDA_VISIBLE_DEVICES`` already set on the kernel, since a
kernel that was started seeing two cards has no business handing out the
other six.

Cards are identified by their physical index, the one NVML and
``nvidia-smi`` print. The derived env sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
so that CUDA numbers them the same way, which is what lets the books and the
worker agree on which card "1" is. Where MIG is on, each instance is a card
of its own, numbered after the last card and named to CUDA by its UUID
(:mod:`fluksio_nb.mig`).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from fluksio_nb.mig import cuda_name, nvml_cards, smi_cards

#: A card's id in the books: its physical index, or a MIG instance's number.
GpuId = int


@dataclass(frozen=True)
class Gpu:
    """One card as detection saw it."""

    index: GpuId
    name: str = ""
    uuid: str = ""
    memory_bytes: int | None = None
    #: The card a MIG instance is cut from; ``None`` for a whole card.
    parent: GpuId | None = None

    @property
    def cuda_name(self) -> str:
        """How ``CUDA_VISIBLE_DEVICES`` names it: its index, or a MIG instance's UUID."""
        return cuda_name(self.index, self.uuid, self.parent)


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
        for listed, handle in nvml_cards(pynvml):
            try:
                memory: int | None = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            except pynvml.NVMLError:
                memory = None  # unified memory (the GB10): a card all the same
            cards.append(
                Gpu(
                    index=listed.id,
                    name=listed.name,
                    uuid=listed.uuid,
                    memory_bytes=memory,
                    parent=listed.parent,
                )
            )
        return sorted(cards, key=lambda card: card.index)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


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
    return sorted(
        (
            Gpu(index=card.id, name=card.name, uuid=card.uuid, parent=card.parent)
            for card in smi_cards(listing)
        ),
        key=lambda card: card.index,
    )


def visible_to_kernel(cards: list[Gpu], cuda_visible: str | None) -> list[Gpu]:
    """The cards a ``CUDA_VISIBLE_DEVICES`` on the kernel leaves claimable.

    It may name cards by index or by UUID (or a UUID's prefix), as CUDA
    accepts; a MIG instance only by its UUID, since its id is ours, not
    CUDA's. CUDA stops reading the list at the first entry it cannot match,
    and so does this, so the two agree on what the kernel could have used.
    """
    if cuda_visible is None:
        return cards
    chosen: list[Gpu] = []
    for entry in (part.strip() for part in cuda_visible.split(",")):
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            found = [c for c in cards if c.parent is None and c.index == int(entry)]
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
