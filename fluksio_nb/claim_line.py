"""Reading the ``%%claim`` line: what is asked, and how the cell should run.

The line mixes three vocabularies, and telling them apart is this module's
whole job. Lower-case ``NAME=VALUE`` pairs are resources (``cpus=2``); upper-case
pairs are environment variables for the worker (``OMP_NUM_THREADS=1``), because
that is how they are spelt everywhere else; ``--options`` say how the cell runs
rather than what it takes (``--in``, ``--background``).

The parser is an :mod:`argparse` parser built here, once, so that ``%%claim?``
in the notebook prints the same options this module accepts: the magic takes
its help text from :func:`claim_parser`, and there is no second list to drift.

Whatever text arrives, the answer is a :class:`ClaimLine` or a
:class:`~fluksio_nb.resources.BadClaim` that says what to change. argparse's
habit of printing usage and calling ``sys.exit`` is switched off, because
inside a kernel that would look like the cell died.
"""

from __future__ import annotations

import argparse
import functools
import shlex
from dataclasses import dataclass
from typing import Any, NoReturn

from fluksio_nb.errors import BadClaim
from fluksio_nb.resources import (
    ENV_NAME,
    LINE_KEYS,
    Resources,
    ask,
    seconds,
    unknown_keys_message,
)


@dataclass(frozen=True)
class ClaimLine:
    """A parsed ``%%claim`` line."""

    resources: Resources
    #: Names to ship in or bring back, when the user chose instead of the AST.
    inputs: tuple[str, ...] | None = None
    outputs: tuple[str, ...] | None = None
    background: bool = False
    #: Where the cell runs instead of this machine: ``ray`` or a Ray address.
    on: str | None = None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BadClaim(f"%%claim: {message}. `%%claim?` shows the options.")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise BadClaim(message or "%%claim: the line could not be read.")


