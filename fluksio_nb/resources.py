"""What a cell asks for, checked before anything waits on it.

A claim is typed by hand at the top of a cell, so most mistakes in it are
typos: ``cpu=2``, ``ram=8GB ``, ``gpus=one``. Each of those has to fail where it
was typed, with the word that was wrong and the words that would have been
right, rather than queue for ten minutes and then fail, or worse, quietly run
with a default nobody chose.

:class:`Resources` is the one shape every way of asking arrives in: the
``%%claim`` line, ``claim(...)`` keyword arguments, a flavor from the config
file. Sizes go through pydantic's :class:`~pydantic.ByteSize`, so ``8G`` is
decimal (8 × 10⁹ bytes) and ``8GiB`` binary, the same as everywhere else
pydantic reads a size.

Declaring nothing is not a :class:`Resources` at all: a cell without ``%%claim``
never reaches this module and runs in the kernel as it always did.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from fluksio_nb.card_slices import CardAsk, Slice
from fluksio_nb.errors import BadClaim

#: What an environment variable handed to the worker may be called. Upper
#: case only on the ``%%claim`` line, which is how ``OMP_NUM_THREADS=1`` is told
#: apart from a resource such as ``cpus=1``.
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


#: What a flavor may be called: dashes allowed, because "gpu-small" reads
#: better than "gpu_small" when it is typed at the top of a cell.
FLAVOR_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")

#: What the line may say as NAME=VALUE, lower case. The rest of the fields are
#: spelt as options (``--label``) or are not a resource at all (``env``).
LINE_KEYS = ("cpus", "gpus", "ram", "gpu_ram", "flavor")


_SIZE = TypeAdapter(ByteSize)


class Resources(BaseModel):
    """One request for a share of the machine.

    ``cpus`` defaults to one, because a worker is a process and a process runs
    on at least one core; ``gpus`` to none; ``ram`` to unaccounted, which means
    the claim takes no memory from the books and is held only to the host's
    headroom, not to a budget of its own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: int = Field(default=1, ge=1)
    #: Whole cards, or a fraction below one of one card: a slice
    #: (:mod:`fluksio_nb.card_slices`).
    gpus: int | float = Field(default=0, ge=0)
    ram: ByteSize | None = None
    #: Card memory each of the claim's cards may hold; without ``gpus=``, a
    #: slice of one card with that much memory.
    gpu_ram: ByteSize | None = None
    env: dict[str, str] = Field(default_factory=dict)
    flavor: str | None = None
    timeout: float | None = None
    label: str | None = None
    strict: bool = False

    @model_validator(mode="before")
    @classmethod
    def _name_the_misspelled_key(cls, data: Any) -> Any:
        # pydantic's own "extra inputs are not permitted" names the key but not
        # the ones that exist, and the fix is almost always a one-letter edit.
        if isinstance(data, Mapping):
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                raise ValueError(unknown_keys_message(unknown))
        return data

    @model_validator(mode="after")
    def _cards_come_from_the_books(self) -> Resources:
        # The one variable a claim may not set: written beside gpus=, it would
        # replace the card the books grant with one somebody else may hold.
        if self.gpus and "CUDA_VISIBLE_DEVICES" in self.env:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={self.env['CUDA_VISIBLE_DEVICES']} would replace the "
                f"card{'s' if self.gpus > 1 else ''} this claim is granted with one another "
                "claim may hold; drop it and let gpus= pick a free card"
            )
        if self.gpu_ram is not None and isinstance(self.gpus, float):
            raise ValueError(
                f"gpus={self.gpus} and gpu_ram={self.gpu_ram.human_readable(decimal=True)} "
                "both size a slice of one card; say it once: gpus=0.5, or gpu_ram= alone"
            )
        return self

    @field_validator("cpus", "gpus", mode="before")
    @classmethod
    def _whole_counts_only(cls, value: Any, info: Any) -> Any:
        # Lax int parsing would take True as 1 and 2.0 as 2; a count of cores
        # given as a boolean or a fraction is a mistake worth saying out loud.
        what = info.field_name
        if what == "gpus" and not isinstance(value, bool):
            value = _slice_of_a_card(value)
            if isinstance(value, float):
                return value
        if isinstance(value, bool):
            raise ValueError(f"{what} must be a whole number, not {value!r}")
        if isinstance(value, float):
            if not value.is_integer():
                raise ValueError(f"{what} must be a whole number of devices, not {value}")
            value = int(value)
        if isinstance(value, str):
            text = value.strip()
            if not re.fullmatch(r"[+-]?\d+", text):
                raise ValueError(f"{what} must be a whole number such as 2, not {value!r}")
            value = int(text)
        if isinstance(value, int) and value < (1 if what == "cpus" else 0):
            least = "1 (a worker runs on at least one core)" if what == "cpus" else "0"
            raise ValueError(f"{what} must be at least {least}, not {value}")
        return value

    @field_validator("ram", "gpu_ram", mode="before")
    @classmethod
    def _sizes_say_how_to_write_a_size(cls, value: Any, info: Any) -> Any:
        what = info.field_name
        if value is None:
            return None
        if isinstance(value, bool):
            raise ValueError(f"{what} must be a size such as 8G or 512MiB, not {value!r}")
        if isinstance(value, int | float) and value <= 0:
            raise ValueError(f"{what} must be more than zero bytes, not {value}")
        if isinstance(value, str):
            try:
                size = _SIZE.validate_python(value)
            except (ValueError, TypeError):
                raise ValueError(
                    f"{what}={value!r} is not a size: write a number and a unit, "
                    "such as 8G, 512M, 1.5GiB, or a plain number of bytes"
                ) from None
            if size <= 0:
                raise ValueError(f"{what} must be more than zero bytes, not {value!r}")
        return value

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout_is_seconds(cls, value: Any) -> Any:
        return None if value is None else seconds(value)

    @field_validator("env")
    @classmethod
    def _env_names_are_variables(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not name or "=" in name or "\0" in name:
                raise ValueError(f"{name!r} cannot be the name of an environment variable")
        return env

    @field_validator("flavor")
    @classmethod
    def _flavor_is_a_name(cls, flavor: str | None) -> str | None:
        if flavor is not None and not FLAVOR_NAME.match(flavor):
            raise ValueError(
                f"flavor {flavor!r} is not a flavor name: lower case letters, digits, "
                "'-' and '_', starting with a letter (`fluksio-nb flavors` lists them)"
            )
        return flavor

    @property
    def ram_bytes(self) -> int:
        """The memory this claim takes from the books: none if it named none."""
        return int(self.ram) if self.ram is not None else 0

    def describe(self, gpus_if_none: bool = False) -> str:
        """The request as a person would type it: ``cpus=2 gpus=1 ram=8.0GB``.

        ``gpus=0`` is left out unless ``gpus_if_none``: said when cards asked for were dropped.
        """
        words = [f"cpus={self.cpus}"]
        if self.gpus or gpus_if_none:
            words.append(f"gpus={self.gpus}")
        if self.ram is not None:
            words.append(f"ram={self.ram.human_readable(decimal=True)}")
        if self.gpu_ram is not None:
            words.append(f"gpu_ram={self.gpu_ram.human_readable(decimal=True)}")
        return " ".join(words)

    @property
    def is_slice(self) -> bool:
        """Whether this claim asks for a slice of one card rather than whole cards."""
        return isinstance(self.gpus, float) or (not self.gpus and self.gpu_ram is not None)

    @property
    def whole_gpus(self) -> int:
        """The whole cards this claim asks for: none for a slice."""
        return 0 if self.is_slice else int(self.gpus)

    @property
    def card_ask(self) -> CardAsk:
        """What this claim asks of the cards, for :mod:`fluksio_nb.card_slices`."""
        if isinstance(self.gpus, float):
            return CardAsk(piece=Slice(fraction=self.gpus))
        if self.is_slice:
            return CardAsk(piece=Slice(nbytes=int(self.gpu_ram)))  # type: ignore[arg-type]
        return CardAsk(whole=int(self.gpus))

    @property
    def gpu_ram_bytes(self) -> int | None:
        """Card memory each card may hold, or ``None`` for no card budget."""
        return int(self.gpu_ram) if self.gpu_ram is not None else None


def _slice_of_a_card(value: Any) -> Any:
    """``gpus=`` as a whole count, or as a float in (0, 1): a slice of one card."""
    if isinstance(value, str) and re.fullmatch(r"\s*\d*\.\d+\s*", value):
        value = float(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        if not 0 < value < 1:
            raise ValueError(
                f"gpus must be a whole number of cards, or a slice of one card between 0 "
                f"and 1 such as gpus=0.5, not {value}"
            )
    return value


def seconds(value: Any, what: str = "timeout") -> float:
    """A timeout as a number of seconds above 0, or a ValueError that says how to write one.

    Infinity is refused with the rest: it means no timeout, which is said by
    giving none, and a deadline of ``inf`` overflows the waits it is handed to.
    """
    number: float | None = None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):
            number = float(value)
    if number is None or not 0 < number < math.inf:
        shown = value if isinstance(value, str) and value.strip() else repr(value)
        raise ValueError(
            f"{what} must be a number of seconds above 0, such as 30 (got {shown}); "
            "leave it out to wait and run for as long as it takes"
        )
    return number


def unknown_keys_message(
    unknown: list[str], valid: Iterable[str] | None = None, noun: str = "resource"
) -> str:
    """Name each unknown key, the nearest real one, and every real one."""
    known = list(Resources.model_fields if valid is None else valid)
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        parts.append(f"{key!r}{hint}")
    return f"unknown {noun} {', '.join(parts)}; the {noun}s are: {', '.join(known)}"


def ask(**fields: Any) -> Resources:
    """Build :class:`Resources`, turning pydantic's report into one paragraph.

    A ``ValidationError`` is the right exception for a library and the wrong
    one for a person at a notebook: it is several lines of locations and types.
    :class:`BadClaim` keeps only what was wrong, in the words that were typed.
    """
    try:
        return Resources(**fields)
    except ValidationError as error:
        raise BadClaim(explain(error)) from None


def explain(error: ValidationError) -> str:
    """One paragraph out of a pydantic report: each problem once, in plain words."""
    problems = []
    for item in error.errors(include_url=False):
        message = str(item.get("msg", ""))
        message = message.removeprefix("Value error, ")
        where = ".".join(str(part) for part in item.get("loc", ()))
        if where and where not in message:
            message = f"{where}: {message}"
        if message not in problems:
            problems.append(message)
    return "; ".join(problems) + "."
