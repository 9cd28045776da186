"""Post-processing of DP-noised count vectors (statistics histograms, score histograms).

Clamping each noisy count at 0 -- what the decoders did -- is biased: an empty bin
holding only N(0, sigma^2) noise keeps E[max(noise, 0)] = sigma / sqrt(2 pi) ~ 0.4 sigma
fake units. Over the tens of empty bins of a sparse histogram that is hundreds of units,
enough to swamp a small cohort's real mass and drag quantiles, ROC and thresholds into
bins that hold nothing but noise.

Instead a bin counts only when its noisy count is credibly above zero, the
"high-pass filter" on noisy histogram counts of Cormode, Procopiuc, Srivastava & Tran,
"Differentially Private Summaries for Sparse Data", ICDT 2012 (section 4). The cut is
z noise standard deviations with z chosen so that all B bins of a histogram together
let an empty one through with probability `FALSE_BIN_RATE` (Bonferroni:
z = Phi^-1(1 - rate / B), 3.5 for 51 bins, at least `CREDIBLE_Z`).
The support is the hull from the first to the last credible bin: bins outside it
are empty, bins inside keep their count clamped at 0 (inside, most bins hold real mass
and the clamp's bias is small; a thin but real stretch between two credible bins is
kept). All of it is post-processing of the released values: no privacy cost, nothing
new leaves a site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

CREDIBLE_Z = 3.0
"""A count below CREDIBLE_Z noise standard deviations is always treated as noise."""
FALSE_BIN_RATE = 0.01
"""Chance that a histogram keeps at least one bin holding only noise."""


def credible_z(bins: int) -> float:
    """The cut, in noise standard deviations, for a histogram of `bins` bins."""
    per_bin = FALSE_BIN_RATE / max(bins, 1)
    return max(CREDIBLE_Z, NormalDist().inv_cdf(1.0 - per_bin))
NOISE_DOMINATED = 0.25
"""A measurement is flagged noise-dominated when the standard deviation of the noise on
its (smaller) total exceeds this fraction of that total."""


@dataclass(frozen=True)
class Support:
    """The credible part of one noisy count vector."""

    counts: np.ndarray  # float64, >= 0, zero outside [first, last]
    first: int  # -1: nothing credible
    last: int
    noisy_total: float  # the signed sum: an unbiased estimate of the real total
    kept_total: float

    @property
    def empty(self) -> bool:
        return self.first < 0


def credible_support(noisy: np.ndarray, *, sigma: float, z: float | None = None) -> Support:
    """Counts outside the hull of the bins credibly above zero (>= z sigma; default
    `credible_z` of the vector's length) set to 0, inside clamped at 0 (module
    docstring). With `sigma` 0 (no noise) every positive count is kept as is."""
    values = np.asarray(noisy, dtype=np.float64).reshape(-1)
    z = credible_z(values.size) if z is None else z
    clamped = np.maximum(values, 0.0)
    noisy_total = float(values.sum())
    credible = np.flatnonzero(values > 0.0) if sigma <= 0 else np.flatnonzero(
        values >= z * sigma
    )
    if credible.size == 0:
        return Support(np.zeros_like(values), -1, -1, noisy_total, 0.0)
    first, last = int(credible[0]), int(credible[-1])
    counts = np.zeros_like(values)
    counts[first : last + 1] = clamped[first : last + 1]
    return Support(counts, first, last, noisy_total, float(counts.sum()))


def widen_by_class(
    support: Support, negatives: np.ndarray, positives: np.ndarray, *, sigma: float
) -> Support:
    """`support` (of a two-class histogram's bucket totals) widened to every bucket
    where ONE class's count is credible on its own (>= z sigma, z of 4B tests: the two
    classes' tests together let a noise-only bucket through with at most half
    `FALSE_BIN_RATE` more). A separating model puts each class's extremes in end buckets
    holding that class alone: 15 positives in a top bucket under noise std 3.95 are 3.8
    sigma on their own, but the bucket's total carries both classes' noise (std
    sigma sqrt 2) and missed the totals' cut, so the hull dropped the model's
    best-ranked patients (a release read AUC 0.80 for 0.96). Inside the widened hull
    each total is clamped at 0, as `credible_support` does."""
    neg = np.asarray(negatives, dtype=np.float64).reshape(-1)
    pos = np.asarray(positives, dtype=np.float64).reshape(-1)
    if sigma <= 0 or support.empty:
        return support
    z_class = credible_z(4 * neg.size)
    by_class = np.flatnonzero((neg >= z_class * sigma) | (pos >= z_class * sigma))
    if by_class.size == 0:
        return support
    first, last = min(support.first, int(by_class[0])), max(support.last, int(by_class[-1]))
    totals = neg + pos
    counts = np.zeros_like(totals)
    counts[first : last + 1] = np.maximum(totals[first : last + 1], 0.0)
    return Support(counts, first, last, support.noisy_total, float(counts.sum()))


def noise_std_from_negatives(noisy: np.ndarray) -> float:
    """Estimate of the per-count noise std from the counts' own negative values.

    Real counts are >= 0, so a negative count is noise; in an empty bin the noise is
    N(0, s^2), whose negative half has E[x^2 | x < 0] = s^2. The root mean square of the
    negative counts estimates s (low when real small counts go negative too). 0 when no
    count is negative: then no noise is visible and nothing is filtered."""
    values = np.asarray(noisy, dtype=np.float64).reshape(-1)
    negative = values[values < 0]
    if negative.size == 0:
        return 0.0
    return float(math.sqrt(float(np.mean(negative * negative))))


def relative_noise(*, sigma: float, bins: int, total: float) -> float:
    """Std of the noise on the sum of `bins` counts, relative to that sum (inf: empty).

    Independent noise of std sigma on each of `bins` counts adds up to std
    sigma * sqrt(bins) on their sum:

    >>> relative_noise(sigma=2.0, bins=4, total=100.0)
    0.04
    >>> relative_noise(sigma=2.0, bins=4, total=0.0)
    inf
    """
    if sigma <= 0:
        return 0.0
    if total <= 0:
        return math.inf
    return sigma * math.sqrt(max(bins, 1)) / total
