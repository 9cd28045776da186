"""A hospital-level round without processes: the coordinator's announcement,
the site's checks and plan, three sites' encodings summed in the 32-bit ring, and the
coordinator's decode to the mean of the clipped updates plus the planned noise."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from common.core.config import AggregationSection, SitePolicySection
from common.core.errors import RoundFailed, ValidationError
from common.core.modelfile import flat_layout
from common.privacy import hospital
from common.releases.seam import KIND_HOSPITAL
from common.rounds import wire
from common.rounds.announcement import Announcement, validate_for_site
from coordinator import hospital_sum
from site_agent import hospital as site_hospital
from site_agent.site_training import LocalUpdate

DIM = 300
SITES = ("alpha", "beta", "gamma")
BASE = Announcement(
    round_number=4, round_nonce=bytes(range(16)), participants=SITES, threshold=3,
    neighbours=0, vector_length=DIM + 1 + 4, quantization_bits=20, clip=1.0,
    histogram_bins=2, secure_aggregation=True, model_layout=flat_layout(DIM),
    model_sha256=bytes(32), model_bytes=4 * DIM, local_epochs=1, learning_rate=0.1,
    fedprox_mu=0.0, planned_rounds=5, train_deadline_ms=1_700_000_000_000,
    phase_timeout_ms=30_000, weight_cap=100,
)
TERMS = hospital.HospitalTerms(clip=0.5, noise_multiplier=0.8)


def _hospital_announcement() -> Announcement:
    return hospital_sum.announce(BASE, TERMS)


def test_training_rounds_become_hospital_rounds_and_travel_intact() -> None:
    ann = _hospital_announcement()
    assert ann.kind == KIND_HOSPITAL and ann.clip == 0.5
    assert ann.hospital_noise_multiplier == 0.8 and ann.hospital_limbs == 1
    assert wire.announcement_from_pb(wire.announcement_to_pb(ann)) == ann
    # The final evaluation-only round stays a plain round; no terms, no change.
    assert hospital_sum.announce(dataclasses.replace(BASE, local_epochs=0), TERMS).kind == (
        "training")
    assert hospital_sum.announce(BASE, None) is BASE
    settings = AggregationSection(hospital_clip_norm=0.5, hospital_noise_multiplier=0.8)
    assert hospital_sum.terms_for(None, settings) == TERMS
    assert hospital_sum.terms_for(None, AggregationSection()) is None


def test_site_refuses_a_bad_hospital_announcement() -> None:
    policy = SitePolicySection()
    ann = _hospital_announcement()
    validate_for_site(ann, policy=policy, site_id="alpha")
    for bad in (dataclasses.replace(ann, hospital_noise_multiplier=0.0),
                dataclasses.replace(ann, vector_length=ann.vector_length + 1)):
        with pytest.raises(ValidationError):
            validate_for_site(bad, policy=policy, site_id="alpha")


def test_a_hospital_mode_site_refuses_a_plain_training_round() -> None:
    policy = SitePolicySection()
    plain = validate_for_site(BASE, policy=policy, site_id="alpha")
    with pytest.raises(RoundFailed, match="un-noised"):
        site_hospital.require_hospital_round(plain, hospital_mode=True)
    site_hospital.require_hospital_round(plain, hospital_mode=False)
    evaluation = validate_for_site(dataclasses.replace(BASE, local_epochs=0), policy=policy,
                                   site_id="alpha")
    site_hospital.require_hospital_round(evaluation, hospital_mode=True)
    hospital_round = validate_for_site(_hospital_announcement(), policy=policy,
                                       site_id="alpha")
    site_hospital.require_hospital_round(hospital_round, hospital_mode=True)


def test_three_sites_sum_and_decode_to_the_noisy_clipped_mean() -> None:
    policy = SitePolicySection()
    ann = _hospital_announcement()
    generator = np.random.default_rng(5)
    deltas = [generator.standard_normal(DIM).astype(np.float32) * s for s in (0.01, 0.02, 1.0)]
    total = np.zeros(ann.vector_length, np.uint32)
    plans = []
    for site, delta in zip(SITES, deltas, strict=True):
        rnd = validate_for_site(ann, policy=policy, site_id=site)
        planned = site_hospital.plan_round(rnd, study=None, policy=policy)
        plans.append(planned)
        update = LocalUpdate(delta.copy(), 50, np.array([1, 2, 3, 4]), 0.0)
        total += site_hospital.encode(rnd, update, planned)
    # The ledger records the planned worst case: floor 3 minus 1 colluder.
    assert {p.mechanism.contributors for p in plans} == {2}
    decoded = hospital_sum.decode(total, ann=ann, count=3)
    assert decoded.mean_delta is not None and decoded.weight_sum == 3
    clipped = [d * min(1.0, 0.5 / float(np.linalg.norm(d))) for d in deltas]
    expected = np.mean(clipped, axis=0)
    error = decoded.mean_delta - expected
    # Noise std per coordinate of the mean: z S / 3 (two planned shares of three sites
    # add noise of variance 3/2 of the plan): a loose 6-sigma bound on the RMS error.
    assert float(np.sqrt(np.mean(error**2))) < 6 * 0.8 * 0.5 / 3 * np.sqrt(1.5)
    np.testing.assert_array_equal(decoded.histogram, [3, 6, 9, 12])
