"""`medfed bench utility`: what a study's model is worth, on real clinical tables.

Per dataset of `bench.utility_data` (three non-IID hospital CSVs each), one row:

* **centralized LR**: non-private logistic regression on every hospital's TRAINING rows
  pooled, scored on every hospital's held-back rows pooled. The held-back rows are the
  ones the product holds back itself: `site_agent.unit_split.split_by_patient` with the
  site's default ``data.holdout_fraction`` under each demo site's own split key (read
  from its state folder once the demo has made it), so all the figures are on the same
  patients. Encoding: numeric columns imputed with the pooled
  training median and standardised with the pooled training mean and deviation;
  categorical columns one-hot over the declared levels (a missing value: all zeros).
  Fitted by Newton's method (IRLS) on the mean log-loss with a small ridge
  (`common.models.logistic_reference.RIDGE`); exact AUC (Mann-Whitney, ties counted half).
* **federated, no DP**: the product's own in-process FedAvg baseline, same model and
  rounds (``baselines.federated_nodp`` of the demo's report.json).
* **federated + DP + SecAgg+**: the real product path, ``medfed demo --data DIR
  --label-column ... --patient-column ...`` as a subprocess with the product's
  defaults (rounds, model, learning rate, budget), except ``--kill-round 0`` (no
  injected dropout: the bench measures utility, not recovery) and ``--no-audit``.
  Two figures: the exact AUC of the study's final model bundle on the pooled held-back
  rows (``medfed predict``), and the AUC the federation itself released through its DP
  score histograms (``final.auc``). The summary also has the exact AUC of every
  round's bundle (``exact_auc_by_round``), kept when a study fails to finish.
* for scale, the same logistic regression on age alone (every dataset has age).
* the gap centralized LR minus the DP model's exact AUC, and each site's epsilon spent
  against its budget (``final.epsilon`` / ``final.budget`` of report.json).

``--json`` prints the summary as one JSON object on the last line; it is always written
to ``OUT/utility.json``. A dataset whose demo fails is reported as failed (the command
then exits 1), never as a result.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.utility_data import DATASETS, require_bench_extra, write_dataset
from common.core.config import SiteDataSection
from common.core.errors import ConfigError, ValidationError
from common.core.parsing import parse_json
from common.core.processes import medfed_argv
from common.models.logistic_reference import fit_logistic
from site_agent.data import SiteData, is_missing, iter_table_rows
from site_agent.unit_split import SITE_KEY_FILE, site_split_key, split_by_patient

# ----------------------------------------------------------------------------- tables

@dataclass(frozen=True)
class PooledTable:
    """Every hospital's rows, pooled: which site each row came from, its patient id,
    label, numeric columns (NaN = missing) and categorical cells (None = missing)."""

    site: np.ndarray
    patient_ids: np.ndarray
    labels: np.ndarray
    numeric: dict[str, np.ndarray]
    categorical: dict[str, np.ndarray]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def read_sites(files: dict[str, Path], *, label_column: str, patient_column: str,
               numeric: list[str], categorical: list[str],
               classes: tuple[str, str] = ("0", "1")) -> PooledTable:
    """The sites' CSVs through the reader the sites use (`site_agent.data`)."""
    sites: list[str] = []
    patients: list[str] = []
    labels: list[int] = []
    num: dict[str, list[float]] = {c: [] for c in numeric}
    cat: dict[str, list[str | None]] = {c: [] for c in categorical}
    for site in sorted(files):
        header, rows = iter_table_rows(files[site])
        for column in (label_column, patient_column, *numeric, *categorical):
            if column not in header:
                raise ConfigError("bench utility", f"{files[site]} has no column {column!r}")
        for row_number, row in rows:
            label = (row.get(label_column) or "").strip()
            if label not in classes:
                raise ConfigError("bench utility", f"{files[site]} row {row_number}: label "
                                  f"{label!r} is not one of {list(classes)}")
            sites.append(site)
            patients.append((row.get(patient_column) or "").strip())
            labels.append(classes.index(label))
            for c in numeric:
                cell = row.get(c) or ""
                num[c].append(float("nan") if is_missing(cell) else float(cell))
            for c in categorical:
                cell = (row.get(c) or "").strip()
                cat[c].append(None if is_missing(cell) else cell)
    return PooledTable(
        site=np.array(sites, dtype=object), patient_ids=np.array(patients, dtype=object),
        labels=np.array(labels, dtype=np.int64),
        numeric={c: np.array(v, dtype=np.float64) for c, v in num.items()},
        categorical={c: np.array(v, dtype=object) for c, v in cat.items()},
    )


