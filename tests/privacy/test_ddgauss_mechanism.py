"""The distributed discrete Gaussian mechanism (KLS21): rotation, rounding, sensitivity,
ring planning, end to end, and its zCDP accounting."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats  # type: ignore[import-untyped]
from scipy.linalg import hadamard  # type: ignore[import-untyped]

from common.core.errors import ConfigError, ValidationError
from common.crypto.random import DeterministicRandom
from common.privacy.ddgauss import (
    NoiseStream,
    clip_l2,
    conditional_round,
    count_rho,
    ddgauss_decode,
    ddgauss_encode,
    ddgauss_rdp,
    ddgauss_rho,
    ddgauss_round,
    epsilon_from_rho,
    noise_tau,
    plan_ddgauss,
    rounded_l2_bound,
    sample_discrete_gaussian,
)
from common.privacy.rotation import fwht, padded_length, rotate, unrotate
from tests.privacy.ddgauss_reference import discrete_gaussian_variance

SEED = bytes(range(32))


# ----------------------------------------------------------------------------- rotation


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 1024])
def test_fwht_is_the_hadamard_matrix(n: int) -> None:
    x = np.random.default_rng(n).normal(size=n)
    y = x.copy()
    fwht(y)
    assert np.allclose(y, hadamard(n) @ x)


def test_fwht_blocked_path_matches_definition() -> None:
    # Longer than one cache block: H H = n I checks both the blocked and the long stages.
    n = 1 << 16
    x = np.random.default_rng(0).normal(size=n)
    y = x.copy()
    fwht(fwht(y))
    assert np.allclose(y / n, x, atol=1e-12)
    e = np.zeros(n)
    e[12345] = 1.0
    fwht(e)
    column = (-1.0) ** np.asarray([bin(12345 & j).count("1") for j in range(n)])
    assert np.array_equal(e, column)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 12), st.binary(min_size=32, max_size=32), st.integers(0, 2**32 - 1))
def test_rotation_is_orthogonal_and_invertible(log_n: int, seed: bytes, data_seed: int) -> None:
    n = 1 << log_n
    gen = np.random.default_rng(data_seed)
    x, y = gen.normal(size=n), gen.normal(size=n)
    rx, ry = rotate(x.copy(), seed=seed), rotate(y.copy(), seed=seed)
    assert float(rx @ ry) == pytest.approx(float(x @ y), rel=1e-9, abs=1e-9)
    assert float(np.linalg.norm(rx)) == pytest.approx(float(np.linalg.norm(x)), rel=1e-12)
    assert np.allclose(unrotate(rx, seed=seed), x, atol=1e-12)


def test_rotation_depends_on_the_seed_and_flattens() -> None:
    spike = np.zeros(1 << 12)
    spike[0] = 1.0
    a = rotate(spike.copy(), seed=SEED)
    b = rotate(spike.copy(), seed=bytes(32))
    assert not np.array_equal(a, b)
    assert np.allclose(np.abs(a), 1 / 64)  # every coordinate carries 1/sqrt(D)


def test_padded_length() -> None:
    assert [padded_length(d) for d in (1, 2, 3, 1000, 1 << 20, 11_000_000)] == [
        1,
        2,
        4,
        1024,
        1 << 20,
        1 << 24,
    ]
    with pytest.raises(ValidationError):
        padded_length(0)


# ---------------------------------------------------------------------------- rounding


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2000), st.floats(0.1, 50.0), st.floats(0.0, 0.99), st.binary(min_size=1))
def test_conditional_rounding_respects_the_bound(
    dim: int, norm: float, beta: float, seed: bytes
) -> None:
    z = np.random.default_rng(dim).normal(size=dim)
    z *= norm / np.linalg.norm(z)
    bound = rounded_l2_bound(norm, beta=beta, dim=dim)
    rounded = conditional_round(z, bound=bound, stream=NoiseStream(DeterministicRandom(seed)))
    assert rounded.dtype == np.int64
    assert float(np.linalg.norm(rounded)) <= bound
    assert np.all(np.abs(rounded - z) < 1)


def test_rounding_is_unbiased_without_conditioning() -> None:
    z = np.linspace(-3, 3, 13) + 0.37
    stream = NoiseStream(DeterministicRandom(b"round"))
    total = np.zeros(z.size)
    trials = 20_000
    for _ in range(trials):
        total += conditional_round(z, bound=1e9, stream=stream)
    assert np.all(np.abs(total / trials - z) < 5 * 0.5 / math.sqrt(trials))


def test_rounded_bound_formula() -> None:
    # KLS21 Theorem 1: min(c + sqrt(d), sqrt(c^2 + d/4 + sqrt(2 ln 1/beta)(c + sqrt(d)/2))).
    c, d, beta = 100.0, 400, math.exp(-0.5)
    assert rounded_l2_bound(c, beta=beta, dim=d) == pytest.approx(
        math.sqrt(c * c + d / 4 + 1.0 * (c + 10))
    )
    assert rounded_l2_bound(c, beta=0.0, dim=d) == c + 20
    assert rounded_l2_bound(0.1, beta=1e-300, dim=1) == pytest.approx(1.1)  # plain bound wins


# ------------------------------------------------------------------------- sensitivity


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 300), st.floats(0.01, 10.0), st.integers(0, 2**32 - 1))
def test_noiseless_aggregate_moves_by_at_most_the_clip(
    n_sites: int, dim: int, clip: float, data_seed: int
) -> None:
    gen = np.random.default_rng(data_seed)
    updates = [gen.normal(size=dim) * gen.choice([0.01, 1.0, 100.0]) for _ in range(n_sites + 1)]
    clipped = []
    for update in updates:
        work = update.copy()
        clip_l2(work, clip=clip)
        clipped.append(work)
    base = np.sum(clipped[:n_sites], axis=0)
    added = base + clipped[n_sites]
    replaced = base - clipped[0] + clipped[n_sites]
    tolerance = 1e-9 * clip
    assert np.linalg.norm(added - base) <= clip + tolerance  # add / remove
    assert np.linalg.norm(replaced - base) <= 2 * clip + tolerance  # replace


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 500), st.integers(0, 2**32 - 1))
def test_integer_aggregate_moves_by_at_most_the_post_rounding_bound(
    n_sites: int, dim: int, data_seed: int
) -> None:
    plan = plan_ddgauss(clip=1.0, dim=dim, sigma=1.0, n_noise=n_sites + 1)
    gen = np.random.default_rng(data_seed)
    rounded = [
        ddgauss_round(
            gen.normal(size=dim) * 10,
            plan=plan,
            rotation_seed=SEED,
            rng=DeterministicRandom(b"%d-%d" % (data_seed, i)),
        )
        for i in range(n_sites + 1)
    ]
    base = np.sum(rounded[:n_sites], axis=0)
    for vector in rounded:
        assert float(np.linalg.norm(vector)) <= plan.l2_sensitivity
    assert float(np.linalg.norm(base + rounded[-1] - base)) <= plan.l2_sensitivity
    replaced = base - rounded[0] + rounded[-1]
    assert float(np.linalg.norm(replaced - base)) <= 2 * plan.l2_sensitivity
    assert plan.l2_sensitivity * plan.gamma <= 1.01 * plan.clip  # the planned inflation


# ---------------------------------------------------------------------------- planning


def test_plan_defaults_and_stated_wrap_bound() -> None:
    plan = plan_ddgauss(clip=1.0, dim=10_000_000, sigma=1.0, n_noise=5, max_sites=10)
    assert plan.padded_dim == 1 << 24
    assert plan.log2_wrap_probability <= -40
    assert 2 <= plan.bits <= 32 and plan.dtype == np.uint32
    assert plan.wire_bytes == 4 << 24
    assert plan.rounding_inflation <= 0.01 + 1e-9
    assert plan.site_sigma == pytest.approx(1.0 / (plan.gamma * math.sqrt(5)))


def test_plan_for_a_given_ring_uses_the_finest_grid_that_fits() -> None:
    plan = plan_ddgauss(clip=1.0, dim=100_000, sigma=0.8, n_noise=4, max_sites=8, bits=32)
    assert plan.bits == 32
    assert -40.001 <= plan.log2_wrap_probability <= -40
    coarse = plan_ddgauss(clip=1.0, dim=100_000, sigma=0.8, n_noise=4, max_sites=8, bits=20)
    assert coarse.gamma > plan.gamma and coarse.rounding_inflation > plan.rounding_inflation


def test_plan_goes_past_32_bits_with_a_uint64_ring() -> None:
    plan = plan_ddgauss(
        clip=1.0, dim=1000, sigma=1e6, n_noise=3, max_sites=50, rounding_inflation=1e-9
    )
    assert 32 < plan.bits <= 62 and plan.dtype == np.uint64
    assert plan.log2_wrap_probability <= -40


def test_plan_refuses_bad_parameters() -> None:
    with pytest.raises(ConfigError):
        plan_ddgauss(clip=1.0, dim=10, sigma=1.0, n_noise=5, max_sites=4)
    with pytest.raises(ConfigError):
        plan_ddgauss(clip=1.0, dim=10, sigma=1.0, n_noise=5, bits=63)
    with pytest.raises(ConfigError):
        plan_ddgauss(clip=-1.0, dim=10, sigma=1.0, n_noise=5)
    with pytest.raises(ConfigError):
        plan_ddgauss(clip=1.0, dim=10, sigma=1.0, n_noise=3, bits=2)


@pytest.mark.parametrize("bits", [None, 10, 14])
def test_planned_ring_never_wraps_at_the_clip_bound(bits: int | None) -> None:
    # Worst case for the signal: every site sends the same direction at norm exactly c.
    dim, n_noise, max_sites = 3000, 3, 6
    plan = plan_ddgauss(
        clip=2.0, dim=dim, sigma=1.0, n_noise=n_noise, max_sites=max_sites, bits=bits
    )
    direction = np.random.default_rng(1).normal(size=dim)
    direction *= plan.clip / np.linalg.norm(direction)
    half = 1 << (plan.bits - 1)
    for trial in range(20):
        exact = np.zeros(plan.padded_dim, np.int64)
        for site in range(max_sites):
            rng = DeterministicRandom(b"wrap-%d-%d" % (trial, site))
            seed = bytes([trial]) * 32
            rounded = ddgauss_round(direction, plan=plan, rotation_seed=seed, rng=rng)
            rounded += sample_discrete_gaussian(plan.padded_dim, sigma=plan.site_sigma, rng=rng)
            exact += rounded
        assert -half <= int(exact.min()) and int(exact.max()) < half


# -------------------------------------------------------------------------- end to end


@pytest.mark.parametrize(("dim", "bits"), [(5000, None), (4096, 32), (300, 40)])
def test_end_to_end_decoded_mean_is_within_the_noise(dim: int, bits: int | None) -> None:
    n_sites, clip, sigma = 5, 1.0, 0.5
    plan = plan_ddgauss(clip=clip, dim=dim, sigma=sigma, n_noise=n_sites, bits=bits)
    gen = np.random.default_rng(7)
    updates = [
        gen.normal(size=dim) * (0.3 if i % 2 else 3.0) / math.sqrt(dim) for i in range(n_sites)
    ]
    # A SecAgg-style ring of 2^32 or 2^64 words: the modular sum of the encoded vectors.
    total = np.zeros(plan.padded_dim, plan.dtype)
    for site, update in enumerate(updates):
        encoded = ddgauss_encode(
            update, plan=plan, rotation_seed=SEED, rng=DeterministicRandom(b"e2e%d" % site)
        )
        assert encoded.dtype == plan.dtype and encoded.size == plan.padded_dim
        assert int(encoded.max()) < (1 << plan.bits)
        total += encoded  # wraps around the word size, as the masked sum does
    decoded = ddgauss_decode(total, plan=plan, rotation_seed=SEED)
    clipped = []
    for update in updates:
        work = update.copy()
        clip_l2(work, clip=clip)
        clipped.append(work)
    error = decoded - np.sum(clipped, axis=0)
    # Per coordinate: n * gamma^2 var(N_Z(s^2)) noise plus at most n * gamma^2 / 4 rounding.
    noise_var = n_sites * plan.gamma**2 * discrete_gaussian_variance(plan.site_sigma)
    rounding_var = n_sites * plan.gamma**2 / 4
    observed = float(np.mean(error**2))
    se = math.sqrt(2 / dim) * noise_var
    assert noise_var - 5 * se <= observed <= noise_var + rounding_var + 5 * se
    assert abs(float(error.mean())) < 5 * math.sqrt((noise_var + rounding_var) / dim)
    assert stats.kstest(error / math.sqrt(observed), "norm").pvalue > 1e-4
    mean_error = decoded / n_sites - np.mean(clipped, axis=0)
    assert float(np.abs(mean_error).max()) < 6 * math.sqrt(noise_var + rounding_var) / n_sites


def test_decode_rejects_bad_vectors() -> None:
    plan = plan_ddgauss(clip=1.0, dim=10, sigma=1.0, n_noise=2)
    with pytest.raises(ValidationError):
        ddgauss_decode(np.zeros(10, np.uint32), plan=plan, rotation_seed=SEED)
    with pytest.raises(ValidationError):
        ddgauss_decode(np.zeros(16, np.int64), plan=plan, rotation_seed=SEED)
    with pytest.raises(ValidationError):
        ddgauss_encode(np.zeros(11), plan=plan, rotation_seed=SEED, rng=DeterministicRandom(b""))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_update_is_encoded_as_zero_plus_the_same_noise(bad: float) -> None:
    """Zero is in the clipping ball: the site still sends its noise share, never a
    refusal (which the coordinator would see as a dropout)."""
    plan = plan_ddgauss(clip=1.0, dim=4, sigma=1.0, n_noise=2)
    broken = ddgauss_encode(np.asarray([0.5, bad, 0.0, 0.0]), plan=plan, rotation_seed=SEED,
                            rng=DeterministicRandom(b"same noise"))
    zero = ddgauss_encode(np.zeros(4), plan=plan, rotation_seed=SEED,
                          rng=DeterministicRandom(b"same noise"))
    assert np.array_equal(broken, zero)


# -------------------------------------------------------------------------- accounting


def test_tau_is_the_papers_sum() -> None:
    s, n = 0.7, 6
    direct = 10 * sum(math.exp(-2 * math.pi**2 * s * s * k / (k + 1)) for k in range(1, n))
    assert noise_tau(site_sigma=s, n_noise=n) == pytest.approx(direct, rel=1e-15)
    assert noise_tau(site_sigma=s, n_noise=1) == 0.0


def test_rho_reduces_to_the_gaussian_when_tau_vanishes() -> None:
    # Large per-site noise: tau ~ exp(-2 pi^2 s^2 / 2) underflows; rho = Delta^2 / (2 n s^2).
    rho = ddgauss_rho(
        l2_sensitivity=30.0, l1_sensitivity=900.0, site_sigma=20.0, n_noise=4, dim=1 << 20
    )
    assert rho == pytest.approx(30.0**2 / (2 * 4 * 20.0**2), rel=1e-12)


def test_rho_carries_the_tau_term_for_small_noise() -> None:
    args: dict[str, Any] = {
        "l2_sensitivity": 2.0,
        "l1_sensitivity": 4.0,
        "site_sigma": 0.4,
        "n_noise": 10,
        "dim": 1000,
    }
    gaussian = 2.0**2 / (2 * 10 * 0.4**2)
    tau = noise_tau(site_sigma=0.4, n_noise=10)
    rho = ddgauss_rho(**args)
    l2 = 2.0 / (math.sqrt(10) * 0.4)
    expected = min(
        l2 * l2 / 2 + tau * 1000,
        (l2 * l2 + 2 * tau * 4.0 / (math.sqrt(10) * 0.4) + tau * tau * 1000) / 2,
        (l2 + tau * math.sqrt(1000)) ** 2 / 2,
    )
    assert rho == pytest.approx(expected) and rho > gaussian
    orders = [1.5, 2, 8, 64]
    rdp = ddgauss_rdp(orders, **args)
    assert np.all(rdp <= rho * np.asarray(orders) + 1e-12)  # RDP never exceeds rho * alpha


def test_plan_rho_matches_its_parameters() -> None:
    plan = plan_ddgauss(clip=1.0, dim=50_000, sigma=2.0, n_noise=5, max_sites=9)
    expected = (plan.l2_sensitivity * plan.gamma) ** 2 / (2 * plan.sigma**2)
    assert plan.rho() == pytest.approx(expected, rel=1e-9)
    assert plan.rho(replacement=True) == pytest.approx(4 * expected, rel=1e-9)
    # The rounding inflation is all the discretisation costs against the continuous bound.
    assert plan.rho() <= (1.01**2) * 1.0 / (2 * 2.0**2)


def _gaussian_delta(epsilon: float, mu: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with Delta / sigma = mu (Balle-Wang 2018)."""
    return float(
        stats.norm.cdf(mu / 2 - epsilon / mu)
        - math.exp(epsilon) * stats.norm.cdf(-mu / 2 - epsilon / mu)
    )


@pytest.mark.parametrize("rho", [1e-4, 0.01, 0.5, 3.0, 40.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-9])
def test_epsilon_from_rho(rho: float, delta: float) -> None:
    epsilon = epsilon_from_rho(rho, delta)
    assert epsilon <= rho + 2 * math.sqrt(rho * math.log(1 / delta)) + 1e-12
    # A Gaussian mechanism that is exactly rho-zCDP (mu^2 = 2 rho) is (eps, delta)-DP at
    # that epsilon: the conversion is valid against an independent exact formula.
    assert _gaussian_delta(epsilon, math.sqrt(2 * rho)) <= delta * (1 + 1e-9)
    assert epsilon_from_rho(0.0, delta) == 0.0


def test_count_rho_for_histograms() -> None:
    rho = count_rho(sigma=10.0, n_noise=4, l2_sensitivity=1.0, length=20)
    assert rho == pytest.approx(1 / (2 * 100.0), rel=1e-12)
    with pytest.raises(ConfigError):
        count_rho(sigma=10.0, n_noise=0, l2_sensitivity=1.0, length=20)
