"""`medfed bench query`: a query round against a training round, over the same sites.

Real processes over mutual TLS on 127.0.0.1: a temporary PKI, one coordinator running a
one-round study and three site agents (DP-SGD training, the real ledger), each having
approved the study and one query (`site_agent.approvals`). The query (a histogram of a
declared feature over `--cells` - 1 bins, plus the missing count: `--cells` entries)
is in the coordinator's inbox before the sites connect, so the coordinator runs it as a
release round of its own before the study's statistics round, then the training round.

What is timed: the coordinator's `round_seconds` of each round, from round open to its
record (for the query: decoded into the answer and written; for training: the model
step and checkpoint), and its CPU seconds, from its `round_completed` events. Both
rounds run on the same processes, one after the other. The query's answer is checked
to exist and to name every cell.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from common.commands.cli import main_with
from common.core.errors import ConfigError
from common.core.parsing import parse_json
from common.core.processes import ManagedProcess, medfed_argv
from common.protocol import pki
from common.releases.analytics.query import load_query, query_bytes, query_sha256
from common.releases.analytics.vector import query_length
from common.study import load_study, study_sha256
from coordinator import queries
from site_agent.approvals import Approvals

SITES = ("site-a", "site-b", "site-c")
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
STUDY = """\
[study]
name = "bench-query"
rounds = 1
classes = ["no", "yes"]

[data]
label_column = "outcome"
patient_column = "patient"

[[features]]
name = "age"
type = "numeric"
range = [18, 100]

[[features]]
name = "lactate"
type = "numeric"

[model]
name = "mlp"
hidden = [8]

[training]
final_evaluation = false

[privacy]
unit = "patient"
epsilon = 8.0
delta = 1e-5
"""


def query_toml(study_digest: str, cells: int) -> str:
    edges = np.linspace(18.0, 100.0, cells).round(6).tolist()
    return (f'name = "bench-histogram"\nstudy_sha256 = "{study_digest}"\n\n'
            '[[statistics]]\nname = "age"\nkind = "histogram"\nfeature = "age"\n'
            f"bins = {json.dumps(edges)}\nepsilon = 1.0\n")


def write_site(path: Path, *, patients: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    lines = ["patient,age,lactate,outcome"]
    for p in range(patients):
        age = float(rng.uniform(18, 100))
        lactate = float(rng.gamma(2.0, 1.0))
        risk = 1 / (1 + np.exp(-(0.04 * (age - 60) + 0.8 * (lactate - 2))))
        lines.append(f"{path.stem}-{p},{age:.1f},{lactate:.2f},"
                     f"{'yes' if rng.random() < risk else 'no'}")
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*, cells: int, patients: int, root: Path, timeout: float) -> dict[str, Any]:
    folder = root / "pki"
    pki.init_ca(folder)
    now = dt.datetime.now(dt.UTC)
    pki.issue_coordinator(folder, ["127.0.0.1", "localhost"], now=now)
    for site in SITES:
        pki.issue_site(folder, site, now=now)
    # The study lists its hospitals by public-key SHA-256 (`study init --member-from`):
    # a site joins no study without them.
    members = "".join(
        f'\n[[members]]\nname = "{site}"\nfingerprint = "'
        f'{pki.public_key_fingerprint(pki.load_certificate(pki.site_paths(folder, site)[0]))}"\n'
        for site in SITES)
    study_path = root / "study.toml"
    study_path.write_text(STUDY + members)
    study = load_study(study_path)
    query_path = root / "query.toml"
    query_path.write_text(query_toml(study_sha256(study), cells))
    query = load_query(query_path, study=study)
    length = query_length(query, study=study)
    files = {}
    for i, site in enumerate(SITES):
        files[site] = write_site(root / f"{site}.csv", patients=patients, seed=i + 1)
        approvals = Approvals(root / "sites" / site)
        approvals.approve_study(study)
        approvals.approve_query(name=query.name, sha256=query_sha256(query), study=study,
                                times=1, now=now)
    logs, state = root / "logs", root / "coordinator"
    started: list[ManagedProcess] = []
    try:
        coordinator = ManagedProcess("coordinator", medfed_argv(
            "coordinator", "serve", "--study", str(study_path), "--pki", str(folder),
            "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--state", str(state),
            "--min-sites", "3", "--selection-seconds", "1"), log_dir=logs, env=ENV)
        started.append(coordinator)
        port = int(coordinator.wait_event("listening", timeout=120)["port"])
        sha256 = queries.submit(state, query_bytes(query))
        for site in SITES:
            started.append(ManagedProcess(site, medfed_argv(
                "site", "run", "--pki", str(folder), "--site", site,
                "--coordinator", f"127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:0",
                "--state", str(root / "sites" / site), "--data", str(files[site]), "--once"),
                log_dir=logs, env=ENV))
        rounds = {}
        for kind in ("query", "training"):
            event = coordinator.wait_event("round_completed", timeout=timeout, kind=kind)
            rounds[kind] = {"round_seconds": event["round_seconds"],
                            "cpu_seconds": event["cpu_seconds"],
                            "survivors": event["survivors"]}
        answer = parse_json(queries.answer_path(state, sha256).read_bytes())
    finally:
        for proc in started:
            proc.stop()
    if len(answer["total"]) != length or len(answer["answer"]["statistics"][0]["estimates"]) \
            != length - 1:
        raise ConfigError("bench", "the query's answer does not name every cell")
    return {"cells": length, "sites": len(SITES), "patients_per_site": patients,
            "query": rounds["query"], "training": rounds["training"],
            "query_over_training": rounds["query"]["round_seconds"]
            / rounds["training"]["round_seconds"]}


def main_from_args(args: argparse.Namespace) -> int:
    if not 2 <= args.cells <= 1001:
        raise ConfigError("--cells", "must be in 2..1001 (a histogram's bins plus missing)")
    with tempfile.TemporaryDirectory(prefix="medfed-bench-query-") as tmp:
        result = run(cells=args.cells, patients=args.patients, root=Path(tmp),
                     timeout=args.timeout)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    q, t = result["query"], result["training"]
    print(f"query round, {result['cells']} cells, {result['sites']} sites: "
          f"{q['round_seconds']:.2f} s ({q['cpu_seconds']:.2f} s coordinator CPU)")
    print(f"training round, same sites:      {t['round_seconds']:.2f} s "
          f"({t['cpu_seconds']:.2f} s coordinator CPU)")
    print(f"query / training: {result['query_over_training']:.3f}")
    return 0


def register(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "query", help="a 1,000-cell query round against a training round, 3 sites, real "
        "processes")
    parser.add_argument("--cells", type=int, default=1000, help="query vector length")
    parser.add_argument("--patients", type=int, default=80, help="patients per site")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    return main_with([lambda sub: register(sub.add_parser("bench").add_subparsers())],
                     ["bench", "query", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
