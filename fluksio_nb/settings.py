"""Where fluksio_nb's configuration comes from, and which source wins.

There are two places, read in this order, the later winning:

1. ``fluksio_nb.json`` in the user's Jupyter config directory (``jupyter
   --config-dir``, usually ``~/.jupyter``), or the file ``FLUKSIO_CONFIG`` names.
   It is shared by every kernel the user starts, which is why the flavors live
   there too: a size defined once is the same size in every notebook.
2. ``FLUKSIO_*`` environment variables, one per setting, for the one-off: a
   test declaring two GPUs on a machine with none, a demo, a batch job.

Settings are read when the kernel's accountant is first made and not again.
Changing the inventory under a running accountant would leave claims holding
cards that no longer exist in its books.

A bad value is an error that names its source. A typo in a config file has to
say which file and which key, or the user goes looking in the wrong one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fluksio_nb.errors import BadSettings
from fluksio_nb.resources import explain, unknown_keys_message

CONFIG_FILE_NAME = "fluksio_nb.json"

#: Each setting's environment variable. The config file uses the key on the left.
ENV_VARS = {
    "cpus": "FLUKSIO_CPUS",
    "gpus": "FLUKSIO_GPUS",
    "ram": "FLUKSIO_RAM",
    "reserve_cpus": "FLUKSIO_RESERVE_CPUS",
    "ledger": "FLUKSIO_LEDGER",
    "fair_share": "FLUKSIO_FAIR_SHARE",
    "pin_cores": "FLUKSIO_PIN_CORES",
    "memory_cap": "FLUKSIO_MEMORY_CAP",
    "memory_warn_at": "FLUKSIO_MEMORY_WARN_AT",
    "memory_halt_at": "FLUKSIO_MEMORY_HALT_AT",
    "warm_start": "FLUKSIO_WARM_START",
    "books_linger": "FLUKSIO_BOOKS_LINGER",
}

#: Cores kept back for the kernel and the Jupyter server when nobody said.
#: Both spend nearly all their time waiting for the user, so one core is
#: enough to keep them answering while every other core is claimed; the seed
#: engine's two was for an event loop that also ran its own scheduler.
DEFAULT_RESERVE_CPUS = 1

#: The share of a claim's memory budget at which its status turns amber and
#: the cell is told once, and the share at which it is stopped. Dask's nanny
#: stages memory the same way: a warning the user can act on comes first,
#: with room left to act, and only then the stop.
DEFAULT_MEMORY_WARN_AT = 0.8
DEFAULT_MEMORY_HALT_AT = 1.0


#: The least RAM a machine may be declared to have: below it, a declaration is a slip.
LEAST_RAM = 256 * 2**20


class Flavor(BaseModel):
    """A named size: the numbers behind ``flavor=gpu-small``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: int = Field(default=1, ge=1)
    #: Whole cards, or a slice of one card below 1 (``0.5``).
    gpus: int | float = Field(default=0, ge=0)
    ram: ByteSize | None = None
    gpu_ram: ByteSize | None = None

    @field_validator("gpus")
    @classmethod
    def _whole_cards_or_a_slice(cls, gpus: int | float) -> int | float:
        if isinstance(gpus, float) and gpus.is_integer():
            return int(gpus)
        if isinstance(gpus, float) and not 0 < gpus < 1:
            raise ValueError(
                f"gpus is a whole number of cards, or a slice of one card below 1 "
                f"such as 0.5, not {gpus}"
            )
        return gpus


