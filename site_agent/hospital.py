"""A site's side of a hospital-level DP round
(`common.privacy.hospital`): plan the ring and this site's noise share from the study,
the announcement and the site's own policy, then encode the clipped update.

The DDGauss mechanism goes on the ledger with the round's other training mechanisms,
write-ahead (site_agent.training_round reserves it before training starts), so the spend is on
disk before the update exists, let alone leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common import egress
from common.config import SitePolicySection
from common.crypto.random import numpy_generator, system_random
from common.errors import RoundFailed
from common.privacy import hospital
from common.privacy.ddgauss import DDGaussPlan
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.round import VerifiedRound, validate_intermediaries
from common.study import Study
from site_agent import dp_release
from site_agent.hooks import LocalUpdate


@dataclass(frozen=True)
class HospitalRound:
    plan: DDGaussPlan
    seed: bytes
    mechanism: DistributedDiscreteGaussian
    units: int = 1  # intermediaries announced: at most this many
    terms: hospital.HospitalTerms | None = None  # the round's (norm segment, v)


def plan_round(rnd: VerifiedRound, *, study: Study | None,
               policy: SitePolicySection) -> HospitalRound:
    """This site's plan for hospital round `rnd`; RoundFailed when the announcement
    does not match the study the site joined (clip S, ring width)."""
    ann = rnd.announcement
    terms = hospital.announced_terms(ann)
    if study is not None:
        if study.privacy.unit != "hospital":
            raise RoundFailed("a hospital-level round in a study of another privacy unit")
        expected = hospital.study_terms(study)
        if (terms.clip, terms.noise_multiplier) != (expected.clip, expected.noise_multiplier):
            raise RoundFailed(
                f"announced S = {terms.clip:g}, z = {terms.noise_multiplier:g} are not the "
                f"study's ({expected.clip:g}, {expected.noise_multiplier:g})"
            )
        # v: the study's fixed one, or under "auto" the announced one (its range and
        # the norm segment were checked by common.round.validate_intermediaries).
        validate_intermediaries(ann, study=study)
        terms = expected.for_round(terms.intermediaries) if expected.norm_segment else expected
    # Without a study the announced terms are taken as they come: the ledger records
    # the mechanism they make, and the budget check refuses a round that costs too much.
    ring = hospital.ring_plan(terms, dim=ann.model_elements, max_sites=len(ann.participants))
    if hospital.vector_words(ring) != egress_words(rnd):
        raise RoundFailed("the announced update segment does not match this site's ring plan")
    n_noise = dp_release.evaluation_noise_sites(
        policy, threshold=ann.threshold, secure=ann.secure_aggregation, study=study
    )
    plan = hospital.site_plan(ring, n_noise=n_noise)
    seed = hospital.rotation_seed(
        round_nonce=ann.round_nonce, study_sha256=ann.study_sha256,
        round_number=ann.round_number,
    )
    # The ledger records the announced v: a site that trains fewer (its DP count allows
    # fewer under "auto", hooks.DpTrainingHook) is then covered conservatively.
    units = terms.intermediaries
    return HospitalRound(plan, seed, hospital.mechanism(plan, units=units), units, terms)


def require_hospital_round(rnd: VerifiedRound, *, hospital_mode: bool) -> None:
    """A site that trains under hospital-level DP (no DP-SGD beneath) refuses a plain
    training round: its update would leave without any DP noise. (A coordinator that
    announced one could otherwise collect an un-noised sum.)"""
    if hospital_mode and rnd.plan.local_epochs > 0 and not rnd.announcement.is_hospital:
        raise RoundFailed(
            f"round {rnd.number} is a plain training round, but this site trains under "
            "hospital-level DP only (privacy unit hospital): refusing to send an un-noised "
            "update"
        )


def egress_words(rnd: VerifiedRound) -> int:
    manifest = rnd.announcement.manifest()
    part = manifest.slice_of(egress.HOSPITAL_UPDATE)
    return int(part.stop) - int(part.start)


def encode(rnd: VerifiedRound, update: LocalUpdate, planned: HospitalRound) -> np.ndarray:
    """The upload of a hospital round: DDGauss ring words, weight, score histogram."""
    ann = rnd.announcement
    if update.delta.size != ann.model_elements:
        raise RoundFailed("update does not match the model size")
    terms = planned.terms
    trained = len(update.units) if update.units else 1
    fixed = terms is None or not terms.norm_segment
    if trained > planned.units or (fixed and planned.units > 1 and trained != planned.units):
        raise RoundFailed(
            f"trained {trained} intermediaries, the round asks for {planned.units}"
        )
    if update.units:
        words = hospital.encode_units(
            update.units, plan=planned.plan, seed=planned.seed, rng=system_random,
            terms=terms,
        )
    else:
        words = hospital.encode_update(
            update.delta, plan=planned.plan, seed=planned.seed, rng=system_random,
            terms=terms,
        )
    return ann.manifest().encode(
        {
            egress.HOSPITAL_UPDATE: words,
            # Each unit counts once in the mean: the weight says only how many units
            # this hospital trained (the announced v, or fewer under "auto" when its DP
            # patient count allows fewer: post-processing of that release).
            egress.WEIGHT: [trained],
            egress.EVALUATION_HISTOGRAM: np.asarray(update.histogram, dtype=np.int64),
        },
        clip=ann.clip,
        bits=ann.quantization_bits,
        n_sites=len(rnd.params.participants) if rnd.params else 2,
        rng=numpy_generator(system_random),
    )
