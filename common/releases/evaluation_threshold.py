"""The operating point of a binary score: the Youden threshold (max sensitivity +
specificity - 1) read from a histogram or from raw scores, and the metrics at it.
"""

from __future__ import annotations

import numpy as np

from common.core.errors import ValidationError
from common.releases.evaluation import (
    Metrics,
    _scores_and_labels,
    metrics_from_histogram,
    metrics_from_scores,
)
from common.releases.evaluation_edges import _layout


def _middle_of_best(j: np.ndarray) -> int:
    """The index of the first maximum of `j`, moved to the middle of the run of equal
    maxima it starts (empty buckets between two separated classes all give J = 1).
    Where nothing discriminates (J <= 0 throughout) the first: everybody positive, as
    a threshold that predicts nobody positive would leave PPV undefined."""
    top = j >= j.max() - 1e-12
    first = int(np.argmax(top))
    if j[first] <= 1e-12:
        return first
    rest = top[first:]
    run = rest.size if rest.all() else int(np.argmin(rest))
    return first + run // 2


def youden_threshold(
    hist: np.ndarray, *, bins: int | None = None, edges: np.ndarray | None = None
) -> float:
    """The bucket edge that maximises Youden's J = sensitivity + specificity - 1.

    A screening tool is operated at a chosen threshold, not at 0.5 (sepsis is rare, so
    0.5 would flag almost nobody). Computed from the federation's summed histogram, so
    choosing it reveals nothing about any one site. Classes that the buckets separate
    (J = 1 over a run of empty buckets between them) get the edge in the middle of the
    gap: sensitivity and specificity 1.
    """
    e = _layout(bins, edges)
    n_bins = e.size - 1
    counts = np.asarray(hist, dtype=np.int64).reshape(-1)
    if counts.shape != (2 * n_bins,):
        raise ValidationError(f"histogram must be {2 * n_bins} counts")
    negatives = counts[:n_bins].astype(np.float64)
    positives = counts[n_bins:].astype(np.float64)
    n_neg, n_pos = negatives.sum(), positives.sum()
    if n_neg <= 0 or n_pos <= 0:
        return 0.5
    # Predict positive for buckets >= k: sensitivity(k) and specificity(k) for every
    # k = 0..bins (k = bins: nobody positive).
    sens = np.concatenate([np.cumsum(positives[::-1])[::-1], [0.0]]) / n_pos
    spec = np.concatenate([[0.0], np.cumsum(negatives)]) / n_neg
    return float(e[_middle_of_best(sens + spec - 1.0)])


def operating_point_metrics(
    hist: np.ndarray, *, bins: int | None = None, edges: np.ndarray | None = None
) -> Metrics:
    """Metrics at the Youden-optimal threshold of the same histogram (AUC unaffected)."""
    e = _layout(bins, edges)
    return metrics_from_histogram(hist, edges=e, threshold=youden_threshold(hist, edges=e))


def youden_threshold_from_scores(scores: np.ndarray, labels: np.ndarray) -> float:
    """Youden's threshold on exact scores (centralised baselines): predict positive when
    the score is >= the returned value, which lies halfway between two consecutive
    distinct scores, so classes that separate get sensitivity 1 and specificity 1."""
    s, y = _scores_and_labels(scores, labels)
    positive = y == 1
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return 0.5
    values, inverse = np.unique(s, return_inverse=True)
    pos = np.bincount(inverse[positive], minlength=values.size).astype(np.float64)
    neg = np.bincount(inverse[~positive], minlength=values.size).astype(np.float64)
    # Threshold at distinct value k: positives >= values[k]; k = size: nobody positive.
    sens = np.concatenate([np.cumsum(pos[::-1])[::-1], [0.0]]) / n_pos
    spec = np.concatenate([[0.0], np.cumsum(neg)]) / n_neg
    k = _middle_of_best(sens + spec - 1.0)
    if k == 0:
        return float(values[0])
    if k == values.size:
        return float(np.nextafter(values[-1], np.inf))
    mid = (values[k - 1] + values[k]) / 2.0
    return float(mid if values[k - 1] < mid <= values[k] else values[k])


def operating_point_metrics_from_scores(scores: np.ndarray, labels: np.ndarray) -> Metrics:
    """Exact metrics at the Youden-optimal threshold of the exact scores."""
    return metrics_from_scores(
        scores, labels, threshold=youden_threshold_from_scores(scores, labels))


