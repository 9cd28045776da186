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

With `--study` the audit trains what the federation trains: the study's features and
encoding (`Preprocessor`, statistics from `--statistics` or a noiseless release of this
file, which stays with the auditor), its model from the registry (`build_for_study`),
its task, classes, privacy unit, epsilon, delta, clip norm, learning rate and batch.

A lower bound above the claim means a bug; one below it is consistent with the claim
but does not prove it (docs/privacy.md "Privacy audit").
"""

from __future__ import annotations

import argparse
import csv
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.core.errors import ConfigError, DataError
from common.crypto.random import DeterministicRandom
from common.models import Task
from common.models.layout import flatten_parameters
from common.models.tables.mlp import TabularMLP
from common.privacy.accountant import account
from common.privacy.audit import AuditResult, audit_from_scores
from common.privacy.mechanisms import Gaussian
from common.study import GlobalStatistics, Study
from site_agent.audit_settings import AuditSettings
from site_agent.data import DatasetSchema, SiteData, Standardizer, load_site_data
from site_agent.dp_release import gaussian_std_for, noisy_unit_count
from site_agent.trainer import LocalTrainer
from site_agent.training_config import TrainingConfig

CANARY_ID_PREFIX = "__medfed_audit_canary_"


def _default_model(n_features: int) -> torch.nn.Module:
    return TabularMLP(n_features)


@dataclass(frozen=True)
class AuditModel:
    """What the audit trains: the network (from the input width), its task and classes.

    `standardize`: fit a standardiser on the records first (the default tabular path);
    a study's `Preprocessor` has already encoded and scaled them.
    """

    build: Callable[[int], torch.nn.Module] = field(default=_default_model)
    task: Task = "binary"
    num_classes: int = 2
    standardize: bool = True


@dataclass(frozen=True)
class AuditReport:
    """The audit's outcome; `epsilon_claimed` is None for non-private training."""

    result: AuditResult
    epsilon_claimed: float | None
    privacy_unit: str
    records: int
    canaries_included: int
    released_units: int | None = None  # the DP unit count training was sized from
    count_noise_std: float | None = None
    sample_rate: float | None = None
    # The training and the DP count it was sized from, composed: the ledger's charge.
    epsilon_with_count: float | None = None

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
            "released_units": self.released_units,
            "count_noise_std": self.count_noise_std,
            "sample_rate": self.sample_rate,
            "epsilon_with_count": self.epsilon_with_count,
        }


