"""A cell's values on their way to its worker and back, as the kernel packs and unpacks them.

The worker's side is :func:`~fluksio_nb.worker.main.unpack_inputs` and
:func:`~fluksio_nb.worker.main.pack_outputs`; the two here mirror them, so
that how values travel (:mod:`fluksio_nb.transfer`) can be changed without
touching how cells run. What is decided here:

- **An input that cannot go is refused before the cell runs**, by name, as
  an :class:`~fluksio_nb.errors.UnsendableInput`. Big ones go in files the
  kernel keeps for the next cell, and a big array of the kernel's is moved
  onto its file where it lies, so that sending it again costs nothing.
- **An output the kernel has no room for is refused before it is rebuilt**
  (:mod:`fluksio_nb.kernel_room`), its shared memory removed with it, and
  one that ran out of room as it was rebuilt is told in the same words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fluksio_nb import kernel_room, transfer
from fluksio_nb.errors import unsendable


def pack_inputs(values: Mapping[str, Any]) -> Any:
    """What the worker is sent for ``values``; refuses before the cell runs if one won't go."""
    if isinstance(values, transfer.Parcel):
        return values  # packed by the caller, before it waited for a share
    parcel = transfer.pack(values, reuse=True, in_place=True)
    if parcel.failures:
        parcel.discard()
        raise unsendable(*next(iter(parcel.failures.items())), "the worker")
    return parcel


def lends_files(parcel: Any) -> bool:
    """Whether a parcel of outputs holds shared-memory files the worker lent."""
    return any(value.segments for value in parcel.values.values())


def unpack_outputs(parcel: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The cell's outputs by name, and why each one that could not be rebuilt wasn't.

    A name the kernel has no room for is refused before it is rebuilt
    (:mod:`fluksio_nb.kernel_room`), its shared memory removed with it.
    """
    if parcel is None:
        return {}, {}
    weighed = kernel_room.weigh(parcel)
    refused = weighed.refused
    if refused:
        transfer.Parcel({name: parcel.values[name] for name in refused}).discard()
        parcel = transfer.Parcel(
            {name: value for name, value in parcel.values.items() if name not in refused},
            parcel.failures,
        )
    with kernel_room.rebuilding_within(weighed.room) as why:
        values, failures = transfer.unpack(parcel)
    # Only a value rebuilt here can have run out of room here; the worker's
    # own failures keep their words.
    failed = {name: why(said) if name in parcel.values else said for name, said in failures.items()}
    return values, {**failed, **refused}
