"""Hospital-level DP on model updates: sensitivity of the
(noiseless) aggregate, variance of the summed noise shares, the wider ring through a
real SecAgg+ round, and a hospital round's announcement."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.crypto.random import DeterministicRandom
from common.privacy import hospital
from common.privacy.ddgauss import ddgauss_decode, ddgauss_encode, ddgauss_round, epsilon_from_rho
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.protocol.secagg.phases import Phase
from tests.secagg.secagg_harness import make_federation, run_round

CLIP = 2.0
DIM = 1000
SEED = bytes(range(32))


def _updates(count: int, *, seed: int, scale: float = 10.0) -> list[np.ndarray]:
    """Updates far outside the clip (norm ~ scale * CLIP), so clipping always bites."""
    generator = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = generator.standard_normal(DIM)
        out.append(x * (scale * CLIP / np.linalg.norm(x)))
    return out


def _ring(max_sites: int = 5, **kw: float) -> hospital.DDGaussPlan:
    return hospital.ring_plan(hospital.HospitalTerms(CLIP, 1.5), dim=DIM,
                              max_sites=max_sites, **kw)


def _rounded(update: np.ndarray, plan: hospital.DDGaussPlan, tag: bytes) -> np.ndarray:
    return ddgauss_round(update, plan=plan, rotation_seed=SEED,
                         rng=DeterministicRandom(b"round" + tag))


def test_clipped_aggregate_moves_by_at_most_s_and_2s_under_replacement() -> None:
    plan = _ring()
    updates = _updates(4, seed=1)
    clipped = [u * min(1.0, CLIP / np.linalg.norm(u)) for u in updates]
    base = np.sum(clipped[:3], axis=0)
    added = base + clipped[3]
    assert np.linalg.norm(added - base) <= CLIP * (1 + 1e-12)
    replaced = base - clipped[2] + clipped[3]
    assert np.linalg.norm(replaced - base) <= 2 * CLIP * (1 + 1e-12)
    # After rotation and conditional rounding: the integer sums move by at most
    # Delta_2 (KLS21 Theorem 1 / Prop. 22), 2 Delta_2 under replacement, and decoded
    # back to model units by at most gamma * Delta_2 = S (1 + rounding inflation).
    ints = [_rounded(u, plan, bytes([i])) for i, u in enumerate(updates)]
    for v in ints:
        assert int(np.dot(v, v)) <= plan.l2_sensitivity**2
    base_int = np.sum(ints[:3], axis=0)
    assert math.sqrt(float(np.dot(ints[3], ints[3]))) <= plan.l2_sensitivity
    swap = ints[3] - ints[2]
    assert math.sqrt(float(np.dot(swap, swap))) <= 2 * plan.l2_sensitivity

    def decoded(total: np.ndarray) -> np.ndarray:
        ring = (total & np.int64((1 << plan.bits) - 1)).astype(np.uint64)
        return ddgauss_decode(ring, plan=plan, rotation_seed=SEED)

    moved = np.linalg.norm(decoded(base_int + ints[3]) - decoded(base_int))
    bound = plan.gamma * plan.l2_sensitivity
    assert moved <= bound * (1 + 1e-9)
    assert bound <= CLIP * (1 + hospital.MAX_ROUNDING_INFLATION)
    # And the noiseless decoded sum is the clipped sum up to the rounding error.
    assert np.linalg.norm(decoded(base_int) - base) <= 3 * plan.gamma * math.sqrt(
        plan.padded_dim)


def test_summed_noise_variance_matches_the_plan() -> None:
    """n sites each add their planned share; the decoded noise per coordinate has
    variance (z S)^2 (sampling error: relative std sqrt(2 / D) of a variance estimate;
    a 5-sigma band, so a wrong split, e.g. n_noise off by one, fails)."""
    n_sites = 3
    ring = hospital.ring_plan(hospital.HospitalTerms(CLIP, 1.5), dim=8192, max_sites=n_sites)
    plan = hospital.site_plan(ring, n_noise=n_sites)
    total = np.zeros(hospital.vector_words(plan), np.uint32)
    for i in range(n_sites):
        words = hospital.encode_update(np.zeros(8192), plan=plan, seed=SEED,
                                       rng=DeterministicRandom(b"noise" + bytes([i])))
        total += words  # uint32 wrap-around: the SecAgg ring
    noise = hospital.decode_sum(total, plan=plan, seed=SEED)
    expected = (1.5 * CLIP) ** 2
    estimate = float(np.mean(noise**2))
    tolerance = 5 * math.sqrt(2 / noise.size)
    assert abs(estimate / expected - 1) < tolerance
    # n_noise - 1 shares would be visibly short of the plan.
    assert (n_sites - 1) / n_sites < 1 - tolerance


def test_noise_share_is_planned_for_the_floor_minus_colluders() -> None:
    ring = _ring(max_sites=6)
    plan = hospital.site_plan(ring, n_noise=2)
    mechanism = hospital.mechanism(plan)
    assert isinstance(mechanism, DistributedDiscreteGaussian)
    assert mechanism.contributors == 2
    # The sum of the planned worst case carries (z S / gamma)^2 per coordinate.
    assert mechanism.total_noise_variance == pytest.approx((1.5 * CLIP / ring.gamma) ** 2)
    assert ring.log2_wrap_probability <= hospital.LOG2_WRAP_PROBABILITY
    with pytest.raises(hospital.ConfigError):
        hospital.site_plan(ring, n_noise=7)


def test_wider_ring_round_trips_through_secagg_with_a_dropout() -> None:
    """A ring wider than 32 bits (limbs) summed by a real SecAgg+ round (masks, shares,
    one site dropping after the keys): the coordinator recovers the modular sum of the
    survivors exactly, and decodes it to their noisy clipped sum."""
    n_sites = 4
    ring = _ring(max_sites=n_sites, max_inflation=1e-9)
    assert ring.bits > 32
    limbs, width = hospital.limb_layout(bits=ring.bits, max_sites=n_sites)
    assert limbs >= 2 and n_sites * ((1 << width) - 1) < 1 << 32
    plan = hospital.site_plan(ring, n_noise=2)
    federation = make_federation(n_sites, threshold=3,
                                 vector_length=hospital.vector_words(plan))
    sites = federation.params.participants
    updates = dict(zip(sites, _updates(n_sites, seed=7, scale=0.5), strict=True))
    ring_values = {}
    inputs = {}
    for i, site in enumerate(sites):
        rng = DeterministicRandom(b"site" + bytes([i]))
        ring_values[site] = ddgauss_encode(updates[site], plan=plan, rotation_seed=SEED,
                                           rng=rng).astype(np.uint64)
        inputs[site] = hospital.to_limbs(ring_values[site], bits=plan.bits,
                                         max_sites=n_sites)
    total, survivors = run_round(federation, inputs,
                                 dropouts={sites[0]: Phase.CONSISTENCY_CHECK})
    assert len(survivors) == n_sites  # its masked input is in the sum
    dropped_early, survivors2 = run_round(
        make_federation(n_sites, threshold=3, vector_length=hospital.vector_words(plan),
                        seed=b"other"),
        inputs, dropouts={sites[0]: Phase.MASKED_INPUT})
    assert survivors2 == tuple(sites[1:])
    mask = np.uint64((1 << plan.bits) - 1)
    for summed, members in ((total, sites), (dropped_early, sites[1:])):
        expected = np.zeros(plan.padded_dim, np.uint64)
        for site in members:
            expected = (expected + ring_values[site]) & mask
        recovered = hospital.from_limbs(summed, bits=plan.bits, max_sites=n_sites)
        np.testing.assert_array_equal(recovered, expected)
        decoded = hospital.decode_sum(summed, plan=plan, seed=SEED)
        clean = np.sum([updates[s] for s in members], axis=0)
        # Noise std z S = 3 per coordinate: the decoded sum is within 8 sigma.
        assert np.max(np.abs(decoded - clean)) < 8 * 1.5 * CLIP


def test_limbs_round_trip_at_the_widest_ring() -> None:
    generator = np.random.default_rng(3)
    bits, sites = 62, 9
    values = [generator.integers(0, 1 << bits, size=64, dtype=np.uint64) for _ in range(sites)]
    words = sum(hospital.to_limbs(v, bits=bits, max_sites=sites).astype(np.uint64)
                for v in values)
    assert int(np.max(words)) < 1 << 32  # no limb sum wraps the 32-bit ring
    total = hospital.from_limbs(np.asarray(words, dtype=np.uint32), bits=bits,
                                max_sites=sites)
    expected = np.zeros(64, np.uint64)
    for v in values:
        expected = (expected + v) & np.uint64((1 << bits) - 1)
    np.testing.assert_array_equal(total, expected)


def test_noise_multiplier_is_planned_from_the_study_epsilon() -> None:
    z = hospital.plan_noise_multiplier(epsilon=4.0, delta=1e-5, rounds=10)
    rho = 10 * (1 + hospital.MAX_ROUNDING_INFLATION) ** 2 / (2 * z * z)
    assert epsilon_from_rho(rho, 1e-5) <= 4.0
    assert epsilon_from_rho(rho * 1.01, 1e-5) > 4.0 * 0.999
    assert hospital.plan_noise_multiplier(epsilon=4.0, delta=1e-5, rounds=40) > z


def test_intermediaries_each_move_the_sum_by_at_most_delta_2() -> None:
    """A site with v units rounds each alone: removing one unit moves its integer sum by
    at most Delta_2 (the per-intermediary guarantee); the whole hospital by v Delta_2,
    which is what the ledger's per-hospital view of the mechanism charges."""
    v = 3
    terms = hospital.HospitalTerms(CLIP, 1.5, intermediaries=v)
    ring = hospital.ring_plan(terms, dim=DIM, max_sites=2)
    assert ring.max_sites == 2 * v  # the ring holds every unit of every site
    plan = hospital.site_plan(ring, n_noise=2)
    units = _updates(v, seed=11)
    rounded = [_rounded(u, plan, bytes([i])) for i, u in enumerate(units)]
    for r in rounded:
        assert math.sqrt(float(np.dot(r, r))) <= plan.l2_sensitivity
    whole = np.sum(rounded, axis=0)
    assert math.sqrt(float(np.dot(whole, whole))) <= v * plan.l2_sensitivity
    mechanism = hospital.mechanism(plan, units=v)
    per_hospital = mechanism.per_hospital()
    assert per_hospital.l2_sensitivity == pytest.approx(v * mechanism.l2_sensitivity)
    assert per_hospital.zcdp_rho == pytest.approx(v * v * mechanism.zcdp_rho, rel=1e-6)
    # The encoded units decode to the sum of the clipped units plus the site's one share.
    words = hospital.encode_units(units, plan=plan, seed=SEED, rng=DeterministicRandom(b"u"))
    decoded = hospital.decode_sum(words, plan=plan, seed=SEED)
    clipped = np.sum([u * min(1.0, CLIP / np.linalg.norm(u)) for u in units], axis=0)
    share_std = plan.site_sigma * plan.gamma
    assert float(np.sqrt(np.mean((decoded - clipped) ** 2))) < 1.2 * share_std


def test_units_travel_on_the_ledger_and_old_entries_keep_their_bytes() -> None:
    from common.privacy.mechanisms import mechanism_from_json_dict, mechanism_to_json_dict

    plan = hospital.site_plan(_ring(), n_noise=2)
    single = hospital.mechanism(plan)
    assert "units" not in mechanism_to_json_dict(single)
    split = hospital.mechanism(plan, units=4)
    raw = mechanism_to_json_dict(split)
    assert raw["units"] == 4 and mechanism_from_json_dict(raw) == split
    with pytest.raises(hospital.ConfigError):
        mechanism_from_json_dict({**mechanism_to_json_dict(single), "units": 1})
    pairs = [("training", (split,)), ("evaluation", (single,))]
    intermediary = hospital.guarantees(pairs, delta=1e-5, accountant="rdp").intermediary
    whole = hospital.hospital_level_epsilon(pairs, delta=1e-5, accountant="rdp")
    assert 0 < intermediary < whole
    # No round split its hospital: the intermediary figure is the hospital-level one.
    unsplit = hospital.guarantees([("training", (single,))], delta=1e-5, accountant="rdp")
    assert unsplit.intermediary == unsplit.hospital
