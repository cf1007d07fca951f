"""An array a claimed cell may have changed in place, changed in place in the kernel too.

``total = data.sum()`` and ``data.sort()`` bind no name for ``data``, yet in
a normal cell the second changes the kernel's ``data``, and every view of it
and every other name for it sees the change. A claimed cell sends ``data`` to its
worker and the worker sends it back if a call may have changed it
(:func:`fluksio_nb.variables.choose_if_changed`). A big array travels in
shared memory the worker writes to in place, so the worker has no copy to
tell a change by, and sends it back always: bound as it came, it replaced
the kernel's array, so ``data`` stopped being the array its views look at,
and a read-only ``data.sum()`` cost a new array.

``data *= 2`` and ``data[0] = 1`` change ``data`` in place too, in a normal
cell, though in a claimed one ``data`` comes back as any name the cell binds
(:func:`fluksio_nb.variables.names_never_rebound`).

So an array that comes back for such a name, the kernel's own array being of
the same type, shape and dtype and writeable, goes into the kernel's own
instead of replacing it: left alone if equal, copied into it if not. Any
other value is bound as it came.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any


def into_the_kernels_own(
    values: Mapping[str, object], names: Iterable[str], namespace: MutableMapping[str, Any]
) -> dict[str, object]:
    """``values`` left to bind: less each of ``names`` that went into the kernel's own array."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return dict(values)
    rest = dict(values)
    for name in names:
        mine, came = namespace.get(name), values.get(name)
        if (
            type(mine) is not numpy.ndarray
            or type(came) is not numpy.ndarray
            or mine.shape != came.shape
            or mine.dtype != came.dtype
            or not mine.flags.writeable
        ):
            continue
        # The same memory, as a value sent back on the kernel's own array
        # is (:mod:`fluksio_nb.shared_in_place`), is equal without a look.
        same_memory = mine.__array_interface__ == came.__array_interface__
        if mine is not came and not same_memory and not numpy.array_equal(mine, came):
            numpy.copyto(mine, came)
        del rest[name]
    return rest
