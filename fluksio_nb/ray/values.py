"""The cell's variables on their way to and from a Ray task, through Ray's object store.

A claimed cell reads names from the kernel and binds names the kernel gets
back, on the cluster as on this machine. This module decides how a value is
pickled for that trip and rebuilt after it.

What this module decides:

- **Each name is pickled on its own**, so that one value that cannot travel
  is reported by name, and before the claim is sent anywhere.
- **Big buffers go out of band**, for Ray to store as they are. Through Ray
  Client they go in band (:func:`portable`), which costs a copy.
- **Arrays arrive writable**, as they do from a local claim: the object
  store's are read-only, so they are copied once on arrival (:func:`thaw`).

On the kernel's own machine the values skip the object store altogether and
travel through its shared memory (:mod:`.claim`, :mod:`.task_side`).
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field

from fluksio_nb.transfer import dumps, out_of_band

#: One value: its pickle, and its big buffers, which Ray stores out of band.
Frozen = tuple[bytes, list[pickle.PickleBuffer]]


@dataclass(frozen=True)
class Packed:
    """A cell's inputs, pickled before the claim is sent anywhere."""

    values: dict[str, Frozen] = field(default_factory=dict)
    #: Names that cannot travel, and why.
    failures: dict[str, str] = field(default_factory=dict)

    def discard(self) -> None:
        """Nothing to give back: unlike a local parcel's, these pickles hold no shared memory."""


def freeze(value: object) -> Frozen:
    """Pickle one value, handing its big buffers out of band for Ray to store as they are."""
    buffers: list[pickle.PickleBuffer] = []

    def spill(buffer: pickle.PickleBuffer) -> bool:
        if out_of_band(buffer) is None:
            return True
        buffers.append(buffer)
        return False

    return dumps(value, spill), buffers


def portable(frozen: Frozen) -> Frozen:
    """The same value with its buffers copied into the stream, for Ray Client.

    Ray Client carries objects between the kernel and the cluster in its own
    pickles, where an out-of-band buffer does not survive the trip: fetching
    one hangs. A bytearray is pickled in band, at the price of one copy.
    """
    data, buffers = frozen
    return data, [bytearray(buffer) for buffer in buffers]  # type: ignore[misc]


def thaw(frozen: Frozen, *, writable: bool) -> object:
    """Rebuild a value. ``writable`` copies each buffer out of the read-only object store."""
    data, buffers = frozen
    return pickle.loads(data, buffers=[bytearray(b) if writable else b for b in buffers])


def pack_inputs(values: Mapping[str, object]) -> Packed:
    """Pickle each input on its own, so one that cannot travel is named."""
    packed: dict[str, Frozen] = {}
    failures: dict[str, str] = {}
    for name, value in values.items():
        try:
            packed[name] = freeze(value)
        except Exception as error:
            failures[name] = str(error) or type(error).__name__
    return Packed(packed, failures)
