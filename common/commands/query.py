"""``medfed query``: draft a query against a study, and check one on a site's own file.

``query init`` reads the study only; ``query check`` reads the site's file and prints
what the query would release and cost, releasing nothing. Registered through the
``medfed.commands`` entry point (``query``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from common.commands.cli import main_with
from common.core.errors import ConfigError
from common.releases.analytics.query import draft_query
from common.study import load_study

QUERY_COMMAND_GROUP = "medfed.query_commands"


def register(subparsers: Any) -> None:
    """Add ``medfed query {init,check}``."""
    parser = subparsers.add_parser(
        "query",
        help="draft, check and run DP queries of the pooled cohort (counts, rates, means, "
        "histograms, survival curves)",
        description="A query asks the federation a question about its pooled cohort; every "
        "site checks and approves it, and each statistic costs its epsilon on every "
        "participating site's ledger (docs/analytics.md).",
    )
    actions = parser.add_subparsers(dest="query_command", metavar="ACTION", required=True)

    init = actions.add_parser("init", help="draft query.toml against a study")
    init.add_argument("--study", required=True, type=Path, help="the study file")
    init.add_argument("--name", required=True, help="the query's name")
    init.add_argument("--out", type=Path, help="query file to write (new); default: stdout")
    init.add_argument("--epsilon", type=float, default=1.0,
                      help="total epsilon, split evenly over the drafted statistics")
    init.set_defaults(func=_init)

    # `medfed query check` (a site's own file) and `medfed query run` (the operator asks
    # the coordinator to run an approved query as a round of its own) live with the site
    # agent and the coordinator: plug-ins of this group, absent from an image without
    # their package.
    for plugin in sorted(entry_points(group=QUERY_COMMAND_GROUP), key=lambda e: e.name):
        try:
            plugin.load()(actions)
        except ModuleNotFoundError as exc:
            if exc.name != plugin.value.split(":", 1)[0].split(".", 1)[0]:
                raise


def _init(args: argparse.Namespace) -> int:
    study = load_study(args.study)
    text = draft_query(study, name=args.name, epsilon=args.epsilon)
    out: Path | None = args.out
    if out is None:
        sys.stdout.write(text)
        return 0
    try:
        with out.open("x", encoding="utf-8") as handle:  # "x": never overwrite
            handle.write(text)
    except FileExistsError:
        raise ConfigError("out", f"{out} already exists; not overwriting it") from None
    except OSError as exc:
        raise ConfigError("out", f"cannot write {out}: {exc.strerror}") from None
    print(f"wrote {out}: query {args.name!r} against study {study.study.name!r}; edit it, "
          f"then `medfed query check --study {args.study} --query {out} --data FILE`")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m common.commands.query query ...``."""
    return main_with([register], argv)


if __name__ == "__main__":
    sys.exit(main())
