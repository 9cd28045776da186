"""The study's model bundles under STATE/model: one per completed training round
(round-NNNNNN.safetensors) and, after the last round, final.safetensors, which
DownloadFinalModel serves. A bundle carries what a hospital needs to use the model
without the federation: architecture, preprocessing statistics, decision threshold
and the privacy card (common/releases/bundle.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pydantic

from common.core.codec import TensorSpec
from common.core.config import CoordinatorSettings
from common.core.errors import StateError, ValidationError
from common.models.architecture import architecture_from_study
from common.privacy.budget import BudgetReport
from common.releases.bundle import (
    ModelBundle,
    PrivacyCard,
    QueryRun,
    SecAggCard,
    SitePrivacy,
    Threshold,
    parameters_from_flat,
    threshold_from_histogram,
    write_bundle,
)
from coordinator import hospital_sum, queries
from coordinator.study_run import StudyRun

log = logging.getLogger("medfed.coordinator")


def queries_before(state: Path, round_number: int) -> tuple[QueryRun, ...]:
    """The queries answered before the model of `round_number`, for its privacy card."""
    out = []
    for answered in queries.answered_before(state, round_number):
        try:
            out.append(QueryRun.model_validate(answered))
        except pydantic.ValidationError as exc:
            log.warning("query %s not named on the privacy card: %s",
                        answered.get("sha256"), exc.errors()[0]["msg"])
    return tuple(out)


def write_round_bundle(
    run: StudyRun,
    *,
    round_number: int,
    layout: tuple[TensorSpec, ...],
    flat: np.ndarray,
    settings: CoordinatorSettings,
    budgets: list[BudgetReport],
    final: bool,
    secagg: tuple[int, int] = (0, 0),
    hospital_epsilons: Mapping[str, tuple[float, float] | hospital_sum.HospitalEpsilons]
    | None = None,
) -> Path:
    """Write the bundle of the global model after `round_number` (and, when `final`,
    STATE/model/final.safetensors); returns its path."""
    if run.statistics is None:
        raise StateError("no statistics yet: a bundle needs the global preprocessing")
    study = run.study
    bins = settings.aggregation.histogram_bins
    if study.study.task != "binary":
        threshold = Threshold(value=None, method="argmax")
    elif run.last_histogram is not None and run.last_histogram.sum() > 0:
        threshold = threshold_from_histogram(
            run.last_histogram, bins=bins, evaluation=run.last_evaluation,
            edges=run.last_edges[0] if run.last_edges else None,
        )
    else:
        threshold = Threshold(value=0.5, method="fixed")
    agg = settings.aggregation
    # Hospital-level DP: both guarantees named plainly (coordinator.hospital_sum).
    group_guarantees, hospital_notes = hospital_sum.card_parts(study, hospital_epsilons or {})
    card = PrivacyCard(
        unit=study.privacy.unit,
        accountant="per-site ledger",
        group_guarantees=group_guarantees,
        record_level=hospital_sum.card_record_level(study),
        budget_charge=hospital_sum.card_budget_charge(study),
        mechanisms=hospital_sum.card_mechanisms(study) or (
            "sampled-gaussian (DP-SGD, per-unit clipping)",
            "distributed-discrete-gaussian (federated statistics, once per study)",
        ),
        rounds=round_number,
        sites=tuple(
            SitePrivacy(site=row.site_id, epsilon=row.spent_epsilon, delta=row.delta)
            for row in budgets
        ),
        secagg=SecAggCard(
            threshold=max(1, secagg[0]),
            neighbours=secagg[1] or None,
            max_colluding_sites=agg.max_colluding_sites,
            ring_bits=32,
            clip=agg.clip,
        ) if agg.secure_aggregation else None,
        statistics_release=run.statistics.source,
        queries=queries_before(settings.state, round_number),
        notes=("SecAgg+ threshold and neighbours of the last round (neighbours none: "
               "complete graph)", *hospital_notes),
    )
    bundle = ModelBundle(
        study=study,
        architecture=architecture_from_study(study),
        statistics=run.statistics,
        threshold=threshold,
        card=card,
        parameters=parameters_from_flat([(s.name, s.shape) for s in layout], flat),
        round=round_number,
        final=final,
    )
    run.model_dir.mkdir(parents=True, exist_ok=True)
    path = run.model_dir / f"round-{round_number:06d}.safetensors"
    write_bundle(path, bundle)
    if final:
        write_bundle(run.final_path, bundle)
        log.info("final model stored at %s", run.final_path)
    return path


def final_bundle(run: StudyRun | None, study_sha256: bytes, *, finished: bool) -> bytes:
    """The bytes of the finished study's final bundle, for the site that names it."""
    if run is None:
        raise StateError("this coordinator runs no study: there is no final model")
    if study_sha256 != bytes.fromhex(run.sha256):
        raise ValidationError("study_sha256 names another study")
    if not finished or not run.final_path.exists():
        raise StateError("the study has not finished: no final model yet")
    try:
        return run.final_path.read_bytes()
    except OSError as exc:
        raise StateError(f"final model unreadable: {exc.strerror}") from None