def held_back_mask(
    table: PooledTable, *, held_out_fraction: float, keys: dict[str, bytes]
) -> np.ndarray:
    """Rows each site holds back: the product's own split, site by site, under each
    site's split key (`keys`)."""
    mask = np.zeros(len(table), dtype=bool)
    for site in sorted(set(table.site.tolist())):
        rows = np.flatnonzero(table.site == site)
        data = SiteData(features=rows.reshape(-1, 1).astype(np.float64),
                        labels=table.labels[rows], patient_ids=table.patient_ids[rows])
        _, held = split_by_patient(data, held_out_fraction=held_out_fraction, key=keys[site])
        mask[held.features[:, 0].astype(np.int64)] = True
    return mask


def product_holdout_fraction() -> float:
    """The held-out fraction a site of ``medfed demo --data`` uses."""
    return float(SiteDataSection.model_fields["holdout_fraction"].default)


def demo_split_keys(demo: Path, sites: list[str]) -> dict[str, bytes]:
    """Each demo site's split key, from its state folder; RuntimeError when the demo
    stopped before making them (then no held-back rows can be named)."""
    missing = [s for s in sites if not (demo / "sites" / s / SITE_KEY_FILE).is_file()]
    if missing:
        raise RuntimeError(f"the demo made no split key for {', '.join(missing)} "
                           f"(in {demo / 'sites'})")
    return {site: site_split_key(demo / "sites" / site) for site in sites}


# ------------------------------------------------------------------ logistic regression

def encode(table: PooledTable, train: np.ndarray, *,
           levels: dict[str, tuple[str, ...]]) -> np.ndarray:
    """Design matrix (intercept first) for every row, with statistics from the rows
    where `train` is True only: median imputation, standardisation, one-hot levels."""
    columns: list[np.ndarray] = [np.ones(len(table))]
    for values in table.numeric.values():
        observed = values[train & ~np.isnan(values)]
        median = float(np.median(observed)) if observed.size else 0.0
        filled = np.where(np.isnan(values), median, values)
        mean, std = float(filled[train].mean()), float(filled[train].std())
        columns.append((filled - mean) / (std if std > 1e-12 else 1.0))
    for name, cells in table.categorical.items():
        for level in levels[name]:
            columns.append(np.array([cell == level for cell in cells], dtype=np.float64))
    return np.column_stack(columns)


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a positive > score of a negative), ties counted half (Mann-Whitney)."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels)
    positives = int((labels == 1).sum())
    negatives = int((labels == 0).sum())
    if positives == 0 or negatives == 0:
        raise ConfigError("bench utility", "AUC needs both classes among the held-back rows")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(scores.size)
    sorted_scores = scores[order]
    start = 0
    while start < scores.size:  # average ranks over ties
        end = start
        while end + 1 < scores.size and sorted_scores[end + 1] == sorted_scores[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2.0 + 1.0
        start = end + 1
    rank_sum = float(ranks[labels == 1].sum())
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


def centralized_logistic_auc(table: PooledTable, held_back: np.ndarray, *,
                             levels: dict[str, tuple[str, ...]]) -> float:
    """Non-private LR on the pooled training rows, exact AUC on the pooled held-back."""
    train = ~held_back
    x = encode(table, train, levels=levels)
    w = fit_logistic(x[train], table.labels[train].astype(np.float64))
    return exact_auc(x[held_back] @ w, table.labels[held_back])


def age_only(table: PooledTable) -> PooledTable:
    """The same rows with age as the only feature (what one column alone gives)."""
    return PooledTable(site=table.site, patient_ids=table.patient_ids, labels=table.labels,
                       numeric={"age": table.numeric["age"]}, categorical={})


# --------------------------------------------------------------------------- the demo

def write_held_back(written: Any, held_back: np.ndarray, table: PooledTable,
                    path: Path) -> np.ndarray:
    """The pooled held-back rows as one CSV (the sites' header); returns their labels
    in file order. Rows are read back in `read_sites` order (sites sorted, file order)."""
    labels: list[int] = []
    index = 0
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        header_written = False
        for site in sorted(written.files):
            with written.files[site].open(newline="", encoding="utf-8") as handle:
                reader = csv.reader(handle)
                header = next(reader)
                if not header_written:
                    writer.writerow(header)
                    header_written = True
                for row in reader:
                    if held_back[index]:
                        writer.writerow(row)
                        labels.append(int(table.labels[index]))
                    index += 1
    if index != len(table):
        raise ConfigError("bench utility", f"{path}: {index} rows read back, "
                          f"{len(table)} expected")
    return np.array(labels, dtype=np.int64)


def run_demo(written: Any, out: Path, *, rounds: int | None, timeout: float) -> dict[str, Any]:
    """``medfed demo --data`` on the dataset's folder; its report.json."""
    argv = medfed_argv("demo", *written.demo_args(), "--out", str(out / "demo"),
                       "--kill-round", "0", "--no-audit")
    if rounds is not None:
        argv += ["--rounds", str(rounds)]
    log = out / "demo.log"
    with log.open("w", encoding="utf-8") as handle:
        try:
            completed = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT,
                                       timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"medfed demo ran past {timeout:.0f} s (log: {log})") from None
    report = out / "demo" / "report.json"
    if completed.returncode != 0 or not report.is_file():
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"medfed demo exited {completed.returncode}: "
                           f"{' | '.join(tail)} (log: {log})")
    result: dict[str, Any] = parse_json(report.read_bytes())
    return result


