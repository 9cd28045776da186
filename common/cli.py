"""The `medfed` command: one entry point, subcommands plugged in by entry point.

Each package registers its subcommands under the ``medfed.commands`` entry-point
group (see pyproject.toml), so `common` never imports `coordinator` or `site_agent`.
A registered callable receives the argparse sub-parsers object and adds its parser;
each parser sets ``func`` to a callable taking the parsed namespace and returning an
exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from common.errors import MedfedError

COMMAND_GROUP = "medfed.commands"


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; when `argv` starts with a command's name, only that command's
    plug-in is loaded: a coordinator or site agent then starts without importing the
    others' dependencies (torch for `predict` and `privacy audit`: seconds of start-up
    and ~300 MiB of RSS per process)."""
    parser = argparse.ArgumentParser(
        prog="medfed",
        description="Federated learning for hospitals with secure aggregation and DP.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plugins = sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name)
    wanted = [ep for ep in plugins if argv and ep.name == argv[0]]
    for ep in wanted or plugins:
        register = ep.load()
        register(sub)
    return parser


def run_parsed(args: argparse.Namespace) -> int:
    """Run a parsed command: expected failures (bad config, bad data, exhausted budget...)
    get one clear line on stderr and exit code 2, never a traceback."""
    try:
        code: int = args.func(args)
    except MedfedError as exc:
        print(f"medfed: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


def main_with(
    registrars: Sequence[Callable[[Any], None]], argv: Sequence[str] | None = None
) -> int:
    """A `medfed` with only the given plug-ins (``python -m common.pki_cli`` and friends)."""
    parser = argparse.ArgumentParser(prog="medfed")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in registrars:
        register(sub)
    return run_parsed(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return run_parsed(build_parser(args).parse_args(args))


if __name__ == "__main__":
    sys.exit(main())
