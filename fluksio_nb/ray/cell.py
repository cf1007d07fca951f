"""``%%claim ... --on ray``: the magic's cell, sent to the cluster as a claim.

The magic reads the claim line and the cell's names, as for a local claim;
what differs on Ray is how the inputs are packed and where the claim is
made. This module is that glue: it packs the inputs for the object store,
refuses what cannot travel before anything is sent, connects the claim to
its cluster, and runs the cell in the foreground or as a ``--background``
job.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fluksio_nb import random_streams
from fluksio_nb.context import SHOW_AFTER_S
from fluksio_nb.ray.claim import RayClaim
from fluksio_nb.ray.values import Packed, pack_inputs
from fluksio_nb.resources import BadClaim
from fluksio_nb.worker.client import Outcome


def run_cell(
    shell: Any,
    parsed: Any,
    cell: str,
    inputs: Sequence[str],
    outputs: Sequence[str] | None,
    sink: Any,
    if_changed: Sequence[str] = (),
) -> Outcome:
    """``%%claim ... --on ray``: run the cell as a Ray task; how it went, names included.

    ``parsed`` is the cell's :class:`~fluksio_nb.claim_line.ClaimLine`. The
    caller binds the names that came back, as for a local claim.
    """
    claimed, packed = _prepare(shell, parsed, inputs)
    with claimed:  # connected already: only the release is left to the block
        return claimed.run_code(
            cell,
            packed,
            outputs,
            sink,
            if_changed=if_changed,
            random_state=random_streams.capture(),
        )


def start_job(
    shell: Any,
    parsed: Any,
    cell: str,
    inputs: Sequence[str],
    outputs: Sequence[str] | None,
    *,
    by_hand: bool,
    if_changed: Sequence[str] = (),
) -> Any:
    """``%%claim ... --on ray --background``: the task runs while the user goes on; its handle.

    The handle is a local background claim's (:class:`~fluksio_nb.jobs.Job`),
    with the same promises: output in the cell that started it, names on the
    handle. Connecting and refusing a claim no node can hold happen before it
    returns, as they do for a cell that waits.
    """
    from fluksio_nb.jobs import Job

    claimed, packed = _prepare(shell, parsed, inputs, show_at_once=True)
    return Job(claimed, cell, packed, outputs, by_hand, if_changed, shell.user_ns)


def _prepare(
    shell: Any, parsed: Any, inputs: Sequence[str], show_at_once: bool = False
) -> tuple[RayClaim, Packed]:
    """A claim connected to its cluster and the cell's inputs packed; bad input a UsageError."""
    from IPython.core.error import UsageError

    from fluksio_nb.status import new_view

    packed = pack_inputs({name: shell.user_ns[name] for name in inputs})
    if packed.failures:
        names = ", ".join(f"'{n}' ({reason})" for n, reason in sorted(packed.failures.items()))
        raise UsageError(
            f"%%claim: cannot send {names} to the Ray cluster. Create it inside the cell, "
            "or leave it out with --in."
        )
    try:
        # A background claim's status is shown at once, from this thread: it
        # belongs in the cell that started it, which is only the executing one now.
        claimed = RayClaim(
            parsed.resources,
            parsed.on,
            view=new_view(),
            show_after=None if show_at_once else SHOW_AFTER_S,
        )
        claimed.acquire()
    except BadClaim as error:
        raise UsageError(str(error)) from None
    return claimed, packed