def score_bundle(bundle: Path, held_back_csv: Path, labels: np.ndarray, out: Path) -> float:
    """Exact AUC of a model bundle on the held-back rows, scored by `medfed predict`."""
    scores_csv = out / f"scores-{bundle.stem}.csv"
    completed = subprocess.run(
        medfed_argv("predict", "--model", str(bundle), "--data", str(held_back_csv),
                    "--out", str(scores_csv), "--json"),
        capture_output=True, text=True, timeout=600, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"medfed predict {bundle} exited {completed.returncode}: "
                           f"{completed.stderr.strip()[-300:]}")
    with scores_csv.open(newline="", encoding="utf-8") as handle:
        scores = np.array([float(row["score"]) for row in csv.DictReader(handle)])
    if scores.size != labels.size:
        raise RuntimeError(f"{scores_csv}: {scores.size} scores for {labels.size} rows")
    return exact_auc(scores, labels)


def round_bundle_aucs(demo: Path, held_back_csv: Path, labels: np.ndarray,
                      out: Path) -> dict[str, float]:
    """Exact held-back AUC of the bundle the coordinator wrote after each round
    (``coordinator/model/round-NNNNNN.safetensors``) and of the final one: whether the
    DP model was still improving, even when a study never reached its final round."""
    folder = demo / "coordinator" / "model"
    aucs: dict[str, float] = {}
    bundles = sorted(folder.glob("*.safetensors"), key=lambda p: (p.stem == "final", p.stem))
    for bundle in bundles if folder.is_dir() else []:
        aucs[bundle.stem] = round(score_bundle(bundle, held_back_csv, labels, out), 4)
    return aucs


def local_losses(demo: Path, sites: list[str]) -> dict[str, list[float]]:
    """Each site's local training loss per training round, from its JSON log lines
    (``site_round_done``): whether the DP model was still improving."""
    losses: dict[str, list[float]] = {}
    for site in sites:
        log = demo / "logs" / f"{site}.log"
        values: list[float] = []
        if log.is_file():
            for text in log.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    line = parse_json(text)
                except ValidationError:
                    continue
                if (isinstance(line, dict) and line.get("event") == "site_round_done"
                        and not line.get("evaluation_only")
                        and line.get("local_loss") is not None):
                    values.append(round(float(line["local_loss"]), 4))
        losses[site] = values
    return losses


# -------------------------------------------------------------------------- the bench

