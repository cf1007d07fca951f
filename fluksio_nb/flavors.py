"""Named sizes, so a team says ``flavor=gpu-small`` instead of three numbers.

A flavor is read when a claim is made, not copied into the notebook, so
editing one in the config file changes what the next claim gets. Numbers
written on the line beside a flavor win over the flavor's: ``flavor=gpu-small
ram=32G`` is the small GPU size with more memory, which is what it says.

A flavor that does not exist is an error rather than a default: a training
run on a size nobody chose is worse than a cell that says what is wrong.
"""

from __future__ import annotations

from fluksio_nb.errors import UnknownFlavor
from fluksio_nb.resources import Resources
from fluksio_nb.settings import Flavor, Settings, config_path

#: Sizes every installation has. They are deliberately generous, because an
#: oversized claim is clamped to the machine with a warning; the user's own
#: file adds to these and may redefine any of them.
BUILT_IN_FLAVORS: dict[str, Flavor] = {
    "cpu-small": Flavor(cpus=2, ram="4G"),
    "cpu-large": Flavor(cpus=8, ram="32G"),
    "gpu-small": Flavor(cpus=4, gpus=1, ram="16G"),
    "gpu-large": Flavor(cpus=8, gpus=2, ram="64G"),
}


def all_flavors(settings: Settings) -> dict[str, Flavor]:
    """The built-in sizes with the user's own on top."""
    return {**BUILT_IN_FLAVORS, **settings.flavors}


def resolve_flavor(wanted: Resources, settings: Settings) -> Resources:
    """The concrete numbers behind a claim that names a flavor."""
    if wanted.flavor is None:
        return wanted
    flavor = all_flavors(settings).get(wanted.flavor)
    if flavor is None:
        raise UnknownFlavor(
            f"flavor '{wanted.flavor}' does not exist; `fluksio-nb flavors` lists them, "
            f"and {config_path()} defines your own"
        )
    from_flavor = {
        name: getattr(flavor, name)
        for name in ("cpus", "gpus", "ram", "gpu_ram")
        if name not in wanted.model_fields_set and (name != "gpu_ram" or flavor.gpu_ram)
    }
    # Built anew rather than copied with model_copy, so the validators run on
    # the result and a flavor cannot smuggle in something a claim could not say.
    return Resources(**{**wanted.model_dump(exclude_unset=True), **from_flavor})


def describe_flavors(settings: Settings) -> str:
    """The table ``fluksio-nb flavors`` prints."""
    rows = [("flavor", "cpus", "gpus", "ram", "gpu_ram")]
    for name, flavor in sorted(all_flavors(settings).items()):
        ram, gpu_ram = (
            size.human_readable(decimal=True) if size else "-"
            for size in (flavor.ram, flavor.gpu_ram)
        )
        rows.append((name, str(flavor.cpus), str(flavor.gpus), ram, gpu_ram))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
