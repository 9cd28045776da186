"""The coordinator's side of hospital-level DP rounds: announce a
training round of a `privacy.unit = "hospital"` study as a HOSPITAL round, and decode
its unmasked sum (KLS21 Algorithm 2, `common.privacy.hospital.decode_sum`).

The coordinator never sees an un-noised sum: the sites add the discrete Gaussian shares
in the ring before masking. The mean is the noisy sum over the hospitals that
contributed (each counts once; weighting by size would raise the sensitivity above S).

Adaptive intermediaries (Jiang et al., MICCAI 2023): under
``privacy.intermediaries = "auto"`` each round's decoded sum carries the noisy sum of the
clipped unit norms (the norm coordinate, common/privacy/hospital.py); `decode` evaluates
the authors' rule on it (`common.privacy.intermediaries.next_split_count`) and the
coordinator announces that v in the next hospital round (RoundAnnouncement field 27).
Round one announces `AUTO_START_INTERMEDIARIES`; v stays in [1, MAX_AUTO_INTERMEDIARIES].
The v of every round and the next one are in the round's metrics (store, round event),
so a restarted coordinator continues with it (`coordinator.training_round`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Literal, NamedTuple

import numpy as np

from common.core.config import AggregationSection
from common.core.errors import ConfigError, ValidationError
from common.privacy import hospital
from common.privacy.hospital import HospitalTerms
from common.privacy.intermediaries import (
    PLAUSIBLE_NORM_SIGMAS,
    next_split_count,
    plausible_norm_sum,
)
from common.privacy.replica import LedgerReplica
from common.releases.bundle import GroupGuarantee
from common.releases.egress import EVALUATION_HISTOGRAM, HOSPITAL_UPDATE, WEIGHT
from common.releases.seam import KIND_HOSPITAL, KIND_TRAINING
from common.rounds.announcement import Announcement, announced_terms
from common.study import Study
from common.study.hospital_terms import intermediaries_cap, study_terms
from coordinator.aggregation import DecodedSum, evaluation_edges, evaluation_metrics

log = logging.getLogger("medfed.coordinator")


def terms_for(
    study: Study | None, settings: AggregationSection, *, intermediaries: int | None = None,
) -> HospitalTerms | None:
    """The hospital-level terms of this federation: the study's (privacy.unit =
    "hospital"), else the coordinator's own [aggregation] hospital_* settings, else None.
    `intermediaries`: the v chosen for the next round under "auto" (ignored otherwise)."""
    if study is not None:
        if study.privacy.unit != "hospital":
            return None
        terms = study_terms(study)
        if terms.norm_segment and intermediaries is not None:
            cap = intermediaries_cap(study) or 1
            terms = terms.for_round(min(max(intermediaries, 1), cap))
        return terms
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
                               hospital_noise_multiplier=terms.noise_multiplier,
                               hospital_intermediaries=terms.intermediaries,
                               hospital_norm_segment=terms.norm_segment)


def decode(
    aggregate: np.ndarray, *, ann: Announcement, count: int, histogram_classes: int = 1,
    terms: HospitalTerms | None = None, cap: int | None = None,
    noise_std: float | None = None,
) -> DecodedSum:
    """The float32 mean of the clipped, noised units (hospitals, or their
    intermediaries) of the `count` contributing hospitals, with the round's DP
    evaluation metrics. `terms`: this federation's; default the announced ones. With
    the norm segment ("auto"), metrics["next_intermediaries"] is the rule's v for the
    next round, at most `cap` (default `MAX_AUTO_INTERMEDIARIES`). `noise_std`: the
    evaluation's (`aggregation.evaluation_metrics`)."""
    if not ann.is_hospital:
        raise ValidationError("not a hospital-level round")
    if count < 1:
        raise ValidationError("no hospital contributed")
    terms = round_terms(ann, terms)
    total, norm_sum, integers = decode_ring_sum(aggregate, ann=ann, terms=terms)
    weight_sum = max(int(integers[WEIGHT][0]), 0)
    units = unit_count(weight_sum, count=count, terms=terms, round_number=ann.round_number)
    weight_plausible = units == weight_sum
    metrics: dict[str, float] = {
        "contributors": float(count),
        "units": float(units),
        "hospital_noise_std": terms.noise_multiplier * terms.sensitivity / units,
        "intermediaries": float(terms.intermediaries),
    }
    edges = evaluation_edges(
        ann.histogram_edges, bins=ann.histogram_bins, classes=histogram_classes)
    histogram = evaluation_metrics(
        integers[EVALUATION_HISTOGRAM], edges=edges, classes=histogram_classes,
        metrics=metrics, noise_std=noise_std, interval_seed=ann.round_number,
    )
    mean = (total / units).astype(np.float32)
    if norm_sum is not None:
        metrics.update(next_intermediaries(
            mean, norm_sum=norm_sum, terms=terms, units=units, count=count,
            weight_plausible=weight_plausible, round_number=ann.round_number,
            maximum=cap if cap is not None else hospital.MAX_AUTO_INTERMEDIARIES,
        ))
    return DecodedSum(mean, weight_sum, metrics, histogram, edges)


