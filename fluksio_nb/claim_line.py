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
from typing import NoReturn

from fluksio_nb.errors import BadClaim
from fluksio_nb.resources import ENV_NAME, LINE_KEYS, Resources, ask, unknown_keys_message


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


def _names(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if not name.isidentifier():
            raise argparse.ArgumentTypeError(f"{name!r} is not a Python name")
    return names


def claim_parser() -> argparse.ArgumentParser:
    """The one definition of what a ``%%claim`` line may say."""
    parser = _Parser(
        prog="%%claim",
        # A fixed width, not the terminal's: the README quotes this text and a
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
            "cpus=N (default 1), gpus=N (default 0), ram=SIZE, gpu_ram=SIZE (a "
            "card's memory budget), flavor=NAME; an UPPER_CASE=value pair is set in "
            "the worker's environment"
        ),
    )
    parser.add_argument(
        "--in",
        dest="inputs",
        type=_names,
        metavar="a,b",
        help="ship exactly these names in",
    )
    parser.add_argument(
        "--out",
        dest="outputs",
        type=_names,
        metavar="c,d",
        help="bring exactly these names back",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="end the cell after S seconds, waiting included",
    )
    parser.add_argument(
        "--background",
        action="store_true",
        help="return at once with a job handle; the cell's output stays in this cell",
    )
    parser.add_argument("--label", metavar="TEXT", help="the name shown in the queue")
    parser.add_argument(
        "--on",
        metavar="TARGET",
        help=(
            "run the cell as a task on a Ray cluster instead: 'ray' (the cluster this "
            "kernel is connected to, or ray.init()'s choice) or an address such as "
            "ray://host:10001"
        ),
    )
    parser.add_argument(
        "--strict",
        action="store_true",
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

    resources = ask(
        **fields,
        env=env,
        timeout=options.timeout,
        label=options.label,
        strict=options.strict,
    )
    return ClaimLine(
        resources=resources,
        inputs=options.inputs,
        outputs=options.outputs,
        background=options.background,
        on=options.on,
    )
