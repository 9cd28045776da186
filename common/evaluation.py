"""Evaluation metrics, federated through secure aggregation of score histograms.

Each site buckets its held-out scores into `bins` equal-width buckets per class and
sends the 2*bins counts through SecAgg; the coordinator learns only the federation's
summed histogram, from which the ROC curve (at bucket resolution), AUC, sensitivity,
specificity and PPV follow. No site's own ROC, size or prevalence is revealed.
The sum carries the sites' distributed DP noise: `denoised_histogram` keeps only the
score buckets credibly above it and says when the noise dominates the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from common.errors import ConfigError, ValidationError
from common.noisy_counts import (
    NOISE_DOMINATED,
    credible_support,
    noise_std_from_negatives,
    relative_noise,
)


@dataclass(frozen=True)
class Metrics:
    """Binary-classification metrics; NaN where undefined (e.g. no positives)."""

    auc: float
    sensitivity: float
    specificity: float
    ppv: float
    n: int


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den > 0 else math.nan


def score_histogram(scores: np.ndarray, labels: np.ndarray, *, bins: int) -> np.ndarray:
    """int64 counts [negatives per bin..., positives per bin...] of scores in [0, 1].

    Bucket i holds scores in [i/bins, (i+1)/bins); a score of exactly 1 goes in the last.
    """
    if bins < 1:
        raise ConfigError("bins", "must be >= 1")
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1)
    if s.shape != y.shape:
        raise ValidationError("scores and labels differ in length")
    if not np.all((s >= 0.0) & (s <= 1.0)):
        raise ValidationError("scores must lie in [0, 1]")
    if not np.all((y == 0) | (y == 1)):
        raise ValidationError("labels must be 0 or 1")
    bucket = np.minimum((s * bins).astype(np.int64), bins - 1)
    negatives = np.bincount(bucket[y == 0], minlength=bins)
    positives = np.bincount(bucket[y == 1], minlength=bins)
    return np.concatenate([negatives, positives]).astype(np.int64)


def metrics_from_histogram(hist: np.ndarray, *, bins: int, threshold: float = 0.5) -> Metrics:
    """Metrics of a (summed) score histogram.

    AUC: area under the ROC through the bucket edges (trapezoids), which counts a
    positive and a negative in the same bucket as half a correct ranking -- the
    same convention as ties in the exact AUC. Error versus the exact AUC is at most
    the fraction of pairs sharing a bucket, about 1/bins for spread-out scores.
    Threshold metrics predict positive for buckets whose lower edge is >= threshold.
    """
    counts = np.asarray(hist, dtype=np.int64).reshape(-1)
    if counts.shape != (2 * bins,) or np.any(counts < 0):
        raise ValidationError(f"histogram must be {2 * bins} non-negative counts")
    negatives, positives = counts[:bins].astype(np.float64), counts[bins:].astype(np.float64)
    n_neg, n_pos = negatives.sum(), positives.sum()
    # Sweep buckets from the highest score down: each bucket adds a straight ROC segment.
    tp = np.concatenate([[0.0], np.cumsum(positives[::-1])])
    fp = np.concatenate([[0.0], np.cumsum(negatives[::-1])])
    if n_pos > 0 and n_neg > 0:
        tpr, fpr = tp / n_pos, fp / n_neg
        auc = float(np.sum((fpr[1:] - fpr[:-1]) * (tpr[1:] + tpr[:-1]) / 2.0))
    else:
        auc = math.nan
    first_positive_bucket = math.ceil(threshold * bins - 1e-9)
    predicted_pos = slice(first_positive_bucket, bins)
    true_pos = positives[predicted_pos].sum()
    false_pos = negatives[predicted_pos].sum()
    true_neg = n_neg - false_pos
    return Metrics(
        auc=auc,
        sensitivity=_ratio(true_pos, n_pos),
        specificity=_ratio(true_neg, n_neg),
        ppv=_ratio(true_pos, true_pos + false_pos),
        n=int(n_neg + n_pos),
    )


def metrics_from_scores(
    scores: np.ndarray, labels: np.ndarray, *, threshold: float = 0.5
) -> Metrics:
    """Exact metrics for centralized baselines (AUC by Mann-Whitney with mid-ranks)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1)
    if s.shape != y.shape:
        raise ValidationError("scores and labels differ in length")
    positive = y == 1
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos > 0 and n_neg > 0:
        # Mid-ranks make ties count half, matching the histogram convention.
        order = np.argsort(s, kind="mergesort")
        sorted_scores = s[order]
        ranks = np.empty(len(s), dtype=np.float64)
        _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
        mid = first + (counts + 1) / 2.0
        ranks[order] = np.repeat(mid, counts)
        auc = float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
    else:
        auc = math.nan
    predicted = s >= threshold
    tp = float(np.sum(predicted & positive))
    fp = float(np.sum(predicted & ~positive))
    return Metrics(
        auc=auc,
        sensitivity=_ratio(tp, n_pos),
        specificity=_ratio(n_neg - fp, n_neg),
        ppv=_ratio(tp, tp + fp),
        n=len(s),
    )


