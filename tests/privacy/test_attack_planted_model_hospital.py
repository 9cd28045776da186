"""Hospital-level DP under a planted model: a site whose local training (without DP-SGD
beneath) ended in NaN, or one of whose intermediaries did, still encodes its update. The
non-finite update is zero, which is in the clipping ball, so the site sends zero plus the
same noise share as any other, never a refusal the coordinator would see as a dropout."""

from __future__ import annotations

import numpy as np
import pytest

from common.crypto.random import DeterministicRandom
from common.privacy import hospital

DIM = 50
SEED = bytes(range(32))


def _plan(terms: hospital.HospitalTerms) -> hospital.DDGaussPlan:
    ring = hospital.ring_plan(terms, dim=DIM, max_sites=3)
    return hospital.site_plan(ring, n_noise=2)


@pytest.mark.parametrize("norm_segment", [False, True])
def test_attack_planted_model_nan_update_is_sent_as_zero_plus_the_noise_share(
        norm_segment: bool) -> None:
    terms = hospital.HospitalTerms(clip=1.0, noise_multiplier=1.0, norm_segment=norm_segment)
    plan = _plan(terms)
    broken = np.full(DIM, np.nan, dtype=np.float32)
    sent = hospital.encode_update(broken, plan=plan, seed=SEED, terms=terms,
                                  rng=DeterministicRandom(b"noise"))
    zero = hospital.encode_update(np.zeros(DIM, np.float32), plan=plan, seed=SEED, terms=terms,
                                  rng=DeterministicRandom(b"noise"))
    assert np.array_equal(sent, zero)


def test_attack_planted_model_nan_intermediary_contributes_zero() -> None:
    """v = 3 intermediaries, one of which overflowed: the site's words are those of the
    same round with that unit's update zero (its weight, v, is unchanged)."""
    terms = hospital.HospitalTerms(clip=1.0, noise_multiplier=1.0, intermediaries=3,
                                   norm_segment=True)
    plan = _plan(terms)
    rng = np.random.default_rng(2)
    units = [rng.standard_normal(DIM).astype(np.float32) for _ in range(3)]
    with_nan = [units[0], np.full(DIM, np.inf, np.float32), units[2]]
    with_zero = [units[0], np.zeros(DIM, np.float32), units[2]]
    sent = hospital.encode_units(with_nan, plan=plan, seed=SEED, terms=terms,
                                 rng=DeterministicRandom(b"noise"))
    zero = hospital.encode_units(with_zero, plan=plan, seed=SEED, terms=terms,
                                 rng=DeterministicRandom(b"noise"))
    assert np.array_equal(sent, zero)
    vector = hospital.unit_vector(with_nan[1], clip=1.0, norm_segment=True)
    assert vector.tolist() == [0.0] * (DIM + 1)
