"""The discrete Gaussian sampler (CKS20) against its pmf, and its building blocks.

Every draw comes from a seeded DeterministicRandom, so each statistical check is a
fixed computation; the tolerances are 5 standard errors (or chi-square p > 1e-4).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats  # type: ignore[import-untyped]

from common.core.errors import ConfigError, ValidationError
from common.crypto.random import DeterministicRandom
from common.privacy.ddgauss import (
    NoiseStream,
    bernoulli_exp,
    count_noise,
    count_site_sigma,
    sample_discrete_gaussian,
)
from tests.privacy.ddgauss_reference import discrete_gaussian_pmf, discrete_gaussian_variance

SIGMAS = [0.5, 1.0, 3.3, 40.0, 1000.0]
N = 200_000


def _chi_square_p(samples: np.ndarray, sigma: float) -> float:
    """Chi-square goodness of fit against the exact pmf, bins of expected count >= 20."""
    half = math.ceil(8 * sigma) + 2
    support = np.arange(-half, half + 1)
    probs = discrete_gaussian_pmf(support, sigma=sigma)
    # Merge adjacent integers into bins of probability >= 20 / N (tails pooled).
    edges, mass, acc = [], [], 0.0
    for value, p in zip(support, probs, strict=True):
        acc += float(p)
        if acc >= 20 / samples.size:
            edges.append(int(value))
            mass.append(acc)
            acc = 0.0
    mass[-1] += acc + (1 - sum(mass) - acc)  # whatever is left, both tails included
    edges[-1] = half + 10**9
    bins = np.searchsorted(np.asarray(edges), samples, side="left")
    bins = np.minimum(bins, len(edges) - 1)
    observed = np.bincount(bins, minlength=len(edges))
    expected = np.asarray(mass) / sum(mass) * samples.size
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("sigma", SIGMAS)
def test_moments_and_fit(sigma: float) -> None:
    samples = sample_discrete_gaussian(N, sigma=sigma, rng=DeterministicRandom(b"dg%r" % sigma))
    assert samples.dtype == np.int64 and samples.shape == (N,)
    variance = discrete_gaussian_variance(sigma)
    assert abs(samples.mean()) < 5 * math.sqrt(variance / N)
    # Var of Y^2 for a (near-)Gaussian is about 2 var^2; for sigma 0.5 use the exact 4th moment.
    fourth = float(
        (np.arange(-40, 41) ** 4 * discrete_gaussian_pmf(np.arange(-40, 41), sigma=sigma)).sum()
    )
    se_var = (
        math.sqrt(max(fourth - variance**2, 1e-12) / N)
        if sigma < 10
        else math.sqrt(2 / N) * variance
    )
    assert abs(float(np.mean(samples.astype(np.float64) ** 2)) - variance) < 5 * se_var
    assert _chi_square_p(samples, sigma) > 1e-4


def test_exact_variance_is_below_sigma_squared_for_small_sigma() -> None:
    assert discrete_gaussian_variance(0.5) < 0.25
    assert discrete_gaussian_variance(0.5) == pytest.approx(0.2150, abs=1e-3)
    assert discrete_gaussian_variance(1000.0) == pytest.approx(1e6, rel=1e-12)


def test_pmf_sums_to_one_and_is_symmetric() -> None:
    support = np.arange(-60, 61)
    pmf = discrete_gaussian_pmf(support, sigma=2.0)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.array_equal(pmf, pmf[::-1])


@pytest.mark.parametrize("gamma", [0.0, 0.3, 1.0, 2.5, 7.0])
def test_bernoulli_exp(gamma: float) -> None:
    stream = NoiseStream(DeterministicRandom(b"bern"))
    hits = bernoulli_exp(np.full(N, gamma), stream)
    p = math.exp(-gamma)
    assert abs(hits.mean() - p) <= 5 * math.sqrt(p * (1 - p) / N) + 1e-12


def test_bernoulli_exp_rejects_negative_or_nan() -> None:
    stream = NoiseStream(DeterministicRandom(b"bern"))
    for bad in ([-0.1], [math.nan], [math.inf]):
        with pytest.raises(ValidationError):
            bernoulli_exp(np.asarray(bad), stream)


@pytest.mark.parametrize("bound", [1, 2, 3, 7, 1000])
def test_uniform_integers_are_uniform(bound: int) -> None:
    stream = NoiseStream(DeterministicRandom(b"below"))
    values = stream.below(50_000, bound)
    assert values.min() >= 0 and values.max() < bound
    if 1 < bound <= 7:
        counts = np.bincount(values, minlength=bound)
        assert stats.chisquare(counts).pvalue > 1e-4


def test_stream_is_reproducible_and_seeds_differ() -> None:
    a = sample_discrete_gaussian(1000, sigma=3.0, rng=DeterministicRandom(b"s"))
    b = sample_discrete_gaussian(1000, sigma=3.0, rng=DeterministicRandom(b"s"))
    c = sample_discrete_gaussian(1000, sigma=3.0, rng=DeterministicRandom(b"t"))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_chunked_sampling_fills_every_entry() -> None:
    # Larger than one SAMPLE_CHUNK: a sentinel outside the plausible range must vanish.
    size = (1 << 20) + 12_345
    out = np.full(size, np.iinfo(np.int64).min, np.int64)
    sample_discrete_gaussian(size, sigma=2.0, rng=DeterministicRandom(b"big"), out=out)
    assert np.abs(out).max() < 40


def test_bad_arguments() -> None:
    rng = DeterministicRandom(b"x")
    with pytest.raises(ConfigError):
        sample_discrete_gaussian(3, sigma=0.0, rng=rng)
    with pytest.raises(ValidationError):
        sample_discrete_gaussian(-1, sigma=1.0, rng=rng)
    with pytest.raises(ValidationError):
        sample_discrete_gaussian(3, sigma=1.0, rng=rng, out=np.zeros(3, np.int32))


def test_summed_count_noise_has_the_planned_variance() -> None:
    # n_noise sites each add N_Z(0, sigma^2 / n_noise): the sum has variance n * var(site).
    sigma, n_sites, length = 12.0, 7, 100_000
    total = np.zeros(length, np.int64)
    for site in range(n_sites):
        total += count_noise(
            length, sigma=sigma, n_noise=n_sites, rng=DeterministicRandom(b"site%d" % site)
        )
    expected = n_sites * discrete_gaussian_variance(count_site_sigma(sigma=sigma, n_noise=n_sites))
    assert expected == pytest.approx(sigma**2, rel=1e-9)
    se = math.sqrt(2 / length) * expected
    assert abs(float(total.astype(np.float64).var()) - expected) < 5 * se
    assert abs(total.mean()) < 5 * math.sqrt(expected / length)
