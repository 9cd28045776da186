"""The coordinator's guards on the "auto" intermediaries measurement (s5 review H3, L3;
Jiang et al., MICCAI 2023 for the rule itself): the decoded norm sum is linear in the
ring, so a sum outside what honest noise explains is no measurement (v stays), v moves
by at most x2 or /2 per round, and a summed unit count outside [hospitals, hospitals * v]
measures nothing either. Post-processing only: nothing here changes a privacy cost."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from common.core.config import SitePolicySection
from common.core.modelfile import flat_layout
from common.crypto.random import DeterministicRandom, numpy_generator, system_random
from common.privacy import hospital
from common.privacy.ddgauss import ddgauss_round
from common.privacy.intermediaries import (
    PLAUSIBLE_NORM_SIGMAS,
    expected_noise_norm,
    next_split_count,
    plausible_norm_sum,
    split_count,
    step_bounds,
)
from common.releases import egress
from common.rounds.announcement import Announcement, validate_for_site
from coordinator import hospital_sum
from coordinator.aggregation import DecodedSum
from site_agent import hospital as site_hospital
from site_agent.site_training import LocalUpdate

SITES = ("alpha", "beta", "mallory")
DIM, Z, CLIP, V = 400, 0.3, 0.5, 8
MAX = hospital.MAX_AUTO_INTERMEDIARIES


def _rule_inputs(units: int) -> dict[str, float | int | np.ndarray]:
    mean = np.full(DIM, 0.01)
    return {"mean_update": mean, "mean_noise_std": 0.02, "units": units, "clip": CLIP,
            "hospitals": 3, "maximum": MAX}


def test_implausible_norm_sums_keep_v() -> None:
    sigma, units = 0.6, 24
    assert plausible_norm_sum(5.0, norm_noise_std=sigma, units=units, clip=CLIP)
    for bad in (-1e9, -1.0, 0.0, PLAUSIBLE_NORM_SIGMAS * sigma,  # not credibly above 0
                units * CLIP + PLAUSIBLE_NORM_SIGMAS * sigma + 1e-6, 1e12,  # above U S + k sigma
                math.nan, math.inf, -math.inf):
        assert not plausible_norm_sum(bad, norm_noise_std=sigma, units=units, clip=CLIP)
        for current in (1, 3, MAX):
            assert next_split_count(unit_norm_sum=bad, norm_noise_std=sigma, current=current,
                                    **_rule_inputs(units)) == current  # type: ignore[arg-type]


def test_plausible_sums_follow_the_rule_within_the_step_limit() -> None:
    sigma, units = 0.6, 24
    assert step_bounds(1, maximum=MAX) == (1, 2)
    assert step_bounds(3, maximum=MAX) == (1, 6)
    assert step_bounds(8, maximum=MAX) == (4, 8)
    assert step_bounds(5, maximum=4) == (2, 4)
    inputs = _rule_inputs(units)
    noise_norm = expected_noise_norm(std=0.02, dim=DIM)
    seen_free = seen_limited = False
    for norm_sum in np.linspace(2.0, units * CLIP, 25):
        for current in (1, 2, 4, 8):
            paper = split_count(noise_norm=noise_norm,
                                aggregate_norm=float(np.linalg.norm(inputs["mean_update"])),
                                unit_norm_sum=float(norm_sum), hospitals=3, current=current,
                                maximum=MAX)
            low, high = step_bounds(current, maximum=MAX)
            chosen = next_split_count(unit_norm_sum=float(norm_sum), norm_noise_std=sigma,
                                      current=current, **inputs)  # type: ignore[arg-type]
            assert chosen == min(max(paper, low), high)
            seen_free |= low <= paper <= high
            seen_limited |= not low <= paper <= high
    assert seen_free and seen_limited  # both branches were exercised
    # Between U S and U S + k sigma: projected onto U S (the true sum's largest value).
    over = units * CLIP + sigma
    assert next_split_count(unit_norm_sum=over, norm_noise_std=sigma, current=4,
                            **inputs) == next_split_count(  # type: ignore[arg-type]
        unit_norm_sum=units * CLIP, norm_noise_std=sigma, current=4, **inputs)  # type: ignore[arg-type]


def _announcement(dim: int = DIM) -> Announcement:
    return Announcement(
        round_number=4, round_nonce=bytes(range(16)), participants=SITES, threshold=3,
        neighbours=0, vector_length=dim + 1 + 4, quantization_bits=20, clip=1.0,
        histogram_bins=2, secure_aggregation=True, model_layout=flat_layout(dim),
        model_sha256=bytes(32), model_bytes=4 * dim, local_epochs=1, learning_rate=0.1,
        fedprox_mu=0.0, planned_rounds=5, train_deadline_ms=1_700_000_000_000,
        phase_timeout_ms=30_000, weight_cap=100,
    )


def _honest_words(ann: Announcement, site: str, seed: int) -> np.ndarray:
    policy = SitePolicySection()
    rnd = validate_for_site(ann, policy=policy, site_id=site)
    planned = site_hospital.plan_round(rnd, study=None, policy=policy)
    generator = np.random.default_rng(seed)
    units = tuple((generator.standard_normal(DIM) * (s / math.sqrt(DIM))).astype(np.float32)
                  for s in np.linspace(0.3, 2.0, V))
    update = LocalUpdate(np.sum(units, axis=0), 50, np.array([1, 2, 3, 4]), 0.0, units=units)
    return site_hospital.encode(rnd, update, planned)


def _forged_words(ann: Announcement, *, k: int, weight: int) -> np.ndarray:
    """One unit's norm coordinate (c S, nothing else) rounded without noise, times k in
    the ring (k < 0: negated), with the weight the site chooses: only the ring's
    linearity is used."""
    policy = SitePolicySection()
    rnd = validate_for_site(ann, policy=policy, site_id="mallory")
    planned = site_hospital.plan_round(rnd, study=None, policy=policy)
    plan = planned.plan
    vector = np.zeros(ann.model_bytes // 4 + 1)
    vector[-1] = hospital.NORM_SEGMENT_SCALE * CLIP
    rounded = ddgauss_round(vector, plan=plan, rotation_seed=planned.seed,
                            rng=DeterministicRandom(b"m" * 32))
    ring = (k * rounded) & np.int64((1 << plan.bits) - 1)
    words = hospital.to_limbs(ring.astype(np.uint64), bits=plan.bits, max_sites=plan.max_sites)
    return ann.manifest().encode(
        {egress.HOSPITAL_UPDATE: words, egress.WEIGHT: [weight],
         egress.EVALUATION_HISTOGRAM: np.zeros(4, dtype=np.int64)},
        clip=ann.clip, bits=ann.quantization_bits, n_sites=3,
        rng=numpy_generator(system_random),
    )


def _decode(mallory: np.ndarray, ann: Announcement) -> DecodedSum:
    total = np.zeros(ann.vector_length, np.uint32)
    for n, site in enumerate(SITES[:2]):
        total += _honest_words(ann, site, seed=n)
    total += mallory
    return hospital_sum.decode(total, ann=ann, count=3)


@pytest.fixture
def ann() -> Announcement:
    terms = hospital.HospitalTerms(CLIP, Z, intermediaries=V, norm_segment=True)
    return hospital_sum.announce(_announcement(), terms)


def test_a_site_pushing_the_norm_sum_out_of_range_is_logged_and_moves_nothing(
    ann: Announcement, caplog: pytest.LogCaptureFixture,
) -> None:
    honest = _decode(_honest_words(ann, "mallory", seed=2), ann)
    assert honest.metrics["intermediaries_measured"] == 1.0
    assert step_bounds(V, maximum=MAX)[0] <= honest.metrics["next_intermediaries"] <= V
    for k in (-400, 400):  # far below 0, far above U S
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="medfed.coordinator"):
            forged = _decode(_forged_words(ann, k=k, weight=V), ann)
        assert forged.metrics["intermediaries_measured"] == 0.0
        assert forged.metrics["next_intermediaries"] == V  # kept
        (record,) = [r for r in caplog.records
                     if getattr(r, "event", None) == "intermediaries_measurement_rejected"]
        assert record.levelno == logging.WARNING and record.__dict__["round_number"] == 4
        assert "round 4" in record.getMessage()


@pytest.mark.parametrize("weight", [0, V + 1, 10_000])
def test_a_summed_unit_count_out_of_range_measures_nothing(
    ann: Announcement, weight: int, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="medfed.coordinator"):
        decoded = _decode(_forged_words(ann, k=1, weight=weight), ann)
    total = 2 * V + weight
    assert decoded.weight_sum == total
    assert decoded.metrics["units"] == min(max(total, 3), 3 * V)
    if 3 <= total <= 3 * V:
        assert decoded.metrics["intermediaries_measured"] == 1.0
        return
    assert decoded.metrics["intermediaries_measured"] == 0.0
    assert decoded.metrics["next_intermediaries"] == V
    assert any(getattr(r, "event", None) == "hospital_units_out_of_range"
               and r.__dict__["round_number"] == 4 for r in caplog.records)
