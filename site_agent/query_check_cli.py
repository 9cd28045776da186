"""`medfed query check`: run a query offline on this site's own file (cohort size, what
would be released, the epsilon it costs); nothing is released. A plug-in of
``medfed.query_commands`` (common.commands.query): it reads the site's file with the site
agent's loader, which `common` may not import.

With ``--config SITE.toml`` the query is also held to the site's own policy (its
per-round cap, budget and delta, as `site run` holds it when the query runs): the
command exits 1 when that policy, or the study's own cap, refuses it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from common.core.config import SiteSettings, load_settings
from common.core.errors import ConfigError
from common.releases.analytics.check import check_query
from common.releases.analytics.query import load_query
from common.study import SitePrivacyPolicy, load_study
from site_agent.data import load_study_table
from site_agent.datacheck import site_policy


def register_check(actions: Any) -> None:
    check = actions.add_parser(
        "check", help="run a query offline on this site's file: cohort size, what would be "
        "released, the epsilon it costs (releases nothing)")
    check.add_argument("--study", required=True, type=Path)
    check.add_argument("--query", required=True, type=Path)
    check.add_argument("--data", type=Path,
                       help="this site's CSV or Parquet (default: the config's data.path)")
    check.add_argument("--config", type=Path,
                       help="the site's TOML settings: hold the query to its policy "
                       "(policy.max_epsilon_per_round, privacy.budget_epsilon and delta); "
                       "exit 1 when it refuses the query")
    check.add_argument("--json", action="store_true", help="one JSON object")
    check.set_defaults(func=_check)


def _site(config: Path | None) -> tuple[SitePrivacyPolicy | None, str, Path | None]:
    """The site's policy, its ledger's accountant and its data file, from `config`."""
    if config is None:
        return None, "prv", None
    settings = load_settings(SiteSettings, config_file=config, overrides={})
    return site_policy(settings), settings.privacy.accountant, settings.data.path


def _check(args: argparse.Namespace) -> int:
    policy, accountant, configured = _site(args.config)
    data: Path | None = args.data if args.data is not None else configured
    if data is None:
        raise ConfigError("--data", "name this site's file (or give --config with data.path)")
    study = load_study(args.study)
    query = load_query(args.query, study=study)
    table = load_study_table(data, study)
    report = check_query(query, table, study=study, policy_or_none=policy,
                         accountant=accountant)
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True))
    else:
        print(report.render())
        if policy is None:
            print("  (held to the study's own limits only: give --config SITE.toml to hold "
                  "it to this site's policy as well)")
    return 0 if report.ok else 1
