"""A site's side of a hospital-level DP round
(`common.privacy.hospital`): plan the ring and this site's noise share from the study,
the announcement and the site's own policy, then encode the clipped update.

The DDGauss mechanism goes on the ledger with the round's other training mechanisms,
write-ahead (site_agent.training_round reserves it before training starts), so the spend is on
disk before the update exists, let alone leaves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.core.config import SitePolicySection
from common.core.errors import BudgetExhausted, RoundFailed
from common.crypto.random import numpy_generator, system_random
from common.privacy import hospital
from common.privacy.ddgauss import DDGaussPlan
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.releases import egress
from common.rounds.announcement import VerifiedRound, announced_terms, validate_intermediaries
from common.study import Study, per_round_cap
from common.study.hospital_terms import study_terms
from common.study.policy import ROUND_CAP_SLACK
from site_agent import dp_release
from site_agent.site_training import LocalUpdate

if TYPE_CHECKING:
    from common.privacy.ledger import PrivacyLedger


@dataclass(frozen=True)
class HospitalRound:
    plan: DDGaussPlan
    seed: bytes
    mechanism: DistributedDiscreteGaussian
    units: int = 1  # intermediaries announced: at most this many
    terms: hospital.HospitalTerms | None = None  # the round's (norm segment, v)
    # What the same round at the site's own noise multiplier is built from
    # (`check_round_cap`): the honest noise shares, the model size, the round's sites
    # and the rounds the coordinator announced.
    n_noise: int = 1
    dim: int = 0
    max_sites: int = 0
    announced_rounds: int = 1


def plan_round(rnd: VerifiedRound, *, study: Study | None,
               policy: SitePolicySection) -> HospitalRound:
    """This site's plan for hospital round `rnd`; RoundFailed when the announcement
    does not match the study the site joined (clip S, ring width)."""
    ann = rnd.announcement
    terms = announced_terms(ann)
    if study is not None:
        if study.privacy.unit != "hospital":
            raise RoundFailed("a hospital-level round in a study of another privacy unit")
        expected = study_terms(study)
        if (terms.clip, terms.noise_multiplier) != (expected.clip, expected.noise_multiplier):
            raise RoundFailed(
                f"announced S = {terms.clip:g}, z = {terms.noise_multiplier:g} are not the "
                f"study's ({expected.clip:g}, {expected.noise_multiplier:g})"
            )
        # v: the study's fixed one, or under "auto" the announced one (its range and
        # the norm segment were checked by common.rounds.announcement.validate_intermediaries).
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
    return HospitalRound(plan, seed, hospital.mechanism(plan, units=units), units, terms,
                         n_noise=n_noise, dim=ann.model_elements,
                         max_sites=len(ann.participants), announced_rounds=ann.planned_rounds)


def own_noise_multiplier(
    study: Study | None, *, policy: SitePolicySection, announced_rounds: int,
    budget_epsilon: float, delta: float,
) -> float:
    """z of this site's own plan for a hospital round: the study's privacy.epsilon (after
    its statistics and count releases and the evaluation reserve) over the study's rounds,
    whatever z the study or the coordinator names (`study_terms` with z unset);
    without a study the site's budget over its planned rounds (raised, never lowered, by
    the announcement)."""
    if study is not None:
        planned = study.model_copy(update={"privacy": study.privacy.model_copy(
            update={"update_noise_multiplier": None})})
        return study_terms(planned).noise_multiplier
    rounds = max(policy.planned_rounds, announced_rounds)
    # The site's hospital-unit ledger charges the per-patient figure (rounds at 2S).
    return hospital.plan_noise_multiplier(
        epsilon=budget_epsilon * (1 - hospital.EVALUATION_RESERVE), delta=delta, rounds=rounds,
        sensitivity=hospital.PER_PATIENT_SENSITIVITY)


def check_round_cap(
    ledger: PrivacyLedger, planned: HospitalRound, *, number: int,
    study: Study | None, policy: SitePolicySection,
) -> float:
    """The epsilon this hospital round adds to the ledger's history; BudgetExhausted,
    before anything is reserved, when it exceeds the per-round cap: the smaller of the
    site's and the study's `max_epsilon_per_round` when either is set, else what the same
    round costs at the noise multiplier of the site's own plan (`own_noise_multiplier`),
    so a study or a coordinator naming a smaller z cannot spend the budget in one round."""
    from common.privacy.accountant import epsilon_added

    history = ledger.history()

    def added(mechanism: DistributedDiscreteGaussian) -> float:
        return epsilon_added(history, mechanism, delta=ledger.delta,
                             accountant=ledger.accountant)

    cost = added(planned.mechanism)
    capped, capped_by = per_round_cap(study, site_cap=policy.max_epsilon_per_round)
    if capped is not None:
        cap, source = capped, capped_by
    else:
        if planned.terms is None:
            raise RoundFailed("a hospital round without its terms")
        own_z = own_noise_multiplier(
            study, policy=policy, announced_rounds=planned.announced_rounds,
            budget_epsilon=ledger.budget_epsilon, delta=ledger.delta)
        own = dataclasses.replace(planned.terms, noise_multiplier=own_z)
        ring = hospital.ring_plan(own, dim=planned.dim, max_sites=planned.max_sites)
        own_mechanism = hospital.mechanism(hospital.site_plan(ring, n_noise=planned.n_noise),
                                           units=planned.units)
        cap, source = added(own_mechanism), f"a round of this site's own plan, z = {own_z:.4g}"
    if cost > cap + ROUND_CAP_SLACK:
        raise BudgetExhausted(
            f"hospital round {number} would add epsilon {cost:.4g} to this site's ledger, "
            f"more than the per-round cap {cap:.4g} ({source}): its noise multiplier "
            f"{planned.terms.noise_multiplier if planned.terms else 0:g} is below what "
            "this site's plan allows for one round"
        )
    return cost


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
