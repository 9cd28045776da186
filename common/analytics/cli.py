"""``medfed query``: draft a query against a study, and check one on a site's own file.

``query init`` reads the study only; ``query check`` reads the site's file and prints
what the query would release and cost, releasing nothing. Registered through the
``medfed.commands`` entry point (``query``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.analytics.check import check_query
from common.analytics.query import draft_query, load_query
from common.errors import ConfigError
from common.study import load_study


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

    check = actions.add_parser(
        "check", help="run a query offline on this site's file: cohort size, what would be "
        "released, the epsilon it costs (releases nothing)")
    check.add_argument("--study", required=True, type=Path)
    check.add_argument("--query", required=True, type=Path)
    check.add_argument("--data", required=True, type=Path, help="this site's CSV or Parquet")
    check.add_argument("--json", action="store_true", help="one JSON object")
    check.set_defaults(func=_check)

    # `medfed query run` (the operator asks the coordinator to run an approved query as
    # a round of its own) is added here, after `check`, as one more `actions` parser.


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


def _check(args: argparse.Namespace) -> int:
    from site_agent.data import load_study_table

    study = load_study(args.study)
    query = load_query(args.query, study=study)
    table = load_study_table(args.data, study)
    report = check_query(query, table, study=study, policy_or_none=None)
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
    else:
        print(report.render())
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m common.analytics.cli query ...``."""
    from common.cli import main_with

    return main_with([register], argv)


if __name__ == "__main__":
    sys.exit(main())