def round_terms(ann: Announcement, terms: HospitalTerms | None) -> HospitalTerms:
    """The terms the round ran under: the announced ones, or this federation's `terms`
    at the announced v once they agree with the announcement (ValidationError if not)."""
    announced = announced_terms(ann)
    if terms is None:
        return announced
    if (terms.clip, terms.noise_multiplier, terms.norm_segment) != (
            announced.clip, announced.noise_multiplier, announced.norm_segment):
        raise ValidationError("the round was announced with other hospital-level terms")
    return terms.for_round(announced.intermediaries)  # the v this round ran with


def decode_ring_sum(
    aggregate: np.ndarray, *, ann: Announcement, terms: HospitalTerms,
) -> tuple[np.ndarray, float | None, Mapping[str, np.ndarray]]:
    """(the noisy sum of the units' updates, the noisy sum of their clipped norms (None
    without the norm segment), the manifest's integer parts) of the unmasked ring
    `aggregate` (KLS21 Algorithm 2, `common.privacy.hospital.decode_sum`, with the
    round's rotation). ValidationError when it does not fit the round's manifest."""
    ring = hospital.ring_plan(terms, dim=ann.model_elements, max_sites=len(ann.participants))
    manifest = ann.manifest()
    if aggregate.dtype != np.uint32 or aggregate.size != manifest.vector_length:
        raise ValidationError("aggregate does not match the hospital round's manifest")
    seed = hospital.rotation_seed(
        round_nonce=ann.round_nonce, study_sha256=ann.study_sha256,
        round_number=ann.round_number,
    )
    total, norm_sum = hospital.split_norm_sum(
        hospital.decode_sum(aggregate[manifest.slice_of(HOSPITAL_UPDATE)], plan=ring,
                            seed=seed),
        terms=terms)
    return total, norm_sum, manifest.decode_integers(aggregate)


def unit_count(weight_sum: int, *, count: int, terms: HospitalTerms, round_number: int) -> int:
    """The units the mean divides by: the sites' summed unit counts (1..v each: a site
    under "auto" may train fewer than announced), range-checked (L3). Out of
    [count, count * v] a site lied: the nearest bound, logged (and the caller then
    measures no v)."""
    units = min(max(weight_sum, count), count * terms.intermediaries)
    if units != weight_sum:
        log.warning(
            "round %d: the summed unit count %d is outside [%d, %d] (%d hospitals, v = "
            "%d): the mean divides by %d and the round does not choose the next v",
            round_number, weight_sum, count, count * terms.intermediaries, count,
            terms.intermediaries, units,
            extra={"event": "hospital_units_out_of_range", "round_number": round_number,
                   "weight_sum": weight_sum, "units": units},
        )
    return units


def next_intermediaries(
    mean: np.ndarray, *, norm_sum: float, terms: HospitalTerms, units: int, count: int,
    weight_plausible: bool, round_number: int, maximum: int,
) -> dict[str, float]:
    """The round's metrics under adaptive intermediaries: the decoded unit norm sum,
    whether it was a credible measurement, and the v for the next round, chosen by the
    rule of Jiang et al. (MICCAI 2023, `common.privacy.intermediaries.next_split_count`)
    from a credible measurement, else the current v (within [1, `maximum`])."""
    # The norm sum's noise in decoded units: the plan's z S' on the sum, / c.
    norm_std = terms.noise_multiplier * terms.sensitivity / hospital.NORM_SEGMENT_SCALE
    measured = weight_plausible and plausible_norm_sum(
        norm_sum, norm_noise_std=norm_std, units=units, clip=terms.clip)
    if measured:
        chosen = next_split_count(
            mean_update=mean,
            mean_noise_std=terms.noise_multiplier * terms.sensitivity / units,
            unit_norm_sum=norm_sum, norm_noise_std=norm_std, units=units,
            clip=terms.clip, hospitals=count, current=terms.intermediaries,
            maximum=maximum)
    else:
        chosen = min(max(terms.intermediaries, 1), maximum)
        if weight_plausible:
            log.warning(
                "round %d: decoded unit norm sum %.4g is not credibly in [0, %.4g] "
                "(%g sigma of its noise, %.4g): no measurement, v stays %d",
                round_number, norm_sum, units * terms.clip, PLAUSIBLE_NORM_SIGMAS,
                norm_std, chosen,
                extra={"event": "intermediaries_measurement_rejected",
                       "round_number": round_number, "unit_norm_sum": norm_sum,
                       "next_intermediaries": chosen},
            )
    return {"unit_norm_sum": norm_sum, "intermediaries_measured": float(measured),
            "next_intermediaries": float(chosen)}


