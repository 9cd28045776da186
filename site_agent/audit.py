"""`medfed privacy audit`: does local training leak membership as much as DP allows?

One-run audit (Steinke, Nasr, Jagielski, NeurIPS 2023, see common/privacy/audit.py):
m canaries, each ONE privacy unit (a record, or a patient with its own id), are made
from the site's data as mislabelled outliers: a point far out along a random
direction of the standardised feature space, labelled the opposite of what a model
trained on the real records predicts there. Each canary joins the training set
independently with probability 1/2 (the auditor's coin, not the training noise), the
model is trained once exactly as a site trains it (LocalTrainer: DP-SGD at the target
epsilon, patient-level when there is a patient column, or non-private with --no-dp),
and the attack scores every canary by its log-likelihood under the trained model (a
memorised canary has a small loss). The scores give the attack's AUC, its TPR at 1%
FPR, and the epsilon lower bound at 95% confidence, which is compared with the
accountant's epsilon for the training that actually ran.

A lower bound above the claim means a bug; one below it is consistent with the claim
but does not prove it (docs/privacy.md "Privacy audit").
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import secrets
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import ConfigError, DataError
from common.privacy.accountant import account
from common.privacy.audit import DEFAULT_CONFIDENCE, AuditResult, audit_from_scores
from site_agent.data import (
    DatasetSchema,
    SiteData,
    Standardizer,
    load_site_data,
    load_site_data_for_study,
)
from site_agent.models import TabularMLP, flatten_parameters
from site_agent.trainer import LocalTrainer, TrainingConfig

CANARY_ID_PREFIX = "__medfed_audit_canary_"


@dataclass(frozen=True)
class AuditSettings:
    """What one audit trains. `epsilon` None = non-private training (the audit's control)."""

    canaries: int = 200
    epsilon: float | None = 8.0
    delta: float = 1e-5
    epochs: int = 60
    batch_size: int = 128
    lr: float = 0.1
    max_grad_norm: float = 1.0
    canary_radius: float = 10.0
    canary_records: int = 4
    confidence: float = DEFAULT_CONFIDENCE
    accountant: str = "prv"

    def __post_init__(self) -> None:
        if self.canaries < 10:
            raise ConfigError("canaries", "need at least 10")
        if self.epsilon is not None and not self.epsilon > 0:
            raise ConfigError("epsilon", "must be positive (or use --no-dp)")
        for name in ("epochs", "batch_size", "canary_records"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        for name in ("lr", "max_grad_norm", "canary_radius"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be positive")


@dataclass(frozen=True)
class AuditReport:
    """The audit's outcome; `epsilon_claimed` is None for non-private training."""

    result: AuditResult
    epsilon_claimed: float | None
    privacy_unit: str
    records: int
    canaries_included: int

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "attack_auc": r.attack_auc,
            "tpr_at_1pct_fpr": r.tpr_at_1pct_fpr,
            "epsilon_lower_bound": r.epsilon_lower_bound,
            "epsilon_claimed": self.epsilon_claimed,
            "confidence": r.confidence,
            "delta": r.delta,
            "canaries": r.canaries,
            "canaries_included": self.canaries_included,
            "best_guesses": r.best_guesses,
            "guesses": [
                {
                    "guesses": o.guesses,
                    "correct": o.correct,
                    "epsilon_lower_bound": o.epsilon_lower_bound,
                }
                for o in r.outcomes
            ],
            "privacy_unit": self.privacy_unit,
            "records": self.records,
        }


def _seeded_model(n_features: int, seed: int) -> TabularMLP:
    torch.manual_seed(seed)  # the same initial weights for the reference and audited runs
    return TabularMLP(n_features)


def _train(
    data: SiteData, settings: AuditSettings, *, dp: bool, seed: int
) -> tuple[LocalTrainer, list[Any]]:
    units = data.num_patients
    config = TrainingConfig(
        batch_size=max(1, min(settings.batch_size, units // 4)),
        max_physical_batch_size=4096,
        local_epochs=settings.epochs,
        lr=settings.lr,
        max_grad_norm=settings.max_grad_norm,
        target_epsilon=settings.epsilon if settings.epsilon is not None else 1.0,
        delta=settings.delta,
        planned_rounds=1,
        accountant=settings.accountant,
        dp=dp,
        privacy_unit="patient" if data.patient_ids is not None else "record",
        device="cpu",
    )
    n_features = int(data.features.shape[1])
    trainer = LocalTrainer(lambda: _seeded_model(n_features, seed), data, config, seed=seed)
    start = flatten_parameters(_seeded_model(n_features, seed))
    result = trainer.train_round(start)
    return trainer, list(result.segments)


def _logits(trainer: LocalTrainer, features: np.ndarray) -> np.ndarray:
    scores = trainer.predict(features)
    clipped = np.clip(scores, 1e-12, 1 - 1e-12)
    return np.asarray(np.log(clipped) - np.log1p(-clipped), dtype=np.float64)


def make_canaries(
    data: SiteData, reference: LocalTrainer, *, count: int, radius: float, rng: np.random.Generator
) -> SiteData:
    """`count` mislabelled outliers in standardised space, one privacy unit each."""
    n_features = int(data.features.shape[1])
    directions = rng.standard_normal((count, n_features))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    features = (radius * directions).astype(np.float32)
    natural = reference.predict(features) >= 0.5
    labels = np.where(natural, 0, 1).astype(data.labels.dtype)
    ids = None
    if data.patient_ids is not None:
        ids = np.array([f"{CANARY_ID_PREFIX}{i}" for i in range(count)], dtype=object)
    return SiteData(
        features=features,
        labels=labels,
        patient_ids=ids,
        feature_names=data.feature_names,
        source="audit canaries",
    )


def _concat(a: SiteData, b: SiteData) -> SiteData:
    ids = None
    if a.patient_ids is not None and b.patient_ids is not None:
        ids = np.concatenate([a.patient_ids.astype(str).astype(object), b.patient_ids])
    return replace(
        a,
        features=np.concatenate([a.features, b.features]),
        labels=np.concatenate([a.labels, b.labels]),
        patient_ids=ids,
    )


def run_audit(data: SiteData, settings: AuditSettings, *, seed: int) -> AuditReport:
    """Train once with half the canaries in, attack all of them, bound epsilon."""
    if data.patient_ids is not None and any(
        str(p).startswith(CANARY_ID_PREFIX) for p in np.unique(data.patient_ids)
    ):
        raise DataError(f"patient ids must not start with {CANARY_ID_PREFIX!r}", file=data.source)
    standardized = Standardizer.fit(data.features).transform(data)
    rng = np.random.default_rng(seed)
    # Reference run on the real records only: it decides each canary's "wrong" label.
    reference, _ = _train(standardized, settings, dp=False, seed=seed)
    canaries = make_canaries(
        standardized, reference, count=settings.canaries, radius=settings.canary_radius, rng=rng
    )
    included = rng.random(settings.canaries) < 0.5
    if included.all() or not included.any():
        raise ConfigError("canaries", "the coin flips put every canary on one side; use more")
    chosen = np.flatnonzero(included)
    if data.patient_ids is not None:
        # A canary patient may have several identical encounters: still ONE unit.
        chosen = np.repeat(chosen, settings.canary_records)
    training = _concat(standardized, canaries.subset(chosen))
    dp = settings.epsilon is not None
    trainer, segments = _train(training, settings, dp=dp, seed=seed + 1)
    logits = _logits(trainer, canaries.features)
    signs = np.where(canaries.labels == 1, 1.0, -1.0)
    scores = -np.logaddexp(0.0, -signs * logits)  # log-likelihood of the canary's label
    result = audit_from_scores(
        scores, included, delta=settings.delta, confidence=settings.confidence
    )
    claimed = None
    if dp:
        claimed = account(segments, delta=settings.delta, accountant=settings.accountant).epsilon
    return AuditReport(
        result=result,
        epsilon_claimed=claimed,
        privacy_unit=trainer.privacy_unit,
        records=len(data),
        canaries_included=int(included.sum()),
    )


# ---------------------------------------------------------------------------- CLI
def _header(path: Path) -> list[str]:
    if not path.is_file():
        raise DataError("file not found", file=str(path))
    if path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq  # type: ignore[import-untyped]

        return list(pq.read_schema(path).names)
    with path.open(newline="", encoding="utf-8") as handle:
        try:
            return next(csv.reader(handle))
        except StopIteration:
            raise DataError("empty file", file=str(path)) from None


def load_audit_data(path: Path, *, label: str, patient: str | None) -> SiteData:
    """Every column but the label and patient id is a (numeric) feature."""
    columns = _header(path)
    features = [c for c in columns if c not in (label, patient)]
    schema = DatasetSchema(features=features, label=label, patient_id=patient)
    return load_site_data(path, schema)


def load_audit_data_for_bundle(path: Path, bundle_path: Path) -> SiteData:
    """A study's file (its own column names, categorical levels, missing values), encoded
    with a final bundle's study and global statistics, as the site trained on it."""
    from common.bundle import read_bundle

    bundle = read_bundle(bundle_path)
    study = bundle.study
    if study.data.kind != "table" or study.study.task != "binary":
        raise ConfigError(
            "--model",
            f"{bundle_path}: the audit trains a binary tabular model; this study is "
            f"{study.data.kind!r} / {study.study.task!r}",
        )
    return load_site_data_for_study(path, study, bundle.statistics)


def _cmd_audit(args: argparse.Namespace) -> int:
    settings = AuditSettings(
        canaries=args.canaries,
        epsilon=None if args.no_dp else args.epsilon,
        delta=args.delta,
        epochs=args.epochs,
    )
    if args.model is not None:
        if args.label_column is not None or args.patient_column is not None:
            raise ConfigError("--model", "the study names the label and patient columns; "
                              "drop --label-column / --patient-column")
        data = load_audit_data_for_bundle(Path(args.data), Path(args.model))
    elif args.label_column is None:
        raise ConfigError("--label-column", "give it (a numeric file) or --model "
                          "final.safetensors (a study's file: its columns, levels, missing values)")
    else:
        data = load_audit_data(
            Path(args.data), label=args.label_column, patient=args.patient_column
        )
    # Without --seed the training noise comes from the OS CSPRNG (a reproducible
    # seed is for tests: noise an attacker can regenerate protects nothing).
    seed = args.seed if args.seed is not None else secrets.randbits(62)
    report = run_audit(data, settings, seed=seed).as_dict()
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    for key in ("attack_auc", "tpr_at_1pct_fpr", "epsilon_lower_bound", "epsilon_claimed"):
        value = report[key]
        print(f"{key}: {'null' if value is None else f'{value:.4f}'}")
    print(
        f"({report['canaries']} canaries, {report['canaries_included']} trained on; "
        f"bound at {100 * report['confidence']:.0f}% confidence, delta {report['delta']:g}; "
        f"privacy unit: {report['privacy_unit']})"
    )
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def register(commands: Any) -> None:
    """Adds `audit` under `medfed privacy` (plug-in group ``medfed.privacy_commands``)."""
    parser = commands.add_parser(
        "audit",
        help="train locally with canaries, attack them, report an epsilon lower bound",
    )
    parser.add_argument("--data", required=True, help="CSV or Parquet file of records")
    parser.add_argument(
        "--label-column",
        default=None,
        help="without --model: every other column (but the patient id) is a numeric feature",
    )
    parser.add_argument("--patient-column", default=None, help="patient-level DP if given")
    parser.add_argument(
        "--model",
        default=None,
        metavar="BUNDLE",
        help="a study's model bundle (final.safetensors): read the file as the study "
        "declares it (columns, categorical levels, missing values, labels) with the "
        "bundle's global preprocessing statistics",
    )
    privacy = parser.add_mutually_exclusive_group()
    privacy.add_argument(
        "--epsilon",
        type=_positive_float,
        default=8.0,
        help="target epsilon of the audited DP-SGD training (default 8)",
    )
    privacy.add_argument("--no-dp", action="store_true", help="audit non-private training")
    parser.add_argument("--delta", type=_positive_float, default=1e-5)
    parser.add_argument("--canaries", type=int, default=AuditSettings.canaries)
    parser.add_argument("--epochs", type=int, default=AuditSettings.epochs)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="fixed seed (tests only: makes the DP noise reproducible)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.set_defaults(func=_cmd_audit)


def main(argv: list[str] | None = None) -> int:
    """`python -m site_agent.audit ...` = `medfed privacy audit ...`."""
    from common.cli import run_parsed

    parser = argparse.ArgumentParser(prog="medfed privacy")
    commands = parser.add_subparsers(dest="privacy_command", required=True)
    register(commands)
    return run_parsed(parser.parse_args(["audit", *(argv or [])]))


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
