"""`medfed bench query-coverage`: how often a federated query's stated intervals cover
the pooled cohort's exact answer, over repeated noise draws.

Three hospitals' CSV files (a follow-up cohort: age, sex, lactate with missing values,
follow-up days, ward, died) are written and read back through the site's own loader
(`site_agent.data.load_study_table`); each site's exact vector is the product's
(`common.releases.analytics.vector.site_vector`). Every draw adds each site's share of the
distributed discrete Gaussian noise exactly as a site does (`NoisePlan.noise` from the
OS CSPRNG, `common.crypto.random.system_random`) and answers with the product's
`answer_query`; an estimate is covered when its interval holds the value the same
answer takes on the noiseless pooled sum (which equals the central computation on the
pooled rows: tests/analytics/test_central.py). Prints, per statistic and quantity, the
coverage and the median interval width; no network, no ledger (the protocol path is
timed by `medfed bench query` and tested end to end by tests/e2e/test_query_federation.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.analytics_cohort import every_kind_query_toml, followup_study, write_followup_csv
from common.commands.cli import main_with
from common.core.errors import ConfigError
from common.core.parsing import parse_toml
from common.crypto.random import system_random
from common.releases.analytics.answer import answer_query
from common.releases.analytics.query import Query, check_query_against_study, query_from_mapping
from common.releases.analytics.vector import noise_sigmas, query_blocks, query_length, site_vector
from site_agent.data import load_study_table

SITES = ("north", "south", "east")


def run(*, draws: int, patients: int, epsilon: float, seed: int, root: Path) -> dict[str, Any]:
    study = followup_study("coverage")
    query: Query = query_from_mapping(
        parse_toml(every_kind_query_toml(study, epsilon=epsilon, name="coverage",
                                            grid=(0, 30, 60, 90, 180))),
        source="bench")
    check_query_against_study(query, study, source="bench")
    rng = np.random.default_rng(seed)
    exact_total = np.zeros(query_length(query, study=study), dtype=np.int64)
    for i, site in enumerate(SITES):
        path = root / f"{site}.csv"
        write_followup_csv(path, rng, patients=patients, prefix=f"{site[0].upper()}",
                   hazard=1 / (120.0 + 60 * i))
        vector = site_vector(query, load_study_table(path, study), study=study)
        exact_total += vector
    contributors = len(SITES)
    n_noise = max(contributors - study.privacy.max_colluding_sites, 1)
    blocks = query_blocks(query, study=study, n_noise=n_noise)
    sigmas = noise_sigmas(blocks, contributors=contributors)
    exact = answer_query(query, exact_total, study=study,
                         noise_sigmas=[0.0] * len(blocks), contributors=contributors)
    truth = {(s.name, e.cell, e.quantity): e.value for s in exact.statistics
             for e in s.estimates}
    hits: dict[tuple[str, str], list[bool]] = defaultdict(list)
    widths: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _ in range(draws):
        noise = np.concatenate([
            sum(block.plan().noise(system_random) for _ in range(contributors))
            for block in blocks])
        answer = answer_query(query, exact_total + noise, study=study, noise_sigmas=sigmas,
                              contributors=contributors)
        for s in answer.statistics:
            for e in s.estimates:
                value = truth[(s.name, e.cell, e.quantity)]
                hits[(s.name, e.quantity)].append(e.low - 1e-9 <= value <= e.high + 1e-9)
                widths[(s.name, e.quantity)].append(e.high - e.low)
    rows = [
        {"statistic": name, "quantity": quantity, "estimates": len(hits[(name, quantity)]),
         "coverage": sum(hits[(name, quantity)]) / len(hits[(name, quantity)]),
         "median_width": statistics.median(widths[(name, quantity)])}
        for name, quantity in sorted(hits)
    ]
    every = [h for values in hits.values() for h in values]
    return {"draws": draws, "sites": contributors, "patients_per_site": patients,
            "epsilon_per_statistic": epsilon, "noise_sigmas": [float(s) for s in sigmas],
            "nominal": 0.95, "overall_coverage": sum(every) / len(every), "rows": rows}


def main_from_args(args: argparse.Namespace) -> int:
    if args.draws < 1:
        raise ConfigError("--draws", "must be at least 1")
    if args.patients < 10:
        raise ConfigError("--patients", "must be at least 10 per site")
    if not 0 < args.epsilon <= 100:
        raise ConfigError("--epsilon", "must be in (0, 100]")
    with tempfile.TemporaryDirectory(prefix="medfed-bench-coverage-") as tmp:
        result = run(draws=args.draws, patients=args.patients, epsilon=args.epsilon,
                     seed=args.seed, root=Path(tmp))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['draws']} noise draws, {result['sites']} sites x "
          f"{result['patients_per_site']} patients, epsilon {result['epsilon_per_statistic']:g} "
          f"per statistic, nominal 95% intervals")
    print(f"{'statistic':<12}{'quantity':<12}{'estimates':>10}{'coverage':>10}"
          f"{'median width':>14}")
    for row in result["rows"]:
        print(f"{row['statistic']:<12}{row['quantity']:<12}{row['estimates']:>10}"
              f"{row['coverage']:>10.3f}{row['median_width']:>14.4g}")
    print(f"overall coverage: {result['overall_coverage']:.3f}")
    return 0


def register(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "query-coverage", help="how often a query's 95%% intervals cover the pooled exact "
        "answer, over noise draws (3 sites' CSVs, the product's noise and answers)")
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--patients", type=int, default=400, help="patients per site")
    parser.add_argument("--epsilon", type=float, default=0.5, help="epsilon per statistic")
    parser.add_argument("--seed", type=int, default=1, help="seed of the synthetic cohort")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    return main_with([lambda sub: register(sub.add_parser("bench").add_subparsers())],
                     ["bench", "query-coverage", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
