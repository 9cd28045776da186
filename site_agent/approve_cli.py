"""`medfed site approve FILE`: a hospital approves a study or a query, as one command.

It prints what FILE is, asks for confirmation (unless --yes) and pins its SHA-256
under the site's state folder (`site_agent.approvals`). A study is then the only one
the site joins (as `site run --study FILE`); a query is released only with its exact
bytes, for the site's study, at most --times times (default once).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from common.core.config import SiteSettings, load_settings
from common.core.errors import ConfigError, QueryRefused, ValidationError
from common.core.parsing import parse_toml
from common.releases.analytics.cost import QueryCost, query_cost
from common.releases.analytics.query import Query
from common.releases.analytics.statistic import kind_of
from common.study import Study, load_study, study_sha256
from site_agent.approvals import Approvals

_HEX64 = re.compile(r"[0-9a-f]{64}")


def register(sub: Any) -> None:
    approve = sub.add_parser(
        "approve",
        help="approve a study or a query for this site (shows it, asks, pins its SHA-256)",
        description="Pins FILE's SHA-256 under the site's state folder: a study is then "
        "the only one this site joins; a query is answered only in that exact form, for "
        "this site's study, at most --times times.",
    )
    approve.add_argument("files", type=Path, nargs="+", metavar="FILE",
                         help="study.toml or query.toml (a study first, then its queries)")
    where = approve.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", type=Path, help="the site's TOML settings (for its state)")
    where.add_argument("--state", type=Path, help="the site's state folder")
    approve.add_argument("--study", type=Path,
                         help="for a query: the site's study (default: its approved study, "
                         "or the config's study_file)")
    approve.add_argument("--times", type=int, default=1,
                         help="for a query: how many times it may run (default 1)")
    approve.add_argument(
        "--sha256", dest="expect_sha256", metavar="HEX",
        help="for a study: pin it only if its SHA-256 is HEX, the value the hospital's "
        "privacy officer read and approved (default: the config's study_sha256, if set)")
    approve.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    approve.set_defaults(func=_approve)


def file_kind(path: Path) -> str:
    """"study" or "query", by the TOML's top-level keys."""
    try:
        raw = parse_toml(path.read_bytes())
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from None
    except ValidationError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None
    if isinstance(raw.get("study"), dict):
        return "study"
    if "study_sha256" in raw and "statistics" in raw:
        return "query"
    raise ConfigError(str(path), "neither a study (a [study] table) nor a query (name, "
                      "study_sha256 and [[statistics]])")


def _refused_by_policy(study: Study, config: Path | None) -> str | None:
    """Why this site's policy (its config) refuses `study`, or None: a study the site
    would refuse at enrolment is not pinned."""
    if config is None:
        return None
    from common.core.errors import PrivacyError
    from common.study import check_study_against_policy
    from site_agent.datacheck import site_policy

    settings = load_settings(SiteSettings, config_file=config, overrides={})
    try:
        check_study_against_policy(study, site_policy(settings))
    except PrivacyError as exc:
        return str(exc)
    return None


def _state_and_study(args: argparse.Namespace) -> tuple[Path, Study | None, str | None]:
    """(state folder, the site's study, the study SHA-256 a study file must have)."""
    expected = args.expect_sha256
    if expected is not None and _HEX64.fullmatch(expected) is None:
        raise ConfigError("--sha256", f"expected the study's SHA-256 as 64 lower-case hex "
                          f"digits (as `medfed site approve` prints it), got {expected!r}")
    if args.config is not None:
        settings = load_settings(SiteSettings, config_file=args.config, overrides={})
        state = settings.state
        own = load_study(settings.study_file) if settings.study_file is not None else None
        if expected is None:
            expected = settings.study_sha256
        elif settings.study_sha256 is not None and settings.study_sha256 != expected:
            raise ConfigError("--sha256", f"is {expected}, but the config {args.config} "
                              f"names study_sha256 {settings.study_sha256}: the site would "
                              "refuse to start on the pin")
    else:
        state, own = args.state, None
    if args.study is not None:
        own = load_study(args.study)
    return state, own if own is not None else Approvals(state).study(), expected


def describe_study(study: Study, out: TextIO) -> None:
    p = study.privacy
    print(f"study         {study.study.name} (sha256 {study_sha256(study)})", file=out)
    model = study.model.custom or study.model.name or "default for " + study.data.kind
    print(f"model         {model}; every served weight within +/-"
          f"{study.model.max_abs_weight:g}", file=out)
    print(f"rounds        {study.evaluations_planned_text()}", file=out)
    cap = study.privacy.max_epsilon_per_round
    print(f"privacy       {p.unit}-level DP, epsilon {p.epsilon:g} at delta {p.delta:g}; "
          f"statistics epsilon {p.statistics_epsilon:g}; per-round cap "
          f"{'none' if cap is None else format(cap, 'g')}; evaluation noise std "
          f"{p.evaluation.noise_std:g} per summed count; at most {p.max_colluding_sites} "
          f"colluding sites, rounds of at least {p.min_round_sites} sites", file=out)
    print(f"features      {', '.join(f.name for f in study.features)}", file=out)
    describe_members(study, out)


def describe_members(study: Study, out: TextIO) -> None:
    """The hospitals a round may hold, each with the public-key SHA-256 its officer read
    out (`medfed pki request`): compare them before approving."""
    if not study.members:
        print("members       NONE LISTED: any site certificate the federation CA signs "
              "could be in a round (a CA holder could run sybil sites); a site refuses "
              "such a study at enrolment unless it pins its own policy.members or sets "
              "policy.allow_open_membership = true", file=out)
        return
    print(f"members       {len(study.members)} hospitals; every round holds only these, "
          "each under this key (public-key SHA-256):", file=out)
    for member in study.members:
        print(f"  - {member.name:<24} {member.fingerprint}", file=out)


