"""`medfed query check`: run a query offline on this site's own file (cohort size, what
would be released, the epsilon it costs); nothing is released. A plug-in of
``medfed.query_commands`` (common.analytics.cli): it reads the site's file with the site
agent's loader, which `common` may not import."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from common.analytics.check import check_query
from common.analytics.query import load_query
from common.study import load_study


def register_check(actions: Any) -> None:
    check = actions.add_parser(
        "check", help="run a query offline on this site's file: cohort size, what would be "
        "released, the epsilon it costs (releases nothing)")
    check.add_argument("--study", required=True, type=Path)
    check.add_argument("--query", required=True, type=Path)
    check.add_argument("--data", required=True, type=Path, help="this site's CSV or Parquet")
    check.add_argument("--json", action="store_true", help="one JSON object")
    check.set_defaults(func=_check)


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
