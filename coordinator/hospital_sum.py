"""The coordinator's side of hospital-level DP rounds (issue 13, section 1): announce a
training round of a `privacy.unit = "hospital"` study as a HOSPITAL round, and decode
its unmasked sum (KLS21 Algorithm 2, `common.privacy.hospital.decode_sum`).

The coordinator never sees an un-noised sum: the sites add the discrete Gaussian shares
in the ring before masking. The mean is the noisy sum over the hospitals that
contributed (each counts once; weighting by size would raise the sensitivity above S).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import numpy as np

from common.bundle import GroupGuarantee
from common.config import AggregationSection
from common.egress import EVALUATION_HISTOGRAM, HOSPITAL_UPDATE, WEIGHT
from common.errors import ConfigError, ValidationError
from common.evaluation import clipped_noisy_histogram, operating_point_metrics
from common.privacy import hospital
from common.privacy.hospital import HospitalTerms, announced_terms
from common.privacy.replica import LedgerReplica
from common.round import KIND_HOSPITAL, KIND_TRAINING, Announcement
from common.study import Study
from coordinator.aggregation import DecodedSum, multiclass_round_metrics


def terms_for(study: Study | None, settings: AggregationSection) -> HospitalTerms | None:
    """The hospital-level terms of this federation: the study's (privacy.unit =
    "hospital"), else the coordinator's own [aggregation] hospital_* settings, else None."""
    if study is not None:
        return hospital.study_terms(study) if study.privacy.unit == "hospital" else None
    if settings.hospital_clip_norm is None:
        return None
    if settings.hospital_noise_multiplier is None:
        raise ConfigError("aggregation.hospital_noise_multiplier",
                          "hospital_clip_norm needs a noise multiplier too")
    return HospitalTerms(settings.hospital_clip_norm, settings.hospital_noise_multiplier)


def announce(ann: Announcement, terms: HospitalTerms | None) -> Announcement:
    """`ann` as a HOSPITAL round under hospital-level `terms` when the round trains;
    otherwise unchanged (the final evaluation-only round stays plain)."""
    if terms is None or ann.kind != KIND_TRAINING or ann.local_epochs == 0:
        return ann
    ring = hospital.ring_plan(terms, dim=ann.model_elements, max_sites=len(ann.participants))
    words = hospital.vector_words(ring)
    vector_length = words + 1 + 2 * ann.histogram_bins
    return dataclasses.replace(ann, kind=KIND_HOSPITAL, clip=terms.clip,
                               vector_length=vector_length,
                               hospital_noise_multiplier=terms.noise_multiplier)


def decode(
    aggregate: np.ndarray, *, ann: Announcement, count: int, histogram_classes: int = 1,
    terms: HospitalTerms | None = None,
) -> DecodedSum:
    """The float32 mean of the clipped, noised units (hospitals, or their
    intermediaries) of the `count` contributing hospitals, with the round's DP
    evaluation metrics. `terms`: this federation's (for its intermediaries per
    hospital); default the announced S and z with one unit per hospital."""
    if not ann.is_hospital:
        raise ValidationError("not a hospital-level round")
    if count < 1:
        raise ValidationError("no hospital contributed")
    announced = announced_terms(ann)
    if terms is None:
        terms = announced
    elif (terms.clip, terms.noise_multiplier) != (announced.clip, announced.noise_multiplier):
        raise ValidationError("the round was announced with other hospital-level terms")
    ring = hospital.ring_plan(terms, dim=ann.model_elements, max_sites=len(ann.participants))
    manifest = ann.manifest()
    if aggregate.dtype != np.uint32 or aggregate.size != manifest.vector_length:
        raise ValidationError("aggregate does not match the hospital round's manifest")
    seed = hospital.rotation_seed(
        round_nonce=ann.round_nonce, study_sha256=ann.study_sha256,
        round_number=ann.round_number,
    )
    total = hospital.decode_sum(aggregate[manifest.slice_of(HOSPITAL_UPDATE)],
                                plan=ring, seed=seed)
    integers = manifest.decode_integers(aggregate)
    weight_sum = max(int(integers[WEIGHT][0]), 0)
    histogram = clipped_noisy_histogram(integers[EVALUATION_HISTOGRAM])
    # Sites send their unit count (1, or the study's v); a short or missing one cannot
    # make the mean divide by less than one unit per hospital.
    units = max(weight_sum, count)
    metrics: dict[str, float] = {
        "contributors": float(count),
        "units": float(units),
        "hospital_noise_std": terms.noise_multiplier * terms.clip / units,
    }
    bins = ann.histogram_bins
    if histogram.sum() > 0 and histogram_classes > 2:
        metrics.update(multiclass_round_metrics(histogram, bins, histogram_classes))
    elif histogram.sum() > 0:
        m = operating_point_metrics(histogram, bins=bins)
        metrics.update(auc=m.auc, sensitivity=m.sensitivity, specificity=m.specificity,
                       ppv=m.ppv, evaluated=float(m.n))
    mean = (total / units).astype(np.float32)
    return DecodedSum(mean, weight_sum, metrics, histogram)


