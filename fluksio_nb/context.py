"""``with claim(cpus=2) as c:``, and where a claim runs.

A claim is taken the same way wherever it runs, so the user's one word for
where is ``on=`` (``--on`` on the ``%%claim`` line): nothing means this
machine, ``"ray"`` or a Ray address means a Ray cluster. :func:`place_to_run`
is the one place that turns that word into a claim type; a new place to run
is a module with a :class:`~fluksio_nb.lifecycle.ClaimLifecycle` of its own
and a line there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fluksio_nb.lifecycle import ClaimLifecycle
from fluksio_nb.local_claim import Claim
from fluksio_nb.resources import ask
from fluksio_nb.status import StatusView


def place_to_run(on: str | None) -> type[ClaimLifecycle]:
    """The claim type that runs where ``on`` says: this machine, or a Ray cluster."""
    if on is None:
        return Claim
    # Ray is the one place elsewhere, and a bare ``host:port`` is its address.
    from fluksio_nb.ray.claim import RayClaim

    return RayClaim


def claim(
    cpus: int | None = None,
    gpus: int | None = None,
    ram: int | str | None = None,
    *,
    gpu_ram: int | str | None = None,
    env: Mapping[str, str] | None = None,
    flavor: str | None = None,
    label: str | None = None,
    timeout: float | None = None,
    strict: bool = False,
    view: StatusView | None = None,
    on: str | None = None,
) -> ClaimLifecycle:
    """Hold a share of the machine for a ``with`` block.

    ``with claim(cpus=2, gpus=1, ram="8G") as c:`` waits for the share, then
    gives ``c.allocation``, ``c.env``, ``c.run(fn, *args)``, ``c.popen(args)``
    and ``c.readings``. The kernel's own BLAS/OpenMP pools are limited to the
    share inside the block.

    ``on="ray"`` (or a Ray address) holds the share on one node of a Ray
    cluster instead, and runs each ``c.run`` there as a Ray task: see
    :class:`fluksio_nb.ray.claim.RayClaim`.
    """
    fields: dict[str, Any] = {
        name: value
        for name, value in {
            "cpus": cpus,
            "gpus": gpus,
            "ram": ram,
            "gpu_ram": gpu_ram,
            "flavor": flavor,
        }.items()
        if value is not None
    }
    wanted = ask(**fields, env=dict(env or {}), label=label, timeout=timeout, strict=strict)
    return place_to_run(on).for_block(wanted, on, view=view)
