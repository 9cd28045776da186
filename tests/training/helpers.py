"""Oracles of the evaluation tests: what a central analyst holding every score computes
(exact one-vs-rest AUCs), and the plain equal-width bucket layout the noise filters are
measured on. The product never computes either: its sites send DP histograms counted
with the round's announced edges."""

from __future__ import annotations

import math

import numpy as np

from common.releases.evaluation import MulticlassMetrics, metrics_from_scores


def multiclass_metrics_from_scores(scores: np.ndarray, labels: np.ndarray) -> MulticlassMetrics:
    """Exact one-vs-rest AUCs of class probabilities [N, K] and their mean over the
    classes present (NaN for a class absent from the labels)."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels).reshape(-1).astype(np.int64)
    aucs = [metrics_from_scores(s[:, k], (y == k).astype(np.int64)).auc
            for k in range(s.shape[1])]
    defined = [a for a in aucs if not math.isnan(a)]
    return MulticlassMetrics(tuple(aucs), float(np.mean(defined)) if defined else math.nan,
                             int(y.shape[0]))


def uniform_edges(bins: int) -> np.ndarray:
    """`bins` equal-width buckets on [0, 1] (edges i / bins)."""
    return np.arange(bins + 1, dtype=np.float64) / bins