def _seeded_model(model: AuditModel, n_features: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights for the reference and audited runs
    return model.build(n_features)


def _train(
    data: SiteData, settings: AuditSettings, model: AuditModel, *, dp: bool, seed: int,
    released_units: int | None = None,
) -> tuple[LocalTrainer, list[Any]]:
    units = data.num_patients
    config = TrainingConfig(
        released_units=released_units,
        batch_size=max(1, min(settings.batch_size, units // 4)),
        max_physical_batch_size=4096,
        local_epochs=settings.epochs,
        lr=settings.lr,
        optimizer=settings.optimizer,
        max_grad_norm=settings.max_grad_norm,
        target_epsilon=settings.epsilon if settings.epsilon is not None else 1.0,
        delta=settings.delta,
        planned_rounds=1,
        accountant=settings.accountant,
        dp=dp,
        privacy_unit="patient" if data.patient_ids is not None else "record",
        device="cpu",
        task=model.task,
        num_classes=model.num_classes,
    )
    n_features = int(data.features.shape[1])
    trainer = LocalTrainer(
        lambda: _seeded_model(model, n_features, seed), data, config, seed=seed
    )
    start = flatten_parameters(_seeded_model(model, n_features, seed))
    result = trainer.train_round(start)
    return trainer, list(result.segments)


def label_log_likelihood(trainer: LocalTrainer, canaries: SiteData) -> np.ndarray:
    """log P(canary's label) under the trained model: the attack's membership score."""
    scores = trainer.predict(canaries.features)
    labels = np.asarray(canaries.labels, dtype=np.int64)
    if scores.ndim == 1:  # binary: log-sigmoid of the signed logit, stable at the tails
        clipped = np.clip(scores, 1e-12, 1 - 1e-12)
        logits = np.log(clipped) - np.log1p(-clipped)
        signs = np.where(labels == 1, 1.0, -1.0)
        return np.asarray(-np.logaddexp(0.0, -signs * logits), dtype=np.float64)
    chosen = scores[np.arange(labels.size), labels]
    return np.asarray(np.log(np.clip(chosen, 1e-300, 1.0)), dtype=np.float64)


def make_canaries(
    data: SiteData, reference: LocalTrainer, *, count: int, radius: float, rng: np.random.Generator
) -> SiteData:
    """`count` mislabelled outliers in standardised space, one privacy unit each: the
    opposite class (binary), or a class other than the predicted one (multi-class)."""
    n_features = int(data.features.shape[1])
    directions = rng.standard_normal((count, n_features))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    features = (radius * directions).astype(np.float32)
    predicted = reference.predict(features)
    if predicted.ndim == 1:
        labels = np.where(predicted >= 0.5, 0, 1).astype(data.labels.dtype)
    else:
        k = predicted.shape[1]
        shift = rng.integers(1, k, size=count)
        labels = ((predicted.argmax(axis=1) + shift) % k).astype(data.labels.dtype)
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


def run_audit(
    data: SiteData, settings: AuditSettings, *, seed: int, model: AuditModel | None = None
) -> AuditReport:
    """Train once with half the canaries in, attack all of them, bound epsilon."""
    model = model or AuditModel()
    if data.patient_ids is not None and any(
        str(p).startswith(CANARY_ID_PREFIX) for p in np.unique(data.patient_ids)
    ):
        raise DataError(f"patient ids must not start with {CANARY_ID_PREFIX!r}", file=data.source)
    standardized = data
    if model.standardize:
        standardized = Standardizer.fit(data.features).transform(data)
    rng = np.random.default_rng(seed)
    # Reference run on the real records only: it decides each canary's "wrong" label.
    reference, _ = _train(standardized, settings, model, dp=False, seed=seed)
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
    released = std = None
    if dp:
        # The shipped mechanism: the site's sampling rate and steps come from its ONE DP
        # count of units (site_agent.dp_release), never from the exact count, which here
        # includes the canaries trained on.
        std = gaussian_std_for(epsilon=settings.count_epsilon, delta=settings.delta,
                               accountant=settings.accountant)
        # Its noise follows the run's seed like the training noise (drawn from the OS
        # CSPRNG unless a test pins --seed).
        released = noisy_unit_count(
            training.num_patients, std=std,
            rng=DeterministicRandom(f"medfed-audit-count/{seed}".encode()))
    trainer, segments = _train(training, settings, model, dp=dp, seed=seed + 1,
                               released_units=released)
    scores = label_log_likelihood(trainer, canaries)
    result = audit_from_scores(
        scores, included, delta=settings.delta, confidence=settings.confidence
    )
    claimed = with_count = None
    if dp and std is not None:
        claimed = account(segments, delta=settings.delta, accountant=settings.accountant).epsilon
        # What the site's ledger charges for this run: the count and the training,
        # composed (the count's output shaped the training that followed).
        with_count = account([*segments, Gaussian(std, 1.0)], delta=settings.delta,
                             accountant=settings.accountant).epsilon
    return AuditReport(
        result=result,
        epsilon_claimed=claimed,
        privacy_unit=trainer.privacy_unit,
        records=len(data),
        canaries_included=int(included.sum()),
        released_units=released,
        count_noise_std=std,
        sample_rate=trainer.sample_rate if dp else None,
        epsilon_with_count=with_count,
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


def local_statistics(study: Study, table: Any, *, seed: int) -> GlobalStatistics:
    """Preprocessing statistics of this file alone, through the federation's own release
    encoding and decoding (common.releases.statistics) but WITHOUT noise: they feed only the
    auditor's local run and never leave it (`--statistics` takes the federation's)."""
    from common.releases.statistics import decode_release, encode_release

    rng = np.random.default_rng(seed)
    total = encode_release(table, study, uniform=rng.random)
    return decode_release(total, study, source="privacy audit: this file, noiseless")


def load_study_audit_data(
    path: Path, study: Study, *, statistics: GlobalStatistics | None, seed: int
) -> tuple[SiteData, AuditModel]:
    """The study's encoded records and model, as a site of the federation trains them.

    One canary per privacy unit of the study: a record-level study drops the patient
    column (each record is then a unit). Hospital-level DP is a property of the
    federation's noised sum, which one site's local run cannot exercise: refused.
    """
    from site_agent.data import Preprocessor, load_study_table

    if study.data.kind != "table":
        raise ConfigError("study", "the privacy audit runs on table studies")
    if study.privacy.unit == "hospital":
        raise ConfigError(
            "privacy.unit",
            "hospital-level DP comes from the federation's distributed noise; a local audit "
            "cannot exercise it (audit a copy of the study with unit = 'patient')",
        )
    table = load_study_table(path, study)
    stats = statistics if statistics is not None else local_statistics(study, table, seed=seed)
    data = Preprocessor(study, stats).site_data(table)
    if study.privacy.unit == "record":
        data = replace(data, patient_ids=None)
    return data, study_audit_model(study)


def study_audit_model(study: Study) -> AuditModel:
    """The study's network from the registry, on records its `Preprocessor` encoded."""
    from common.models.build import build_for_study

    return AuditModel(
        build=lambda n: build_for_study(study, in_features=n),
        task=study.study.task,
        num_classes=len(study.study.classes),
        standardize=False,
    )


def run_audit_command(args: argparse.Namespace) -> int:
    """`medfed privacy audit` once its arguments are parsed (site_agent/audit_cli.py)."""
    # Without --seed the training noise comes from the OS CSPRNG (a reproducible
    # seed is for tests: noise an attacker can regenerate protects nothing).
    seed = args.seed if args.seed is not None else secrets.randbits(62)
    model: AuditModel | None = None
    epsilon = 8.0 if args.epsilon is None else args.epsilon
    delta = 1e-5 if args.delta is None else args.delta
    training: dict[str, Any] = {}
    if args.study is not None:
        from common.study import load_statistics, load_study

        if args.label_column is not None or args.patient_column is not None:
            raise ConfigError("--study", "the study names the label and patient columns")
        study = load_study(args.study)
        statistics = None
        if args.statistics is not None:
            statistics = load_statistics(args.statistics, study)
        data, model = load_study_audit_data(
            Path(args.data), study, statistics=statistics, seed=seed
        )
        epsilon = study.privacy.epsilon if args.epsilon is None else args.epsilon
        delta = study.privacy.delta if args.delta is None else args.delta
        training = {
            "lr": study.training.learning_rate,
            "batch_size": study.training.batch_size,
            "optimizer": study.training.local_optimizer,
            "max_grad_norm": study.privacy.max_grad_norm,
            "count_epsilon": study.privacy.count_epsilon,
        }
    else:
        if args.label_column is None:
            raise ConfigError("--label-column", "required without --study")
        if args.statistics is not None:
            raise ConfigError("--statistics", "applies with --study only")
        data = load_audit_data(
            Path(args.data), label=args.label_column, patient=args.patient_column
        )
    settings = AuditSettings(
        canaries=args.canaries,
        epsilon=None if args.no_dp else epsilon,
        delta=delta,
        epochs=args.epochs,
        **training,
    )
    report = run_audit(data, settings, seed=seed, model=model).as_dict()
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
        + ("" if report["released_units"] is None else
           f"; sized from the DP unit count {report['released_units']} (noise std "
           f"{report['count_noise_std']:.2f}); with that count epsilon "
           f"{report['epsilon_with_count']:.4f}")
    )
    return 0