class _Once(argparse.Action):
    """Take an option once, as a NAME=VALUE pair is taken.

    argparse lets the last of a repeated option win, so `--timeout 1 --timeout 2`
    ran with two seconds and never said the one was dropped.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = vars(namespace).setdefault("given_options", set())
        if self.dest in given:
            raise BadClaim(f"%%claim: {option_string} is given twice; keep one.")
        given.add(self.dest)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _flag(parser: argparse.ArgumentParser, option: str, help: str) -> None:
    parser.add_argument(option, action=_Once, nargs=0, const=True, default=False, help=help)


def _names(option: str, text: str | None, what: str, otherwise: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        # An empty list would ship or bring back nothing at all, and say nothing
        # of it: the names a cell needed would simply not be there.
        raise BadClaim(
            f"%%claim: {option} names nothing; list the names to {what}, such as "
            f"{option} a,b, or drop {option} to {otherwise}."
        )
    for name in names:
        if not name.isidentifier():
            raise BadClaim(
                f"%%claim: {option} names {name!r}, which is not a Python name; give "
                f"names separated by commas, such as {option} a,b."
            )
    return names


def _not_empty(option: str, text: str | None, instead: str) -> str | None:
    if text is not None and not text.strip():
        raise BadClaim(f"%%claim: {option} is empty; {instead}.")
    return text


def claim_parser() -> argparse.ArgumentParser:
    """The one definition of what a ``%%claim`` line may say."""
    parser = _Parser(
        prog="%%claim",
        # A fixed width, not the terminal's: docs/reference.md quotes this text and a
        # test holds the two to each other.
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=88),
        add_help=False,
        allow_abbrev=False,
        description=(
            "Run this cell in a worker process that holds a share of the machine. "
            "The cell waits its turn in a queue shared by every claim on the machine, "
            "then runs with OMP_NUM_THREADS and friends set to its cores and "
            "CUDA_VISIBLE_DEVICES set to its cards. Variables it reads come in; "
            "variables it binds, or changes in place through a call, come back."
        ),
        epilog=(
            "Example: %%claim cpus=2 gpus=1 ram=8G OMP_NUM_THREADS=1 --label fit. "
            "Sizes read as pydantic reads them: 8G is 8*10^9 bytes, 8GiB is 8*2^30."
        ),
    )
    parser.add_argument(
        "spec",
        nargs="*",
        metavar="NAME=VALUE",
        help=(
            "cpus=N (default 1), gpus=N (default 0; 0.5 is a slice of one card), "
            "ram=SIZE, gpu_ram=SIZE (a card's memory budget; alone, a slice of one card "
            "with that much memory), flavor=NAME; an UPPER_CASE=value pair is set in "
            "the worker's environment"
        ),
    )
    # Values are read after parsing, not by argparse's `type=`, whose refusals
    # come out as "argument --timeout: invalid float value" with no way to fix it.
    parser.add_argument(
        "--in",
        action=_Once,
        dest="inputs",
        metavar="a,b",
        help="ship exactly these names in",
    )
    parser.add_argument(
        "--out",
        action=_Once,
        dest="outputs",
        metavar="c,d",
        help="bring exactly these names back",
    )
    parser.add_argument(
        "--timeout",
        action=_Once,
        metavar="S",
        help="end the cell after S seconds, waiting included; no longer than the "
        "machine admin's max_hours, where one is set",
    )
    _flag(
        parser,
        "--background",
        help="return at once with a job handle; the cell's output stays in this cell",
    )
    parser.add_argument("--label", action=_Once, metavar="TEXT", help="the name shown in the queue")
    parser.add_argument(
        "--on",
        action=_Once,
        metavar="TARGET",
        help=(
            "run the cell as a task on a Ray cluster instead: 'ray' (the cluster this "
            "kernel is connected to, RAY_ADDRESS, your own `ray start`, or a new Ray of "
            "the kernel's own) or an address such as ray://host:10001"
        ),
    )
    _flag(
        parser,
        "--strict",
        help="refuse a claim larger than the machine instead of shrinking it",
    )
    return parser


_PARSER = claim_parser()


@functools.lru_cache(maxsize=256)
def parse_claim_line(line: str) -> ClaimLine:
    """Turn ``cpus=2 ram=8G OMP_NUM_THREADS=1 --label fit`` into a :class:`ClaimLine`."""
    # Cached: a notebook runs the same few lines again and again, the result
    # is frozen, and argparse plus validation were a tenth of a millisecond of
    # a warm trivial cell. A line that fails raises again every time.
    try:
        words = shlex.split(line)
    except ValueError as error:
        raise BadClaim(f"%%claim: {error} in {line!r}; close the quote.") from None
    # Pairs after an option as well as before it: `--label fit ram=8G` is as clear.
    options = _PARSER.parse_intermixed_args(words)

    fields: dict[str, object] = {}
    env: dict[str, str] = {}
    for pair in options.spec:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise BadClaim(
                f"%%claim: {pair!r} is not NAME=VALUE; write for example cpus=2 or ram=8G."
            )
        if name in LINE_KEYS:
            if name in fields:
                raise BadClaim(f"%%claim: {name} is given twice; keep one.")
            fields[name] = value
        elif ENV_NAME.match(name):
            if name in env:
                raise BadClaim(f"%%claim: {name} is given twice; keep one.")
            env[name] = value
        else:
            raise BadClaim(
                f"%%claim: {unknown_keys_message([name], LINE_KEYS)}, "
                "or an UPPER_CASE=value environment variable."
            )

    timeout = options.timeout
    if timeout is not None:
        try:
            timeout = seconds(timeout, "--timeout")
        except ValueError as error:
            raise BadClaim(f"%%claim: {error}.") from None
    label = _not_empty(
        "--label",
        options.label,
        "give the name to show in the queue, such as --label fit, or drop --label to be "
        "named as the notebook numbers the cell, In[n]",
    )
    on = _not_empty(
        "--on",
        options.on,
        "write --on ray, or a Ray address such as ray://host:10001, or drop --on to run "
        "the cell on this machine",
    )
    inputs = _names("--in", options.inputs, "ship in", "ship in every name the cell reads")
    outputs = _names("--out", options.outputs, "bring back", "bring back every name the cell binds")
    try:
        resources = ask(**fields, env=env, timeout=timeout, label=label, strict=options.strict)
    except BadClaim as error:
        # Said as the line's other refusals are, and as the magic shows them.
        raise BadClaim(f"%%claim: {error}") from None
    return ClaimLine(
        resources=resources,
        inputs=inputs,
        outputs=outputs,
        background=options.background,
        on=on,
    )
