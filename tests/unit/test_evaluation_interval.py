"""The DP evaluation's resolution follows the noise, and its AUC interval covers.

`evaluation_bins` picks the bucket count from released class totals and the noise std
(few wide buckets for a small held-out cohort, more for a large one); `auc_interval`
turns a released histogram into a 95% interval for the exact held-out AUC. Coverage is
measured over seeded draws of cohorts AND of the DP noise, for score distributions that
broke earlier layouts: a narrow band, perfectly separable classes, overlapping classes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.releases.evaluation import metrics_from_histogram, metrics_from_scores, score_histogram
from common.releases.evaluation_edges import block_bins, default_edges, evaluation_bins, next_edges
from common.releases.evaluation_interval import UNREADABLE_WIDTH, auc_interval, interval_text

DISTRIBUTIONS = {
    # (positive logit mean, negative logit mean, logit sd)
    "separable": (3.0, -3.0, 0.5),
    "overlapping": (0.5, -0.5, 1.0),
    "narrow-band": (0.05, -0.05, 0.05),
}


def _cohort(rng: np.random.Generator, kind: str, *, positives: int, negatives: int
            ) -> tuple[np.ndarray, np.ndarray]:
    pos_mu, neg_mu, sd = DISTRIBUTIONS[kind]
    logits = np.concatenate([rng.normal(neg_mu, sd, negatives), rng.normal(pos_mu, sd, positives)])
    labels = np.concatenate([np.zeros(negatives, np.int64), np.ones(positives, np.int64)])
    return 1.0 / (1.0 + np.exp(-logits)), labels


def _released(rng: np.random.Generator, hist: np.ndarray, sigma: float) -> np.ndarray:
    """The federation's sum: the counts plus (rounded Gaussian ~ discrete Gaussian) noise."""
    return hist + np.rint(rng.normal(0.0, sigma, hist.size)).astype(np.int64)


def _layout(rng: np.random.Generator, kind: str, *, positives: int, negatives: int,
            sigma: float) -> np.ndarray:
    """The edges a round after the first announces: `evaluation_bins` buckets from a
    previous (noised) release, placed by `next_edges`."""
    scores, labels = _cohort(rng, kind, positives=positives, negatives=negatives)
    previous = default_edges(20)
    released = _released(rng, score_histogram(scores, labels, edges=previous), sigma)
    bins = block_bins(released, blocks=1, noise_std=sigma, max_bins=20)
    return next_edges(np.maximum(released, 0), edges=previous, bins=bins)


@pytest.mark.parametrize(("kind", "positives", "negatives", "sigma"), [
    ("separable", 20, 20, 5.0),
    ("overlapping", 20, 20, 5.0),
    ("narrow-band", 50, 50, 10.0),
    ("overlapping", 150, 300, 10.0),
    ("separable", 600, 1800, 10.0),
])
def test_interval_covers_the_exact_auc_at_about_its_nominal_rate(
    kind: str, positives: int, negatives: int, sigma: float
) -> None:
    """Over 40 seeded cohorts and noise draws the stated 95% interval holds the exact
    held-out AUC at least ~90% of the time (40 draws: a binomial sd of 3.4 points), and
    its noise part holds the noiseless bucketed AUC at least ~80% (it is the part the
    simulation alone speaks for)."""
    rng = np.random.default_rng(20261126)
    reps, covered, covered_noise, widths = 40, 0, 0, []
    for rep in range(reps):
        edges = _layout(rng, kind, positives=positives, negatives=negatives, sigma=sigma)
        scores, labels = _cohort(rng, kind, positives=positives, negatives=negatives)
        hist = score_histogram(scores, labels, edges=edges)
        exact = metrics_from_scores(scores, labels).auc
        bucketed = metrics_from_histogram(hist, edges=edges).auc
        interval = auc_interval(_released(rng, hist, sigma), edges=[edges], noise_std=sigma,
                                rng=np.random.default_rng(rep), draws=200)
        covered += interval.low <= exact <= interval.high
        covered_noise += interval.noise_low <= bucketed <= interval.noise_high
        widths.append(interval.width)
    assert covered / reps >= 0.9, (covered, np.median(widths))
    assert covered_noise / reps >= 0.8, (covered_noise, np.median(widths))


def test_large_cohort_reads_tightly_and_small_one_is_flagged() -> None:
    """The interval shrinks with the cohort: thousands of held-out scores give a narrow
    one; twenty of each class under std-10 noise one too wide to read."""
    rng = np.random.default_rng(3)
    widths = {}
    for n in (20, 2000):
        edges = _layout(rng, "overlapping", positives=n, negatives=n, sigma=10.0)
        scores, labels = _cohort(rng, "overlapping", positives=n, negatives=n)
        released = _released(rng, score_histogram(scores, labels, edges=edges), 10.0)
        widths[n] = auc_interval(released, edges=[edges], noise_std=10.0,
                                 rng=np.random.default_rng(0), draws=200)
    assert widths[2000].width < 0.1 and widths[2000].readable
    assert widths[20].width > UNREADABLE_WIDTH and not widths[20].readable
    assert "too noisy to read" in interval_text(
        widths[20].auc, widths[20].low, widths[20].high)
    assert "95% interval" in interval_text(
        widths[2000].auc, widths[2000].low, widths[2000].high)