def measure(name: str, out: Path, *, rounds: int | None, seed: int,
            timeout: float) -> dict[str, Any]:
    """One dataset's row (see the module docstring)."""
    started = time.monotonic()
    written = write_dataset(name, out / "data", seed=seed)
    info = written.info
    table = read_sites(written.files, label_column=info.label_column,
                       patient_column=info.patient_column, numeric=list(info.numeric),
                       categorical=list(info.categorical), classes=info.classes)
    # The demo's sites make their split keys; the held-back rows are known from then on.
    try:
        report: dict[str, Any] | None = run_demo(written, out, rounds=rounds, timeout=timeout)
        error = None
    except RuntimeError as exc:
        report, error = None, str(exc)
    try:
        keys = demo_split_keys(out / "demo", sorted(written.files))
    except RuntimeError as exc:
        raise RuntimeError(error or str(exc)) from None
    held_back = held_back_mask(table, held_out_fraction=product_holdout_fraction(), keys=keys)
    row: dict[str, Any] = {
        "dataset": name, "outcome": info.outcome, "source": info.source,
        "patients": len(table), "positives": int(table.labels.sum()),
        "held_back": int(held_back.sum()), "sites": written.rows, "split": written.split,
        "centralized_lr_auc": centralized_logistic_auc(table, held_back,
                                                       levels=info.categorical),
        "age_only_lr_auc": centralized_logistic_auc(age_only(table), held_back, levels={}),
    }
    held_back_csv = out / "held-back.csv"
    held_labels = write_held_back(written, held_back, table, held_back_csv)
    if report is None:
        # What the federation got to before failing: its round bundles' exact AUC.
        row.update({"error": error,
                    "exact_auc_by_round": round_bundle_aucs(out / "demo", held_back_csv,
                                                            held_labels, out),
                    "local_loss_by_round": local_losses(out / "demo", list(written.files))})
        return row
    final = report["final"]
    by_round = round_bundle_aucs(out / "demo", held_back_csv, held_labels, out)
    training = [r for r in report["rounds"] if not r.get("evaluation_only")]
    row.update({
        "rounds": len(training),
        "federated_nodp_auc": report["baselines"]["federated_nodp"]["auc"],
        "demo_centralized_lr_auc": report["baselines"]["centralized_nodp"]["auc"],
        # The study's final model bundle (None when the study left none).
        "dp_auc": by_round.get("final") if (report.get("model") or {}).get(
            "kind") == "final bundle" else None,
        "exact_auc_by_round": by_round,
        "dp_auc_federated_evaluation": final.get("auc"),
        "auc_by_round": [r["auc"] for r in report["rounds"]],
        "local_loss_by_round": local_losses(out / "demo", list(report["sites"])),
        "epsilon": final["epsilon"], "budget": final["budget"],
        "epsilon_by_purpose": final.get("epsilon_by_purpose", {}),
        "delta": report.get("delta"), "privacy_unit": report.get("privacy_unit"),
        "aborted_rounds": len(report.get("aborted_rounds", [])),
        "demo_seconds": report.get("seconds"),
    })
    row["gap"] = (None if row["dp_auc"] is None
                  else round(row["centralized_lr_auc"] - row["dp_auc"], 4))
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "-"


def format_row(row: dict[str, Any]) -> str:
    """One table row (markdown): the figures of `measure`, or the failure."""
    if "error" in row:
        last = list(row.get("exact_auc_by_round", {}).items())[-1:]
        reached = f"; last round bundle {last[0][0]}: AUC {last[0][1]:.3f}" if last else ""
        return f"| {row['dataset']} | failed: {row['error']}{reached} |"
    eps = ", ".join(f"{s} {e:.2f}/{row['budget'][s]:g}" for s, e in row["epsilon"].items())
    return (f"| {row['dataset']} | {row['patients']:,} | {row['rounds']} | "
            f"{_fmt(row['centralized_lr_auc'])} | {_fmt(row.get('age_only_lr_auc'))} | "
            f"{_fmt(row['federated_nodp_auc'])} | "
            f"{_fmt(row['dp_auc'])} | {_fmt(row['dp_auc_federated_evaluation'])} | "
            f"{_fmt(row['gap'])} | {eps} |")


HEADER = ("| dataset | patients | rounds | centralized LR | (age alone) | federated, no DP | "
          "federated + DP + SecAgg+ | (its DP evaluation) | gap | epsilon spent / budget |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "utility", help="centralized vs federated vs federated + DP AUC on real tables",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--datasets", default=",".join(DATASETS),
                        help=f"comma-separated subset of {','.join(DATASETS)} (default all)")
    parser.add_argument("--out", type=Path, default=Path("bench-utility"),
                        help="working folder: OUT/NAME/{data,demo}, OUT/utility.json")
    parser.add_argument("--rounds", type=int, default=None,
                        help="training rounds (default: the product's default)")
    parser.add_argument("--split-seed", type=int, default=0,
                        help="seed of the non-IID hospital split (bench.utility_data)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds one dataset's demo may run")
    parser.add_argument("--json", action="store_true", help="summary JSON on the last line")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    unknown = [n for n in names if n not in DATASETS]
    if unknown or not names:
        raise ConfigError("--datasets", f"unknown {unknown}; known: {', '.join(DATASETS)}")
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError("--rounds", "must be >= 1")
    require_bench_extra()
    args.out.mkdir(parents=True, exist_ok=True)
    human = sys.stderr if args.json else sys.stdout
    print(HEADER, file=human, flush=True)
    rows: list[dict[str, Any]] = []
    for name in names:
        try:
            row = measure(name, args.out / name, rounds=args.rounds, seed=args.split_seed,
                          timeout=args.timeout)
        except (RuntimeError, subprocess.SubprocessError) as exc:
            row = {"dataset": name, "error": str(exc)}
        rows.append(row)
        print(format_row(row), file=human, flush=True)
    summary = {"datasets": rows, "rounds_option": args.rounds,
               "centralized": "logistic regression, pooled training rows, exact AUC"}
    (args.out / "utility.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print(f"summary: {args.out / 'utility.json'}", file=human)
    if args.json:
        print(json.dumps(summary))
    return 1 if any("error" in r for r in rows) else 0
