"""``fluksio-nb``: the machine's books in a terminal, and the flavors.

For the person at a shell on a shared box who wants to know, before starting
a notebook, how much of the machine is free and which sizes they may ask for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fluksio_nb.errors import BadClaim
from fluksio_nb.flavors import describe_flavors

#: The claims that ended lately, as many as a terminal shows beside the machine.
CLI_FINISHED = 5


#: Every command, with the line ``fluksio-nb --help`` gives it.
COMMANDS = {
    "snapshot": "the machine now: its cores, cards and memory, who holds them, who waits "
    "(the default)",
    "flavors": "the named sizes a claim may ask for (`%%claim flavor=NAME`)",
    "usage": "what past claims used, per user and notebook (`fluksio-nb usage -h`)",
    "machine": "books every user of the machine shares: init, status, remove "
    "(`fluksio-nb machine -h`)",
}


def command_parser() -> argparse.ArgumentParser:
    """``fluksio-nb``'s own parser: every command named, with a line each."""
    parser = argparse.ArgumentParser(
        prog="fluksio-nb",
        description="This machine's shares in a terminal, and the books behind them.",
    )
    commands = parser.add_subparsers(dest="what", title="commands", metavar="command")
    for name, line in COMMANDS.items():
        # Help lines are %-formatted by argparse; descriptions are not.
        described = line[0].upper() + line[1:] + "."
        commands.add_parser(name, help=line.replace("%", "%%"), description=described)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # These two parse their own options: handed the rest of the line as it is.
    if argv[:1] == ["usage"]:
        from fluksio_nb.usage.report import usage_main

        return usage_main(argv[1:])
    if argv[:1] == ["machine"]:
        return machine_main(argv[1:])
    options = command_parser().parse_args(argv)
    from fluksio_nb.overview import describe_snapshot, read_books
    from fluksio_nb.settings import load_settings

    try:
        settings = load_settings()
        if options.what == "flavors":
            print(describe_flavors(settings))
        else:
            from fluksio_nb.usage.recent import process_recent_usage

            # A terminal makes no claims: it reads the machine's books as they are.
            finished = process_recent_usage().finished(limit=CLI_FINISHED)["claims"]
            print(describe_snapshot(read_books(), finished))
    except BadClaim as error:
        print(f"fluksio-nb: {error}", file=sys.stderr)
        return 2
    return 0


def machine_main(argv: list[str]) -> int:
    """``fluksio-nb machine init|status|remove|serve``."""
    from fluksio_nb.kernel import books_in_force
    from fluksio_nb.machine.setup import Layout, init, remove, rules_said, serve, why_silent

    parser = argparse.ArgumentParser(
        prog="fluksio-nb machine",
        description="Books every user of this machine shares: set up, see, take down.",
    )
    parser.add_argument("action", choices=["init", "status", "remove", "serve"])
    parser.add_argument("--prefix", default="/", help="where the books live (default /)")
    parser.add_argument("--group", help="init: only this group's members may use the books")
    parser.add_argument("--admin-group", help="init: this group's members may cancel any claim")
    parser.add_argument("--cpus", type=int, help="init: declare the cores instead of detecting")
    parser.add_argument("--gpus", type=int, help="init: declare N cards instead of detecting")
    parser.add_argument("--ram", help="init: declare the memory claims may take, e.g. 64G")
    parser.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="init: serve metrics for Prometheus there, e.g. 127.0.0.1:9464",
    )
    # How a kernel starts its user's own books service; not for people to type.
    parser.add_argument("--books", help=argparse.SUPPRESS)
    parser.add_argument("--linger", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--described", help=argparse.SUPPRESS)
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    layout = Layout(options.prefix)
    try:
        if options.action == "init":
            declared = {
                key: getattr(options, key)
                for key in ("cpus", "gpus", "ram")
                if getattr(options, key) is not None
            }
            print(
                init(
                    layout,
                    group=options.group,
                    admin_group=options.admin_group,
                    inventory=declared,
                    metrics=options.metrics,
                )
            )
        elif options.action == "remove":
            print(remove(layout))
        elif options.action == "serve" and options.books:
            from fluksio_nb.machine.user_service import serve as serve_user

            serve_user(
                Path(options.books),
                json.loads(options.described),
                options.linger,
                options.ready_fd,
            )
        elif options.action == "serve":
            from fluksio_nb.usage.read import kernel_deaths

            serve(layout, read_deaths=kernel_deaths)
        else:
            # Which books this user's kernels use, and why.
            books = books_in_force(layout)
            print(books.describe())
            if books.mode == "machine":
                for rule in rules_said(layout):
                    print(rule)
            from fluksio_nb.card_compute import NAME, compute_sharing

            # Whichever books: how this machine's cards share their compute between slices.
            sharing = compute_sharing()
            print(f"{NAME}: {sharing['label']} ({sharing['why']})")
            if books.mode == "user":
                from fluksio_nb.machine.user_service import running

                print(running(books.socket))
            down = None if books.mode != "machine" else why_silent(books.socket)
            if down is not None:
                print(
                    f"but the books service does not answer at {books.socket} ({down}): every "
                    "claim fails until the machine's admin restarts it with "
                    "`sudo fluksio-nb machine init`"
                )
                return 1
    except BadClaim as error:
        print(f"fluksio-nb machine {options.action}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