class HospitalEpsilons(NamedTuple):
    """One site's three hospital-mode figures as its replicated ledger shows them
    (`common.privacy.hospital.Guarantees`)."""

    epsilon: float  # hospital level: add/remove one hospital, each round at its own v
    delta: float
    intermediary: float | None = None  # add/remove one intermediary (S); None: as epsilon
    largest_v: int = 1
    per_patient: float | None = None  # every release, updates at 2S (or the DP-SGD path)


def replica_epsilons(replica: LedgerReplica) -> dict[str, HospitalEpsilons]:
    """Each site's hospital-level, intermediary-level and per-patient epsilon, delta and
    largest v, recomposed from the signed ledger entries the coordinator replicates (for
    the model card)."""
    out: dict[str, HospitalEpsilons] = {}
    for site in replica.sites():
        history = replica.history(site)
        terms = history.terms
        if terms.privacy_unit != "hospital":
            continue
        pairs = [(e.purpose, e.mechanisms) for e in history.entries]
        figures = hospital.guarantees(pairs, delta=terms.delta, accountant=terms.accountant)
        out[site] = HospitalEpsilons(figures.hospital, terms.delta, figures.intermediary,
                                     figures.largest_v, figures.per_patient)
    return out


def card_budget_charge(study: Study) -> Literal["record_level"] | None:
    """What a hospital-level study's sites charge their budgets with: the per-patient
    figure (their ledgers' `charge = "record_level"`, `site_agent.runner.open_ledger`);
    None outside hospital mode."""
    return "record_level" if study.privacy.unit == "hospital" else None


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
    study: Study, epsilons: Mapping[str, tuple[float, float] | HospitalEpsilons]
) -> tuple[tuple[GroupGuarantee, ...], tuple[str, ...]]:
    """(group guarantees, notes) naming the three figures of a hospital-level study per
    site: unit "hospital" (add/remove one hospital, model updates only, v-fold group
    privacy when split), unit "intermediary" (add/remove one intermediary, S) and unit
    "patient" (or "record"; every release, the model updates at 2S or the DP-SGD path).
    `sites[].epsilon` is what each site's budget is charged with."""
    if study.privacy.unit != "hospital":
        return (), ()
    terms = study_terms(study)
    beneath = card_record_level(study)
    guarantees: list[GroupGuarantee] = []
    for site, row in sorted(epsilons.items()):
        entry = HospitalEpsilons(*row)
        if terms.norm_segment:
            split = (f", adaptive intermediaries (v per round from the rule of Jiang et "
                     f"al. 2023, largest v {entry.largest_v}): each round v-fold group "
                     "privacy of the intermediary-level guarantee")
        elif terms.intermediaries > 1:
            split = (f", {terms.intermediaries} intermediaries: {terms.intermediaries}-fold "
                     "group privacy of the intermediary-level guarantee")
        else:
            split = ""
        guarantees.append(GroupGuarantee(
            unit="hospital", epsilon=entry.epsilon, delta=entry.delta,
            note=(f"site {site}: add/remove one hospital, model updates only (clip S = "
                  f"{terms.clip:g}, noise multiplier {terms.noise_multiplier:.3g}{split}); "
                  "statistics, evaluation histograms and the cohort count are bounded per "
                  "patient"),
        ))
        unit_epsilon = entry.epsilon if entry.intermediary is None else entry.intermediary
        guarantees.append(GroupGuarantee(
            unit="intermediary", epsilon=unit_epsilon, delta=entry.delta,
            note=(f"site {site}: add/remove one intermediary (a unit clipped to S), model "
                  "updates only" + ("" if entry.largest_v > 1 else
                                    "; v = 1: the intermediary is the whole hospital")),
        ))
        if entry.per_patient is not None:
            guarantees.append(GroupGuarantee(
                unit=beneath or "patient", epsilon=entry.per_patient, delta=entry.delta,
                note=(f"site {site}: per-{beneath or 'patient'}, every release: "
                      + ("the better of the DP-SGD path and the model updates at 2S "
                         "(replace relation)" if beneath else
                         "a patient added or removed inside a hospital/intermediary that "
                         "stays in the round moves its update by up to 2S (replace "
                         "relation)")),
            ))
    notes = (
        "hospital-level DP, three figures per site (group_guarantees): unit hospital and "
        "unit intermediary cover the MODEL UPDATES ONLY; unit " + (beneath or "patient")
        + " is the per-" + (beneath or "patient") + " epsilon of every release. " + (
            f"sites[].epsilon is what each budget is charged with: the larger of the "
            f"{beneath}-level epsilon (the better of the DP-SGD history composed with "
            "every other release and the hospital-level rounds at the replace relation "
            "composed with them) and the hospital-level composition (every release, the "
            "model updates at add/remove one hospital), so the budget caps both "
            "(docs/privacy.md)"
            if beneath else
            "sites[].epsilon is what each site's budget is charged with: the per-patient "
            "epsilon (every release, the model updates at 2S, replace relation), which "
            "the study's epsilon plans the noise for; the budget therefore bounds every "
            "patient, and the intermediary-level figure with it (docs/privacy.md, "
            "section 7)"),
    )
    return tuple(guarantees), notes
