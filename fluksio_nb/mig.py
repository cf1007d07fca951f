"""MIG instances as cards: what the driver lists, and the id each one is claimed by.

An A100 or H100 with MIG on is cut into instances that CUDA sees as devices
of their own, each with its own memory and its own UUID (``MIG-...``). The
card they are cut from can no longer be used whole. So where MIG is on,
each instance is a card to claim, and its card is not.

What it decides:

- **A whole card keeps its index as its id; instances are numbered after the
  last card**, in the order the driver lists them. A machine without MIG
  sees the ids it always did, and turning MIG on for card 0 of two leaves
  card 1 as "card 1" (its instances become cards 2, 3, ...), so nothing
  held or shown for card 1 changes meaning.
- **CUDA is told an instance by its UUID**, the only name it takes for one
  (``CUDA_VISIBLE_DEVICES=MIG-...``); a whole card is still told by its
  index, which ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes NVML's.
- **An instance remembers its card** (``parent``): the device node its
  processes open is its card's.
- NVML and ``nvidia-smi -L`` list the same instances in the same order, so
  the two sources give the same ids. Slots of a card that hold no instance
  (NVML's ``NotFound``) are skipped, as the driver does in its listing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: NVML's ``NVML_DEVICE_MIG_ENABLE``: the current mode of a card with MIG on.
MIG_ENABLED = 1


@dataclass(frozen=True)
class Listed:
    """One card, or one MIG instance, as the driver lists it."""

    #: The id the books hand out (see the module docstring).
    id: int
    name: str
    uuid: str
    #: The index of the card a MIG instance is cut from; ``None`` for a whole card.
    parent: int | None = None


def cuda_name(card_id: int, uuid: str, parent: int | None) -> str:
    """How ``CUDA_VISIBLE_DEVICES`` names this card: its index, or a MIG instance's UUID."""
    return str(card_id) if parent is None else uuid


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_cards(pynvml: Any) -> Iterator[tuple[Listed, Any]]:
    """Each claimable card NVML lists, with its handle: whole cards, and MIG instances.

    NVML must be initialised. A card NVML cannot name (lost, or walled off
    from this process) is left out; an instance it cannot name is too.
    """
    count = pynvml.nvmlDeviceGetCount()
    next_id = count
    for index in range(count):
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = _text(pynvml.nvmlDeviceGetName(handle))
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        except pynvml.NVMLError:
            continue
        try:
            mig_on = pynvml.nvmlDeviceGetMigMode(handle)[0] == MIG_ENABLED
        except (pynvml.NVMLError, AttributeError):
            mig_on = False  # no MIG on this card, or an nvidia-ml-py that predates it
        if not mig_on:
            yield Listed(id=index, name=name, uuid=uuid), handle
            continue
        try:
            slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except pynvml.NVMLError:
            slots = 0
        for slot in range(slots):
            try:
                instance = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                instance_uuid = _text(pynvml.nvmlDeviceGetUUID(instance))
            except pynvml.NVMLError:
                continue  # a slot with no instance in it
            try:
                instance_name = _text(pynvml.nvmlDeviceGetName(instance))
            except pynvml.NVMLError:
                instance_name = f"{name} MIG"
            yield Listed(id=next_id, name=instance_name, uuid=instance_uuid, parent=index), instance
            next_id += 1


_CARD_LINE = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]+)\))?$")
# Indented under its card: "  MIG 1g.5gb     Device  0: (UUID: MIG-...)".
_MIG_LINE = re.compile(r"^MIG (\S+)\s+Device\s+(\d+): \(UUID: ([^)]+)\)$")


def smi_cards(listing: str) -> list[Listed]:
    """The claimable cards in ``nvidia-smi -L``'s listing: whole cards, and MIG instances.

    A card with instances under it is not itself claimable.
    """
    cards: list[tuple[int, str, str]] = []
    instances: dict[int, list[tuple[str, str]]] = {}
    for line in listing.splitlines():
        text = line.strip()
        card = _CARD_LINE.match(text)
        if card:
            cards.append((int(card[1]), card[2], card[3] or ""))
            continue
        instance = _MIG_LINE.match(text)
        if instance and cards:
            instances.setdefault(cards[-1][0], []).append((instance[1], instance[3]))
    listed: list[Listed] = []
    next_id = max((index for index, _, _ in cards), default=-1) + 1
    for index, name, uuid in cards:
        if index not in instances:
            listed.append(Listed(id=index, name=name, uuid=uuid))
            continue
        for profile, instance_uuid in instances[index]:
            listed.append(
                Listed(id=next_id, name=f"{name} MIG {profile}", uuid=instance_uuid, parent=index)
            )
            next_id += 1
    return listed