def query_cost_for_site(query: Query, study: Study, config: Path | None) -> QueryCost:
    """The query's cost against this site's limits (`common.releases.analytics.cost.query_cost`):
    with `config`, its policy and its ledger's accountant; without, the study's own."""
    if config is None:
        return query_cost(query, study=study, policy=None)
    from site_agent.datacheck import site_policy

    settings = load_settings(SiteSettings, config_file=config, overrides={})
    return query_cost(query, study=study, policy=site_policy(settings),
                      accountant=settings.privacy.accountant)


def describe_query(query: Query, sha256: str, study: Study, out: TextIO,
                   cost: QueryCost | None = None) -> None:
    """What a privacy officer approves: the study, the cohort, each statistic with its
    epsilon and the cells it releases, and what one run charges the site's ledger
    (`cost`: `common.releases.analytics.cost.QueryCost`, default the study's own terms);
    each statistic as its kind describes it (`StatisticKind.describe`)."""
    print(f"query         {query.name} (sha256 {sha256})", file=out)
    if query.description:
        print(f"              {query.description}", file=out)
    print(f"for study     {study.study.name} (sha256 {query.study_sha256})", file=out)
    if not query.cohort:
        print("cohort        every patient", file=out)
    for condition in query.cohort:
        terms = condition.model_dump(exclude_none=True, exclude={"feature"})
        print(f"cohort        {condition.feature}: "
              + ", ".join(f"{k} {v}" for k, v in sorted(terms.items())), file=out)
    cost = query_cost(query, study=study, policy=None) if cost is None else cost
    print(f"epsilon       {cost.epsilon_composed:.4g} charged to the ledger of every site "
          f"that answers, each time it runs (its statistics composed as the ledger composes "
          f"them, at delta {cost.delta:g}; {query.epsilon:g} summed)", file=out)
    print(f"round cap     {cost.cap_text()}", file=out)
    for spec in query.statistics:
        print(f"  - {kind_of(spec).describe(spec, study)}", file=out)


def _confirm(args: argparse.Namespace, what: str) -> bool:
    if args.yes:
        return True
    print(f"Approve {what} for this site? [y/N] ", end="", flush=True)
    answer = sys.stdin.readline()
    if not answer:
        raise ConfigError("--yes", f"approving {what} needs a confirmation: answer y, or "
                          "pass --yes once you have read the summary")
    print()
    return answer.strip().lower() in ("y", "yes")


def _approve(args: argparse.Namespace) -> int:
    """Each FILE in order (a study approved here is the study of the queries after it)."""
    state, own, expected = _state_and_study(args)
    for path in args.files:
        code = _approve_one(args, path, state, own, expected)
        if code:
            return code
        own = Approvals(state).study() if args.study is None else own
    return 0


def _approve_one(args: argparse.Namespace, path: Path, state: Path, own: Study | None,
                 expected: str | None) -> int:
    approvals = Approvals(state)
    out = sys.stdout
    if file_kind(path) == "study":
        study = load_study(path)
        describe_study(study, out)
        if expected is not None and study_sha256(study) != expected:
            # Before any question: this file is not what the privacy officer approved.
            raise ConfigError(str(path), f"its SHA-256 is {study_sha256(study)}, not the "
                              f"approved {expected} (--sha256 / study_sha256): not pinned")
        refusal = _refused_by_policy(study, args.config)
        if refusal is not None:
            # The agent would refuse it at enrolment: nothing to approve.
            raise ConfigError(str(path), f"not pinned: {refusal}")
        if args.config is None:
            print("checked       the study's SHA-256 only: this site's policy (epsilon, "
                  "delta, unit, caps, round floor) is in its config (--config SITE.toml "
                  "checks it now; `site run` checks it at enrolment)", file=out)
        if own is not None and study_sha256(own) != study_sha256(study):
            print(f"NOTE: this replaces the approved study {own.study.name!r}", file=out)
        if not _confirm(args, f"study {study.study.name!r}"):
            print("not approved", file=out)
            return 1
        pinned = approvals.approve_study(study)
        print(json.dumps({"approved": "study", "sha256": study_sha256(study),
                          "pin": str(pinned)}), file=out)
        return 0
    from common.releases.analytics.query import load_query, query_sha256

    if own is None:
        raise ConfigError("--study", "a query belongs to a study: approve the study first "
                          "(`medfed site approve STUDY.toml`) or name it with --study")
    try:
        query = load_query(path, study=own)
    except ValidationError as exc:
        raise ConfigError(str(path), str(exc)) from None
    sha256 = query_sha256(query)
    cost = query_cost_for_site(query, own, args.config)
    describe_query(query, sha256, own, out, cost)
    if query.study_sha256 != study_sha256(own):
        raise ConfigError(str(path), f"the query is for study {query.study_sha256[:12]}..., "
                          f"not this site's study {own.study.name!r}")
    if args.config is None:
        print("checked       against the study's own limits only: this site's "
              "policy.max_epsilon_per_round and budget are in its config (--config "
              "SITE.toml checks them now; `site run` checks them before every run)", file=out)
    if not cost.ok:
        # A query the site would decline at its run is not pinned: nothing to approve.
        raise QueryRefused(f"{path}: query {query.name!r} not approved: "
                           + "; ".join(cost.problems))
    if not _confirm(args, f"query {query.name!r} ({args.times} run(s))"):
        print("not approved", file=out)
        return 1
    pinned = approvals.approve_query(name=query.name, sha256=sha256, study=own,
                                     times=args.times, now=dt.datetime.now(dt.UTC))
    print(json.dumps({"approved": "query", "name": query.name, "sha256": sha256,
                      "times": args.times, "pin": str(pinned)}), file=out)
    return 0