def youden_threshold(hist: np.ndarray, *, bins: int) -> float:
    """The bucket edge that maximises Youden's J = sensitivity + specificity - 1.

    A screening tool is operated at a chosen threshold, not at 0.5 (sepsis is rare, so
    0.5 would flag almost nobody). Computed from the federation's summed histogram, so
    choosing it reveals nothing about any one site.
    """
    counts = np.asarray(hist, dtype=np.int64).reshape(-1)
    if counts.shape != (2 * bins,):
        raise ValidationError(f"histogram must be {2 * bins} counts")
    negatives, positives = counts[:bins].astype(np.float64), counts[bins:].astype(np.float64)
    n_neg, n_pos = negatives.sum(), positives.sum()
    if n_neg == 0 or n_pos == 0:
        return 0.5
    # Predict positive for buckets >= k: sensitivity(k) and specificity(k) for every k.
    sens = np.cumsum(positives[::-1])[::-1] / n_pos
    spec = np.concatenate([[0.0], np.cumsum(negatives)[:-1]]) / n_neg
    best = int(np.argmax(sens + spec - 1.0))
    return best / bins


def operating_point_metrics(hist: np.ndarray, *, bins: int) -> Metrics:
    """Metrics at the Youden-optimal threshold of the same histogram (AUC unaffected)."""
    return metrics_from_histogram(hist, bins=bins, threshold=youden_threshold(hist, bins=bins))


@dataclass(frozen=True)
class NoisyHistogram:
    """A DP-noised summed score histogram made usable for ROC, AUC and threshold, with
    how far its noise can be trusted (`denoised_histogram`)."""

    counts: np.ndarray  # int64, >= 0; bins outside the credible support are 0
    noise_std: float  # per-count noise std (estimated from the negative counts if unknown)
    relative_noise: float  # std of the noise on the smaller class's count / that count
    noise_dominated: bool

    def metrics(self) -> dict[str, float]:
        """What the coordinator reports next to the federated AUC."""
        return {
            "auc_noise_std": self.noise_std,
            "auc_relative_noise": min(self.relative_noise, 1e6),
            "auc_noise_dominated": float(self.noise_dominated),
        }


def denoised_histogram(
    summed: np.ndarray, *, blocks: int = 1, noise_std: float | None = None
) -> NoisyHistogram:
    """The noisy summed histogram (`blocks` one-vs-rest blocks of [negatives | positives],
    1 for a binary study), post-processed (no privacy cost):

    * the per-count noise std is `noise_std` or, the coordinator not knowing the sites'
      ``evaluation_noise_std``, estimated from the negative counts
      (`common.noisy_counts.noise_std_from_negatives`);
    * a score bucket counts only if its count summed over both classes is credibly above
      the noise (>= z sigma sqrt 2, z = 3.3 for 20 buckets: `credible_z`); outside the
      hull of such buckets both classes hold 0,
      inside each count is clamped at 0 (Cormode et al., ICDT 2012; common.noisy_counts).
      Clamping alone gave every empty bucket ~0.4 sigma fake units, which with few
      held-out positives dragged the ROC and Youden's threshold into buckets holding
      nothing but noise;
    * noise-dominated when the noise on the smaller class's total exceeds
      `NOISE_DOMINATED` of it, or when no bucket is credible (then the counts are the
      plain clamp at 0, the best there is, so that an AUC is still reported, flagged).
    """
    values = np.asarray(summed, dtype=np.int64).reshape(-1)
    if blocks < 1 or values.size % (2 * blocks):
        raise ValidationError(f"histogram of {values.size} counts is not {blocks} x 2 halves")
    sigma = noise_std_from_negatives(values) if noise_std is None else float(noise_std)
    bins = values.size // (2 * blocks)
    out = np.zeros_like(values)
    worst = 0.0
    for block in range(blocks):
        part = values[block * 2 * bins : (block + 1) * 2 * bins]
        negatives, positives = part[:bins], part[bins:]
        support = credible_support(negatives + positives, sigma=sigma * math.sqrt(2.0))
        kept = out[block * 2 * bins : (block + 1) * 2 * bins]
        if support.empty:
            # Nothing credible: the plain clamp (the best there is), flagged below.
            kept[:] = np.maximum(part, 0)
            worst = math.inf
            continue
        inside = slice(support.first, support.last + 1)
        kept[:bins][inside] = np.maximum(negatives[inside], 0)
        kept[bins:][inside] = np.maximum(positives[inside], 0)
        # The signed sums inside the support estimate the class counts without the
        # clamp's upward bias.
        smaller = float(min(negatives[inside].sum(), positives[inside].sum()))
        width = support.last - support.first + 1
        worst = max(worst, relative_noise(sigma=sigma, bins=width, total=smaller))
    return NoisyHistogram(out, sigma, worst, sigma > 0 and worst > NOISE_DOMINATED)


