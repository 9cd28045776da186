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
from collections.abc import Sequence
from importlib.metadata import entry_points

from common.errors import MedfedError

COMMAND_GROUP = "medfed.commands"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="medfed",
        description="Federated learning for hospitals with secure aggregation and DP.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        register = ep.load()
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except MedfedError as exc:
        # Expected failures (bad config, bad data, exhausted budget...) get one clear
        # line on stderr and a non-zero exit, never a traceback.
        print(f"medfed: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
