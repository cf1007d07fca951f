"""``fluksio-nb``: the machine's books in a terminal, and the flavors.

For the person at a shell on a shared box who wants to know, before starting
a notebook, how much of the machine is free and which sizes they may ask for.
"""

from __future__ import annotations

import argparse
import sys

from fluksio_nb.budget import human
from fluksio_nb.flavors import describe_flavors
from fluksio_nb.inventory import format_cpu_list
from fluksio_nb.resources import BadClaim


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["usage"]:
        from fluksio_nb.usage import usage_main

        return usage_main(argv[1:])
    if argv[:1] == ["machine"]:
        from fluksio_nb.machine.setup import main as machine_main

        return machine_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="fluksio-nb",
        description="Show this machine's shares, or the flavors. "
        "`fluksio-nb usage -h`: what past claims used; `fluksio-nb machine -h`: books "
        "every user of the machine shares.",
    )
    parser.add_argument("what", nargs="?", choices=["snapshot", "flavors"], default="snapshot")
    options = parser.parse_args(argv)
    from fluksio_nb.kernel import read_books
    from fluksio_nb.settings import load_settings

    try:
        settings = load_settings()
        if options.what == "flavors":
            print(describe_flavors(settings))
        else:
            # A terminal makes no claims: it reads the machine's books as they are.
            print(describe_snapshot(read_books()))
    except BadClaim as error:
        print(f"fluksio-nb: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
