"""A stand-in ``nvidia-smi``: what the real one prints, for cards a test describes.

``tests/gpu_standins.py`` copies this file, behind a ``#!`` line naming the
test's Python, to ``<dir>/bin/nvidia-smi``, and keeps the cards in
``<dir>/nvidia-smi.json``, which it may rewrite at any time: each run reads
it afresh. Each run also appends its arguments, as a JSON list, to
``<dir>/nvidia-smi.calls``.

It answers what fluksio_nb asks, as the real one does:

- ``-L``: ``GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-...)``, one line a card,
  then, for a card with MIG on (a ``"mig"`` list), one indented line an
  instance: ``  MIG 1g.5gb     Device  0: (UUID: MIG-...)``;
- ``--query-gpu=<fields> --format=csv[,noheader][,nounits]``: one line a
  card (whole cards only, MIG instances are not listed here),
  the fields in the order asked, joined by ``", "``;
- ``--query-compute-apps=<fields> --format=...``: one line a process with
  memory on a card (compute ones: type ``C`` or ``C+G``), nothing at all
  when there is none.

A value the card cannot give prints as ``[N/A]``, or verbatim when the JSON
has a string there (``"[Not Supported]"``). A field it does not know, or an
invocation it does not handle, fails as the real one does with a bad
argument: a message and exit code 2, so that a query fluksio_nb changes
cannot silently read nothing. A ``"fail"`` in the JSON makes every run print
its ``message`` and exit with its ``exit`` code, as the real one does when
the driver is gone (9).
"""

from __future__ import annotations

import json
import os
import sys
import time

# Each field: where its value is in a card (or app), and its unit when units are printed.
GPU_FIELDS = {
    "index": ("index", None),
    "uuid": ("uuid", None),
    "gpu_uuid": ("uuid", None),
    "name": ("name", None),
    "gpu_name": ("name", None),
    "utilization.gpu": ("utilisation", "%"),
    "memory.used": ("used_mib", "MiB"),
    "memory.total": ("total_mib", "MiB"),
    "memory.free": ("free_mib", "MiB"),
    "mig.mode.current": ("mig_mode", None),
}
#: How the header names each field, as the real one does.
GPU_HEADERS = {"gpu_uuid": "uuid", "gpu_name": "name"}

APP_FIELDS = {
    "gpu_uuid": ("uuid", None),
    "gpu_name": ("gpu_name", None),
    "pid": ("pid", None),
    "process_name": ("name", None),
    "name": ("name", None),
    "used_memory": ("used_mib", "MiB"),
    "used_gpu_memory": ("used_mib", "MiB"),
}
APP_HEADERS = {"name": "process_name", "used_memory": "used_gpu_memory"}

BAD_ARGUMENT = 2


def _value(record: dict, key: str, unit: str | None, units: bool) -> str:
    value = record.get(key)
    if value is None:
        return "[N/A]"
    if isinstance(value, str):
        return value
    return f"{value} {unit}" if units and unit else str(value)


def _csv(records: list[dict], fields: list[str], known: dict, headers: dict, options) -> str:
    lines = []
    if "noheader" not in options:
        lines.append(
            ", ".join(
                headers.get(field, field) + (f" [{known[field][1]}]" if known[field][1] else "")
                for field in fields
            )
        )
    units = "nounits" not in options
    for record in records:
        lines.append(", ".join(_value(record, *known[field], units) for field in fields))
    return "".join(line + "\n" for line in lines)


def _free(card: dict) -> dict:
    """A card's row: its free memory, and its MIG mode (``[N/A]`` where it has none, as on
    cards without MIG; ``"mig_mode"`` in the JSON says otherwise)."""
    used, total = card.get("used_mib"), card.get("total_mib")
    free = total - used if isinstance(used, int) and isinstance(total, int) else None
    mode = card.get("mig_mode", "Enabled" if "mig" in card else None)
    return {**card, "free_mib": free, "mig_mode": mode}


def _listed(card: dict) -> str:
    """A card's lines in ``-L``: its own, then its MIG instances', indented, as the real one."""
    lines = f"GPU {card['index']}: {card.get('name', '')} (UUID: {card['uuid']})\n"
    for slot, instance in enumerate(card.get("mig") or []):
        if instance is not None:
            lines += (
                f"  MIG {instance['profile']:<12}Device {slot:>2}: (UUID: {instance['uuid']})\n"
            )
    return lines


def answer(argv: list[str], state: dict) -> tuple[int, str, str]:
    """The exit code, stdout and stderr of ``nvidia-smi argv``."""
    failure = state.get("fail")
    if failure:
        return failure["exit"], failure.get("message", "") + "\n", ""
    cards = state.get("cards", [])
    if argv in (["-L"], ["--list-gpus"]):
        return 0, "".join(_listed(card) for card in cards), ""
    queries = [arg for arg in argv if arg.startswith("--query-")]
    formats = [arg for arg in argv if arg.startswith("--format=")]
    if len(queries) != 1 or len(formats) != 1 or len(argv) != 2:
        return BAD_ARGUMENT, "", f"stand-in nvidia-smi: cannot answer {argv}\n"
    kind, _, listed = queries[0].partition("=")
    options = formats[0].removeprefix("--format=").split(",")
    if options[0] != "csv" or not set(options[1:]) <= {"noheader", "nounits"}:
        return BAD_ARGUMENT, f'"{formats[0]}" is not a valid format.\n', ""
    fields = listed.split(",")
    if kind == "--query-gpu":
        known, headers = GPU_FIELDS, GPU_HEADERS
        records = [_free(card) for card in cards]
    elif kind == "--query-compute-apps":
        known, headers = APP_FIELDS, APP_HEADERS
        names = {card["uuid"]: card.get("name", "") for card in cards}
        records = [
            {**app, "gpu_name": names.get(app["uuid"])}
            for app in state.get("apps", [])
            if app.get("type", "C") in ("C", "C+G")
        ]
    else:
        return BAD_ARGUMENT, "", f"stand-in nvidia-smi: cannot answer {kind}\n"
    for field in fields:
        if field not in known:
            return (
                BAD_ARGUMENT,
                f'Field "{field}" is not a valid field to query.\n\n',
                "",
            )
    return 0, _csv(records, fields, known, headers, options[1:]), ""


def main() -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = sys.argv[1:]
    with open(os.path.join(here, "nvidia-smi.calls"), "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    with open(os.path.join(here, "nvidia-smi.json")) as state:
        found = json.load(state)
    # A driver that does not answer: the run waits until the test lets it go.
    while found.get("hang_until") and not os.path.exists(found["hang_until"]):
        time.sleep(0.01)
    code, out, err = answer(argv, found)
    sys.stdout.write(out)
    sys.stderr.write(err)
    return code


if __name__ == "__main__":
    sys.exit(main())