class Settings(BaseModel):
    """Everything that can be configured, after both sources are merged.

    ``None`` for an inventory field means "detect it"; a number declares it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: int | None = Field(default=None, ge=1)
    gpus: int | None = Field(default=None, ge=0)
    ram: ByteSize | None = None
    reserve_cpus: int = Field(default=DEFAULT_RESERVE_CPUS, ge=0)
    #: Where the books are: the directory of a user's own books service, a
    #: machine's run directory, or ``"kernel"`` for books that only this
    #: kernel keeps. ``None``: the machine's if an admin set them up, else
    #: the user's own in Jupyter's runtime directory.
    ledger: str | None = None
    #: How many seconds a user's own books service stays after their last
    #: kernel left, for the next to find it answering.
    books_linger: float = Field(default=60.0, ge=0, le=86400, allow_inf_nan=False)
    #: On books shared by several users, show this user's labels, notebook
    #: paths and kernel ids to the others too. Their share and user always show.
    share_labels: bool = False
    #: Kernels Jupyter starts here get the fair share of the cores no claim
    #: holds (:mod:`fluksio_nb.provisioner`). ``false`` starts them as Jupyter
    #: would without fluksio_nb: no thread variables, every core.
    fair_share: bool = True
    #: Each claim runs on cores of its own (affinity, and a cpuset where one
    #: can be made: :mod:`fluksio_nb.cpuset`). ``false`` leaves claims
    #: sharing every claimable core, held only by their thread variables.
    pin_cores: bool = True
    flavors: dict[str, Flavor] = Field(default_factory=dict)
    #: Hold a claim's ``ram=`` with a cgroup memory limit where this process
    #: may make one (:mod:`fluksio_nb.memory_cap`); off, the sampler alone acts.
    memory_cap: bool = True
    #: Shares of a claim's memory budget: warned at the first, stopped at the second.
    memory_warn_at: float = DEFAULT_MEMORY_WARN_AT
    memory_halt_at: float = DEFAULT_MEMORY_HALT_AT
    #: ``%load_ext`` starts a worker ahead of the first claim
    #: (:mod:`fluksio_nb.warm_start`). ``false`` leaves the first claim to start
    #: its own, for a machine where many kernels load the extension and few claim.
    warm_start: bool = True

    @model_validator(mode="before")
    @classmethod
    def _name_the_misspelled_key(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                raise ValueError(unknown_keys_message(unknown, cls.model_fields, "setting"))
        return data

    @field_validator("ram")
    @classmethod
    def _ram_is_a_machines_worth(cls, value: ByteSize | None) -> ByteSize | None:
        # A bare 12, meant as 12 GB, is 12 bytes; 0 declares a machine every
        # ram= is clamped to nothing on, and the budget silently dropped.
        if value is not None and value < LEAST_RAM:
            raise ValueError(
                f"{int(value)} bytes is less than any machine has; write the size with its "
                "unit, such as 16G (16 * 10^9 bytes) or 16GiB, or leave it out to detect it"
            )
        return value

    @model_validator(mode="after")
    def _warn_before_halting(self) -> Settings:
        warn, halt = self.memory_warn_at, self.memory_halt_at
        if not 0 < halt <= 1:
            raise ValueError(
                f"memory_halt_at={halt:g} must be above 0 and at most 1: it is the share of "
                "a claim's ram= at which the claim is stopped, and a claim may use all of it"
            )
        if not 0 < warn < halt:
            raise ValueError(
                f"memory_warn_at={warn:g} must be above 0 and below memory_halt_at={halt:g}: "
                "the warning has to come before the stop to be worth reading"
            )
        return self


def config_path(environ: Mapping[str, str] | None = None) -> Path:
    """The config file every kernel of this user reads."""
    environ = os.environ if environ is None else environ
    if environ.get("FLUKSIO_CONFIG"):
        return Path(environ["FLUKSIO_CONFIG"]).expanduser()
    from jupyter_core.paths import jupyter_config_dir

    return Path(jupyter_config_dir()) / CONFIG_FILE_NAME


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings in force: the config file, then ``FLUKSIO_*`` on top."""
    environ = os.environ if environ is None else environ
    path = config_path(environ)
    from_file = _read_config_file(path)
    try:
        Settings(**from_file)
    except ValidationError as error:
        raise BadSettings(f"{path}: {explain(error)}") from None

    from_env = {key: environ[var] for key, var in ENV_VARS.items() if environ.get(var)}
    try:
        return Settings(**{**from_file, **from_env})
    except ValidationError as error:
        names = ", ".join(f"{ENV_VARS[key]}={value!r}" for key, value in from_env.items())
        raise BadSettings(f"environment ({names}): {explain(error)}") from None


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise BadSettings(f"{path} cannot be read: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise BadSettings(
            f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); fix or remove it"
        ) from None
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as error:
        raise BadSettings(
            f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: "
            f"{error.msg}); fix or remove it"
        ) from None
    if not isinstance(data, dict):
        raise BadSettings(f'{path} must hold a JSON object, such as {{"reserve_cpus": 1}}')
    return data
