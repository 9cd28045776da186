"""Federated evaluation: metrics from securely summed score histograms."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from common.releases.evaluation import (
    metrics_from_histogram,
    metrics_from_scores,
    multiclass_metrics_from_histogram,
    multiclass_score_histogram,
    score_histogram,
)
from tests.training.helpers import multiclass_metrics_from_scores, uniform_edges


def _pairs_sharing_a_bucket(scores: np.ndarray, labels: np.ndarray, bins: int) -> float:
    hist = score_histogram(scores, labels, bins=bins)
    neg, pos = hist[:bins], hist[bins:]
    return float(np.sum(neg * pos)) / (neg.sum() * pos.sum())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 400),
    bins=st.sampled_from([5, 20, 100, 1000]),
)
def test_histogram_auc_error_bounded_by_pairs_in_same_bucket(seed: int, n: int, bins: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=n)
    labels[:2] = [0, 1]
    scores = np.clip(rng.beta(2, 2, size=n) + 0.2 * labels, 0.0, 1.0)
    exact = metrics_from_scores(scores, labels)
    binned = metrics_from_histogram(score_histogram(scores, labels, bins=bins), bins=bins)
    assert binned.n == exact.n == n
    # Only pairs sharing a bucket can be mis-ranked, and those count half either way.
    assert abs(binned.auc - exact.auc) <= 0.5 * _pairs_sharing_a_bucket(scores, labels, bins) + 1e-9


def test_histogram_auc_within_one_over_bins_for_spread_scores() -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=5000)
    scores = 1 / (1 + np.exp(-(rng.normal(size=5000) + 1.5 * labels)))
    exact = metrics_from_scores(scores, labels).auc
    for bins in (10, 50, 200):
        binned = metrics_from_histogram(score_histogram(scores, labels, bins=bins), bins=bins)
        assert abs(binned.auc - exact) <= 1.0 / bins


def test_threshold_metrics_match_exact_on_bucket_edges() -> None:
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, size=3000)
    scores = rng.uniform(size=3000) ** np.where(labels == 1, 0.5, 1.5)
    edges = uniform_edges(100)  # 0.3, 0.5 and 0.8 are edges of this layout
    hist = score_histogram(scores, labels, edges=edges)
    for threshold in (0.3, 0.5, 0.8):
        a = metrics_from_histogram(hist, edges=edges, threshold=threshold)
        b = metrics_from_scores(scores, labels, threshold=threshold)
        for field in ("sensitivity", "specificity", "ppv"):
            assert math.isclose(getattr(a, field), getattr(b, field), rel_tol=1e-12)


def test_summed_site_histograms_equal_pooled_histogram() -> None:
    # What secure aggregation relies on: the federation's histogram is the sum.
    rng = np.random.default_rng(2)
    sites = [(rng.uniform(size=n), rng.integers(0, 2, size=n)) for n in (50, 300, 1200)]
    summed = sum(score_histogram(s, y, bins=64) for s, y in sites)
    pooled = score_histogram(
        np.concatenate([s for s, _ in sites]), np.concatenate([y for _, y in sites]), bins=64
    )
    np.testing.assert_array_equal(summed, pooled)
    assert summed.dtype == np.int64 and summed.sum() == 1550


def test_exact_auc_known_cases_and_undefined() -> None:
    y = np.array([0, 0, 1, 1])
    assert metrics_from_scores(np.array([0.1, 0.2, 0.3, 0.4]), y).auc == 1.0
    assert metrics_from_scores(np.array([0.4, 0.3, 0.2, 0.1]), y).auc == 0.0
    assert metrics_from_scores(np.array([0.5, 0.5, 0.5, 0.5]), y).auc == 0.5  # ties = half
    assert math.isnan(metrics_from_scores(np.array([0.1, 0.9]), np.array([1, 1])).auc)
    assert math.isnan(metrics_from_histogram(np.zeros(20, dtype=np.int64), bins=10).auc)


def test_multiclass_one_vs_rest_auc_from_summed_site_histograms() -> None:
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 3, size=600)
    logits = rng.normal(size=(600, 3)) + 1.5 * np.eye(3)[labels]
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    exact = multiclass_metrics_from_scores(probs, labels)
    assert len(exact.per_class_auc) == 3 and all(0.7 < a < 1.0 for a in exact.per_class_auc)
    bins = 200
    sites = np.array_split(np.arange(600), 3)  # each site sends its own histogram
    summed = sum(multiclass_score_histogram(probs[i], labels[i], bins=bins) for i in sites)
    np.testing.assert_array_equal(summed, multiclass_score_histogram(probs, labels, bins=bins))
    federated = multiclass_metrics_from_histogram(summed, bins=bins, num_classes=3)
    np.testing.assert_allclose(federated.per_class_auc, exact.per_class_auc, atol=0.01)
    assert federated.n == 600
    absent = multiclass_metrics_from_scores(probs[labels != 2], labels[labels != 2])
    assert np.isnan(absent.per_class_auc[2]) and not np.isnan(absent.macro_auc)