def replica_epsilons(replica: LedgerReplica) -> dict[str, tuple[float, float]]:
    """Each site's hospital-level epsilon (model updates only) and delta, recomposed
    from the signed ledger entries the coordinator replicates (for the model card)."""
    out: dict[str, tuple[float, float]] = {}
    for site in replica.sites():
        history = replica.history(site)
        terms = history.terms
        if terms.privacy_unit != "hospital":
            continue
        pairs = [(e.purpose, e.mechanisms) for e in history.entries]
        out[site] = (hospital.hospital_level_epsilon(
            pairs, delta=terms.delta, accountant=terms.accountant), terms.delta)
    return out


def card_record_level(study: Study) -> Literal["record", "patient"] | None:
    """The unit of DP-SGD beneath hospital-level DP (study privacy.record_level), if any."""
    level = study.privacy.record_level
    return None if level == "none" else level


def card_mechanisms(study: Study) -> tuple[str, ...]:
    """The card's mechanisms under hospital-level DP (empty for record/patient)."""
    if study.privacy.unit != "hospital":
        return ()
    beneath = card_record_level(study)
    return (
        *((f"sampled-gaussian (DP-SGD beneath, {beneath}-level, planned for "
           f"record_epsilon = {study.privacy.record_epsilon:g})",) if beneath else ()),
        "distributed-discrete-gaussian (hospital-level: each site's whole update clipped "
        "to L2 <= S and noised by the sites in the SecAgg+ ring; Kairouz, Liu & Steinke "
        "2021)",
        "distributed-discrete-gaussian (federated statistics, once per study)",
    )


def card_parts(
    study: Study, epsilons: Mapping[str, tuple[float, float]]
) -> tuple[tuple[GroupGuarantee, ...], tuple[str, ...]]:
    """(group guarantees, notes) naming the two guarantees of a hospital-level study:
    `sites[].epsilon` composes every release (a per-patient bound); the hospital-level
    epsilon covers the model updates only."""
    if study.privacy.unit != "hospital":
        return (), ()
    terms = hospital.study_terms(study)
    guarantees = tuple(
        GroupGuarantee(
            unit="hospital", epsilon=epsilon, delta=delta,
            note=(f"site {site}: model updates only (clip S = {terms.clip:g}, noise "
                  f"multiplier {terms.noise_multiplier:.3g}"
                  + (f", {terms.intermediaries} intermediaries: {terms.intermediaries}-fold "
                     "group privacy of the per-intermediary guarantee"
                     if terms.intermediaries > 1 else "")
                  + "); statistics, evaluation histograms and the cohort count are "
                  "bounded per patient"),
        )
        for site, (epsilon, delta) in sorted(epsilons.items())
    )
    beneath = card_record_level(study)
    notes = (
        "hospital-level DP: the group guarantees (unit hospital) cover the MODEL UPDATES "
        "ONLY; " + (
            f"sites[].epsilon is the {beneath}-level epsilon: the better of the DP-SGD "
            "history composed with every other release and the hospital-level rounds "
            "(replace relation) composed with them (docs/privacy.md)" if beneath else
            "sites[].epsilon composes every release and is the per-patient guarantee"),
    )
    return guarantees, notes