def clipped_noisy_histogram(summed: np.ndarray, *, blocks: int = 1) -> np.ndarray:
    """The counts of `denoised_histogram` (negative and noise-only counts set to 0)."""
    return denoised_histogram(summed, blocks=blocks).counts


@dataclass(frozen=True)
class MulticlassMetrics:
    """One-vs-rest AUC per class (class k's score against "label == k"), and their mean.

    NaN for a class absent from the labels (or present in all of them).
    """

    per_class_auc: tuple[float, ...]
    macro_auc: float
    n: int


def _check_probabilities(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels).reshape(-1)
    if s.ndim != 2 or s.shape[0] != y.shape[0] or s.shape[1] < 2:
        raise ValidationError("multi-class scores must be [N, K>=2] with one label per row")
    if y.size and not np.all((y >= 0) & (y < s.shape[1]) & (y == np.round(y))):
        raise ValidationError(f"labels must be class indices 0..{s.shape[1] - 1}")
    return s, y.astype(np.int64)


def _macro(aucs: list[float]) -> float:
    defined = [a for a in aucs if not math.isnan(a)]
    return float(np.mean(defined)) if defined else math.nan


def multiclass_metrics_from_scores(scores: np.ndarray, labels: np.ndarray) -> MulticlassMetrics:
    """Exact one-vs-rest AUCs of class probabilities [N, K] (centralised baselines)."""
    s, y = _check_probabilities(scores, labels)
    aucs = [metrics_from_scores(s[:, k], (y == k).astype(np.int64)).auc for k in range(s.shape[1])]
    return MulticlassMetrics(tuple(aucs), _macro(aucs), int(y.shape[0]))


def multiclass_score_histogram(
    scores: np.ndarray, labels: np.ndarray, *, bins: int
) -> np.ndarray:
    """K one-vs-rest binary histograms, concatenated: 2 * bins * K int64 counts.

    Sums across sites like the binary histogram, so it travels through SecAgg the same way.
    """
    s, y = _check_probabilities(scores, labels)
    if not np.all((s >= 0.0) & (s <= 1.0)):
        raise ValidationError("scores must lie in [0, 1]")
    return np.concatenate(
        [score_histogram(s[:, k], (y == k).astype(np.int64), bins=bins) for k in range(s.shape[1])]
    )


def multiclass_metrics_from_histogram(
    hist: np.ndarray, *, bins: int, num_classes: int
) -> MulticlassMetrics:
    """One-vs-rest AUC per class from a (summed) `multiclass_score_histogram`."""
    counts = np.asarray(hist, dtype=np.int64).reshape(-1)
    if num_classes < 2 or counts.shape != (2 * bins * num_classes,):
        raise ValidationError(f"histogram must be {2 * bins * num_classes} counts")
    parts = counts.reshape(num_classes, 2 * bins)
    aucs = [metrics_from_histogram(part, bins=bins).auc for part in parts]
    n = int(parts[0].sum()) if num_classes else 0
    return MulticlassMetrics(tuple(aucs), _macro(aucs), n)


def bins_per_class(announced_bins: int, *, num_classes: int) -> int:
    """Bins of each one-vs-rest block when a round's histogram carries K classes.

    A multi-class study's coordinator announces ``histogram_bins = bins * K``, so the
    vector keeps its ``2 * histogram_bins`` integer tail and only the layout inside it
    (K blocks of `multiclass_score_histogram`) depends on the study both sides hold.
    """
    if num_classes <= 2:
        return announced_bins
    if announced_bins % num_classes or announced_bins // num_classes < 2:
        raise ValidationError(
            f"histogram_bins {announced_bins} is not (bins >= 2) x {num_classes} classes"
        )
    return announced_bins // num_classes


def announced_histogram_bins(bins: int, *, num_classes: int) -> tuple[int, int]:
    """(aggregation.histogram_bins, aggregation.histogram_classes) for a study's
    ``[privacy.evaluation] histogram_bins`` and class count: K one-vs-rest blocks for
    K >= 3 classes (`bins_per_class` undoes it), the plain histogram for binary."""
    if num_classes <= 2:
        return bins, 1
    return bins * num_classes, num_classes