def test_without_noise_the_interval_is_the_resolution_bound() -> None:
    """No noise: the interval is the bucketed AUC +- half the share of tied pairs, and
    the exact AUC lies in it (a deterministic bound, not a probability)."""
    rng = np.random.default_rng(5)
    scores, labels = _cohort(rng, "overlapping", positives=300, negatives=700)
    edges = default_edges(6)
    hist = score_histogram(scores, labels, edges=edges)
    interval = auc_interval(hist, edges=[edges], noise_std=0.0, rng=np.random.default_rng(1))
    assert interval.noise_low == interval.noise_high == pytest.approx(
        metrics_from_histogram(hist, edges=edges).auc)
    assert interval.resolution > 0
    assert interval.low <= metrics_from_scores(scores, labels).auc <= interval.high


def test_same_release_and_seed_give_the_same_interval() -> None:
    rng = np.random.default_rng(8)
    scores, labels = _cohort(rng, "separable", positives=40, negatives=60)
    edges = default_edges(4)
    released = _released(rng, score_histogram(scores, labels, edges=edges), 5.0)
    first, second = (auc_interval(released, edges=[edges], noise_std=5.0,
                                  rng=np.random.default_rng(11)) for _ in range(2))
    assert first == second


@settings(max_examples=200, deadline=None)
@given(
    small=st.floats(1.0, 1e5), large_factor=st.floats(1.0, 100.0),
    sigma=st.floats(0.1, 100.0), sigma_factor=st.floats(1.0, 10.0),
    ratio=st.floats(0.01, 100.0), max_bins=st.integers(2, 1000),
)
def test_bucket_count_grows_with_the_cohort_and_shrinks_with_the_noise(
    small: float, large_factor: float, sigma: float, sigma_factor: float, ratio: float,
    max_bins: int,
) -> None:
    def bins(cohort: float, noise: float) -> int:
        return evaluation_bins(positives=cohort, negatives=cohort * ratio, noise_std=noise,
                               max_bins=max_bins)

    assert 2 <= bins(small, sigma) <= max_bins
    assert bins(small * large_factor, sigma) >= bins(small, sigma)
    assert bins(small, sigma * sigma_factor) <= bins(small, sigma)


def test_bucket_counts_for_typical_cohorts() -> None:
    """(m / sigma)^(2/3) with m ~ the smaller class: a demo hospital trio's ~40 held-out
    images under std-5 noise get 2 buckets, a few hundred 5, thousands the study's 20."""
    assert evaluation_bins(positives=20, negatives=20, noise_std=5.0, max_bins=20) == 2
    assert evaluation_bins(positives=150, negatives=300, noise_std=10.0, max_bins=20) == 5
    assert evaluation_bins(positives=2000, negatives=6000, noise_std=10.0, max_bins=20) == 20
    assert evaluation_bins(positives=-3, negatives=50, noise_std=10.0, max_bins=20) == 2
    assert evaluation_bins(positives=5, negatives=5, noise_std=0.0, max_bins=20) == 20


def test_next_edges_takes_the_chosen_bucket_count() -> None:
    """Few buckets still follow a narrow band: round after round the occupied bucket is
    split, until the band spreads over several (the AUC no longer reads 0.500)."""
    rng = np.random.default_rng(2)
    scores, labels = _cohort(rng, "narrow-band", positives=200, negatives=200)
    edges = default_edges(20)
    occupied = []
    for _ in range(6):
        edges = next_edges(score_histogram(scores, labels, edges=edges), edges=edges, bins=3)
        assert edges.size == 4 and edges[0] == 0.0 and edges[-1] == 1.0
        hist = score_histogram(scores, labels, edges=edges)
        occupied.append(int(np.count_nonzero(hist[:3] + hist[3:])))
    assert occupied[-1] >= 2, occupied
    assert metrics_from_histogram(hist, edges=edges).auc > 0.55


def test_the_bundle_carries_the_interval_and_model_show_prints_it() -> None:
    """`threshold_from_histogram` keeps the round's interval; `model show` prints the AUC
    with it, or "too noisy to read" when it is wider than 0.5."""
    from common.releases.bundle import evaluation_auc_text, threshold_from_histogram

    edges = default_edges(4)
    hist = np.array([30, 10, 2, 0, 0, 3, 12, 25])
    read = threshold_from_histogram(hist, bins=4, edges=edges, evaluation={
        "auc": 0.93, "auc_interval_low": 0.86, "auc_interval_high": 0.99,
        "auc_noise_std": 5.0})
    assert (read.auc_interval_low, read.auc_interval_high) == (0.86, 0.99)
    assert read.histogram_bins == 4
    assert evaluation_auc_text(read) == "0.930 (95% interval 0.860-0.990)"
    noisy = threshold_from_histogram(hist, bins=4, edges=edges, evaluation={
        "auc": 0.437, "auc_interval_low": 0.05, "auc_interval_high": 0.93})
    assert evaluation_auc_text(noisy).startswith("too noisy to read (DP estimate 0.44")
