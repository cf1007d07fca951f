"""The machine at a glance: read without claiming, and said in words.

Four places show the machine: ``fluksio-nb`` in a terminal, the server's API
that JupyterLab's status bar and panel poll, the ``%claims`` monitor, and its
text fallback where no widget can be drawn. They should never disagree, so
they read the machine here (:func:`read_books`) and say it here
(:func:`describe_snapshot`, :func:`describe_monitor`).

A reader makes no claims: it reads whichever books are in force as they are,
marks the reader's own claims, and says what holds claims to their share.
Ray is looked at only where this kernel has already imported it.
"""

from __future__ import annotations

import sys
from typing import Any

from fluksio_nb.budget import human
from fluksio_nb.inventory import format_cpu_list
from fluksio_nb.kernel import Books, books_in_force, enforcement_in_force
from fluksio_nb.settings import load_settings


def read_books(books: Books | None = None) -> dict[str, Any]:
    """The machine as a reader that makes no claims sees it: the server, the terminal.

    Every claim in it says whose it is (``user``) and whether it is the
    reader's (``mine``); ``books`` says which books these are, and ``ledger``
    where. Blocking: the server calls it from a worker thread.
    """
    # Read once: the server asks for this every second or so.
    settings = load_settings()
    books = books or books_in_force(settings=settings)
    if books.mode == "machine":
        from fluksio_nb.machine.client import read_snapshot

        assert books.socket is not None
        snapshot = read_snapshot(books.socket)
    elif books.mode == "user":
        from fluksio_nb.ledger.owner import identity
        from fluksio_nb.ledger.snapshot import read_snapshot

        assert books.where is not None
        snapshot, me = read_snapshot(books.where, settings=settings), identity()["user"]
        for claim in snapshot["running"] + snapshot["waiting"]:
            claim["mine"] = claim.get("user") == me
        snapshot["user"] = me
    else:
        # Kernel-only books live inside each kernel, where no reader can see
        # them: the machine is shown, and nothing more can be known.
        from fluksio_nb.ledger.owner import identity
        from fluksio_nb.ledger.snapshot import machine_as_found

        snapshot = {**machine_as_found(settings), "user": identity()["user"]}
    snapshot["books"] = books.mode
    snapshot["ledger"] = None if books.where is None else str(books.where)
    # The books' own core ids: free or held, they are every one they hand out.
    held = {c for claim in snapshot["running"] for c in claim["allocation"].get("cores") or ()}
    core_ids = set(snapshot["cpus"].get("free_ids") or ()) | held
    snapshot["enforcement"] = enforcement_in_force(
        settings, sorted(core_ids), snapshot["cpus"]["total"]
    )
    return snapshot


def describe_snapshot(snapshot: dict) -> str:
    """The snapshot as a few lines of text: every user's claims, the reader's marked."""
    cpus, gpus, ram = snapshot["cpus"], snapshot["gpus"], snapshot["ram_bytes"]
    lines = [
        f"cpus  {cpus['free']}/{cpus['total']} free",
        f"gpus  {gpus['free']}/{gpus['total']} free",
        f"ram   {human(ram['free'])}/{human(ram['total'])} free",
    ]
    held = snapshot.get("enforcement") or {}
    if held:
        said = " · ".join(f"{name}: {how['label']}" for name, how in held.items())
        lines.append(f"held by  {said}")
    for claim in snapshot.get("running", []):
        held = claim["allocation"]
        cards = ",".join(str(g) for g in held["gpus"]) or "-"
        cores = f" cores={format_cpu_list(held['cores'])}" if held.get("cores") else ""
        lines.append(
            f"running  #{claim['ticket']} {_whose(claim)}: cpus={held['cpus']}{cores} "
            f"gpus={cards} ram={human(held['ram_bytes'])} ({_where(claim)})"
        )
    for claim in snapshot.get("waiting", []):
        asked = claim["asked"]
        lines.append(
            f"waiting  {claim['position']}. #{claim['ticket']} {_whose(claim)}: "
            f"cpus={asked['cpus']} gpus={asked['gpus']} ram={human(asked['ram_bytes'])}"
        )
    return "\n".join(lines)


def _whose(claim: dict) -> str:
    """The label, marked as the reader's; another user's name where it is theirs."""
    label = claim.get("label")
    if claim.get("mine", True):
        return f"{label} (yours)" if "mine" in claim else str(label)
    return f"{label} ({claim.get('user')})" if label else f"a claim of {claim.get('user')}"


def _where(claim: dict) -> str:
    return claim.get("notebook") or f"pid {claim['pid']}"


def ray_now() -> dict | None:
    """This kernel's Ray cluster and its claims on it; ``None`` while Ray is not connected.

    Ray is looked for in ``sys.modules`` first, and never imported just to
    look: a kernel that has not imported Ray pays one dictionary lookup.
    """
    if sys.modules.get("ray") is None:
        return None
    from fluksio_nb.ray.monitor import ray_snapshot

    return ray_snapshot()


def describe_monitor(snapshot: dict, ray: dict | None = None) -> str:
    """What ``%claims`` says as text: the machine's books, then the Ray cluster if connected."""
    text = describe_snapshot(snapshot)
    if ray is None:
        return text
    from fluksio_nb.ray.monitor import describe_ray

    return f"{text}\n{describe_ray(ray)}"
