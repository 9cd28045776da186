"""The `medfed` command: one entry point, subcommands plugged in by entry point.

Each package registers its subcommands under the ``medfed.commands`` entry-point
group (see pyproject.toml), so `common` never imports `coordinator` or `site_agent`.
A registered callable receives the argparse sub-parsers object and adds its parser;
each parser sets ``func`` to a callable taking the parsed namespace and returning an
exit code.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from common.core.errors import ConfigError, MedfedError
from common.core.logs import quiet_grpc_core
from common.core.text import printable

COMMAND_GROUP = "medfed.commands"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `medfed` parser. With `command` (the subcommand the user typed), only that
    plug-in is loaded: a coordinator or site process must not import what other commands
    need (torch for `predict` and `bench` costs a service ~300 MB of RSS and seconds of
    start-up). Without it (help, a typo), every command is listed."""
    parser = argparse.ArgumentParser(
        prog="medfed",
        description="Federated learning for hospitals with secure aggregation and DP.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    plugins = sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name)
    chosen = [ep for ep in plugins if ep.name == command]
    for ep in chosen or plugins:
        try:
            register = ep.load()
        except ModuleNotFoundError as exc:
            # A role image ships only its own packages (the site image has no
            # coordinator/ or bench/): their commands are absent, not broken.
            package = ep.value.split(":", 1)[0].split(".", 1)[0]
            if exc.name != package:
                raise
            if chosen:
                raise ConfigError(
                    "command", f"'{ep.name}' is not installed here (no {package} package)"
                ) from exc
            continue
        register(sub)
    return parser


def _command_word(argv: Sequence[str]) -> str | None:
    """The first argument that is not an option: the subcommand, if any."""
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def run_parsed(args: argparse.Namespace) -> int:
    """Run a parsed command: expected failures (bad config, bad data, exhausted budget...)
    get one clear line on stderr and exit code 2, never a traceback."""
    try:
        code: int = args.func(args)
    except MedfedError as exc:
        print("medfed: error: " + printable(str(exc), keep="\n"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `medfed status | head`: the reader left; no traceback, and none again when
        # Python flushes stdout at exit (the recipe of the `signal` module's docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:
        # A file system fault no command turned into a MedfedError (disk full, a
        # read-only or vanished folder): the path to fix, one error record.
        where = f": {exc.filename}" if exc.filename else ""
        message = f"{exc.strerror or exc}{where}"
        logging.getLogger("medfed").error("%s", message, extra={"event": "os_error"})
        print(f"medfed: error: {message}", file=sys.stderr)
        return 1
    except Exception as exc:  # the last resort: one error record, never a raw traceback
        logging.getLogger("medfed").error("unexpected %s: %s", type(exc).__name__, exc,
                                          exc_info=True, extra={"event": "unexpected_error"})
        print(f"medfed: error: unexpected {type(exc).__name__}: {exc} (a bug: please report "
              "it with the log)", file=sys.stderr)
        return 1
    return code


def main_with(
    registrars: Sequence[Callable[[Any], None]], argv: Sequence[str] | None = None
) -> int:
    """A `medfed` with only the given plug-ins (``python -m common.commands.pki`` and friends)."""
    parser = argparse.ArgumentParser(prog="medfed")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in registrars:
        register(sub)
    return run_parsed(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    quiet_grpc_core()  # before any plug-in imports grpc
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(_command_word(words))
    except MedfedError as exc:
        print("medfed: error: " + printable(str(exc), keep="\n"), file=sys.stderr)
        return 2
    return run_parsed(parser.parse_args(words))


if __name__ == "__main__":
    sys.exit(main())
