"""Evaluation metrics, federated through secure aggregation of score histograms.

Each site buckets its held-out scores into `bins` buckets per class and sends the
2*bins counts through SecAgg; the coordinator learns only the federation's summed
histogram, from which the ROC curve (at bucket resolution), AUC, sensitivity,
specificity and PPV follow. No site's own ROC, size or prevalence is revealed.
The sum carries the sites' distributed DP noise: `denoised_histogram` keeps only the
score buckets credibly above it and says when the noise dominates the result.

Where the bucket edges lie decides what the evaluation can see: the AUC counts a
positive and a negative in the same bucket as a tie, so a model whose scores all sit in
one bucket reads 0.500 however well it ranks. The edges are public configuration of
each round (`Announcement.histogram_edges`), the same for every site:

* without an announced layout, `default_edges`: equal width on the logit scale
  log(s / (1 - s)) over [-DEFAULT_LOGIT_SPAN, DEFAULT_LOGIT_SPAN], plus the end buckets reaching
  0 and 1 (rare outcomes' scores near 0 get buckets of their own, unlike equal width
  on [0, 1]);
* after a round, `next_edges`: quantiles of the score distribution that round RELEASED
  (the noisy sum every site's noise went into, filtered by `denoised_histogram`), mixed
  with a uniform spread over a widened range so that a model whose scores move still
  lands in fine buckets. Post-processing of a DP release: no privacy cost (Dwork & Roth
  2014, Prop. 2.1), and no value computed from private data without DP. A band the
  previous round saw in one bucket is split into many the next round, so the
  resolution follows the model wherever its scores go.

How many buckets a round counts with follows the noise (`evaluation_bins`): each bucket
adds its count's noise to the AUC, fewer buckets tie more pairs, so a small held-out
cohort gets few wide buckets and a large one up to the study's ``histogram_bins``, chosen
from the class totals the previous round released and the public noise std. Every AUC
read from a release comes with a 95% interval for the exact held-out AUC
(`auc_interval`: the noise simulated from the release, plus the buckets' resolution),
post-processing like the rest.

Each count's DP noise does not depend on the edges (one privacy unit moves one count,
wherever the edges lie), so a coordinator choosing edges cannot weaken the guarantee;
a site still checks them at its boundary (`round_edges`).

The pieces: `common.releases.evaluation_edges` (where the bucket edges lie and how many buckets
a round counts with), `common.releases.evaluation_threshold` (the Youden operating point and
the metrics at it), `common.releases.evaluation_interval` (the AUC's interval from the noise);
this module turns scores into histograms and histograms into metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.core.errors import ValidationError
from common.releases.evaluation_edges import _block_edges, _layout
from common.releases.noisy_counts import (
    NOISE_DOMINATED,
    credible_support,
    credible_z,
    noise_std_from_negatives,
    relative_noise,
    widen_by_class,
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


def score_histogram(
    scores: np.ndarray, labels: np.ndarray, *, bins: int | None = None,
    edges: np.ndarray | None = None,
) -> np.ndarray:
    """int64 counts [negatives per bucket..., positives per bucket...] of scores in [0, 1].

    Bucket i holds scores in [edges[i], edges[i+1]); a score of exactly 1 goes in the
    last. `edges`: strictly increasing from 0 to 1; or `bins`: `default_edges(bins)`.
    """
    e = _layout(bins, edges)
    n_bins = e.size - 1
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1)
    if s.shape != y.shape:
        raise ValidationError("scores and labels differ in length")
    if not np.all((s >= 0.0) & (s <= 1.0)):
        raise ValidationError("scores must lie in [0, 1]")
    if not np.all((y == 0) | (y == 1)):
        raise ValidationError("labels must be 0 or 1")
    bucket = np.clip(np.searchsorted(e, s, side="right") - 1, 0, n_bins - 1)
    negatives = np.bincount(bucket[y == 0], minlength=n_bins)
    positives = np.bincount(bucket[y == 1], minlength=n_bins)
    return np.concatenate([negatives, positives]).astype(np.int64)


def metrics_from_histogram(
    hist: np.ndarray, *, bins: int | None = None, edges: np.ndarray | None = None,
    threshold: float = 0.5,
) -> Metrics:
    """Metrics of a (summed) score histogram counted with `edges` (or `default_edges(bins)`).

    AUC: area under the ROC through the bucket edges (trapezoids), which counts a
    positive and a negative in the same bucket as half a correct ranking -- the
    same convention as ties in the exact AUC. Error versus the exact AUC is at most
    half the fraction of pairs sharing a bucket; it does not depend on where the edges
    lie, only on how the scores spread over the buckets.
    Threshold metrics predict positive for buckets whose lower edge is >= threshold.
    """
    e = _layout(bins, edges)
    n_bins = e.size - 1
    counts = np.asarray(hist, dtype=np.int64).reshape(-1)
    if counts.shape != (2 * n_bins,) or np.any(counts < 0):
        raise ValidationError(f"histogram must be {2 * n_bins} non-negative counts")
    negatives = counts[:n_bins].astype(np.float64)
    positives = counts[n_bins:].astype(np.float64)
    n_neg, n_pos = negatives.sum(), positives.sum()
    # Sweep buckets from the highest score down: each bucket adds a straight ROC segment.
    tp = np.concatenate([[0.0], np.cumsum(positives[::-1])])
    fp = np.concatenate([[0.0], np.cumsum(negatives[::-1])])
    if n_pos > 0 and n_neg > 0:
        tpr, fpr = tp / n_pos, fp / n_neg
        auc = float(np.sum((fpr[1:] - fpr[:-1]) * (tpr[1:] + tpr[:-1]) / 2.0))
    else:
        auc = math.nan
    # The first bucket whose lower edge reaches the threshold (edges computed as i / bins
    # may sit an ulp below the threshold they stand for).
    first_positive_bucket = int(np.searchsorted(e[:-1], threshold - 1e-9, side="left"))
    predicted_pos = slice(first_positive_bucket, n_bins)
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


def _scores_and_labels(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact scores and their labels as flat arrays of one length."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1)
    if s.shape != y.shape:
        raise ValidationError("scores and labels differ in length")
    return s, y


def metrics_from_scores(
    scores: np.ndarray, labels: np.ndarray, *, threshold: float = 0.5
) -> Metrics:
    """Exact metrics for centralized baselines (AUC by Mann-Whitney with mid-ranks)."""
    s, y = _scores_and_labels(scores, labels)
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
      (`common.releases.noisy_counts.noise_std_from_negatives`);
    * a score bucket counts only if its count summed over both classes is credibly above
      the noise (>= z sigma sqrt 2, z = 3.3 for 20 buckets: `credible_z`), or one class's
      count is on its own (`common.releases.noisy_counts.widen_by_class`: a separating model's
      end buckets hold one class alone); outside the hull of such buckets both classes
      hold 0, inside each count is clamped at 0 (Cormode et al., ICDT 2012;
      common.releases.noisy_counts). Clamping alone gave every empty bucket ~0.4 sigma fake
      units, which with few held-out positives dragged the ROC and Youden's threshold
      into buckets holding nothing but noise. A tail beyond the hull whose buckets
      together are credibly above the noise (>= z sigma sqrt(2k) over k) is kept as one
      run, each class's signed sum spread over it (`_allocate`, below): a few held-out
      patients ranked best (or worst) spread over two end buckets no longer read as
      none;
    * where that hull is one bucket keeping under `HULL_KEEPS` of the released units
      (adaptive edges spread a small cohort so thinly that few buckets clear the cut
      alone: the AUC read 0.500), adjacent buckets are merged into runs, each credibly
      above the noise (>= z sigma sqrt(2k) over k buckets: `credible_groups`), a run's
      class counts its signed sums clamped at 0 spread over its buckets (`_allocate`);
    * noise-dominated when the noise on the smaller class's total exceeds
      `NOISE_DOMINATED` of it, or when no bucket is credible (then the counts are the
      plain clamp at 0, the best there is, so that an AUC is still reported, flagged).
    """
    values = np.asarray(summed, dtype=np.int64).reshape(-1)
    if blocks < 1 or values.size % (2 * blocks):
        raise ValidationError(f"histogram of {values.size} counts is not {blocks} x 2 halves")
    sigma = noise_std_from_negatives(values) if noise_std is None else float(noise_std)
    bins = values.size // (2 * blocks)
    z = credible_z(bins)
    out = np.zeros_like(values)
    worst = 0.0
    for block in range(blocks):
        part = values[block * 2 * bins : (block + 1) * 2 * bins]
        negatives, positives = part[:bins], part[bins:]
        kept = out[block * 2 * bins : (block + 1) * 2 * bins]
        totals = negatives + positives
        support = credible_support(totals, sigma=sigma * math.sqrt(2.0), z=z)
        lone_bucket = support.first == support.last and (
            support.kept_total < HULL_KEEPS * support.noisy_total
        )
        if not support.empty and not lone_bucket:
            support = widen_by_class(support, negatives, positives, sigma=sigma)
            inside = slice(support.first, support.last + 1)
            kept[:bins][inside] = np.maximum(negatives[inside], 0)
            kept[bins:][inside] = np.maximum(positives[inside], 0)
            for tail in (slice(0, support.first), slice(support.last + 1, bins)):
                run = totals[tail]
                if run.size and run.sum() >= z * sigma * math.sqrt(2.0 * run.size):
                    kept[:bins][tail] = _allocate(negatives[tail], sigma=sigma)
                    kept[bins:][tail] = _allocate(positives[tail], sigma=sigma)
            smaller = float(min(negatives[inside].sum(), positives[inside].sum()))
            width = support.last - support.first + 1
            worst = max(worst, relative_noise(sigma=sigma, bins=width, total=smaller))
            continue
        groups = credible_groups(totals, sigma=sigma, z=z)
        if not groups:
            # Nothing credible: the plain clamp (the best there is), flagged below.
            kept[:] = np.maximum(part, 0)
            worst = math.inf
            continue
        for first, last in groups:
            inside = slice(first, last + 1)
            kept[:bins][inside] = _allocate(negatives[inside], sigma=sigma)
            kept[bins:][inside] = _allocate(positives[inside], sigma=sigma)
        # The signed sums estimate the class counts without the clamp's upward bias.
        smaller = float(min(negatives.sum(), positives.sum()))
        worst = max(worst, relative_noise(sigma=sigma, bins=bins, total=smaller))
    return NoisyHistogram(out, sigma, worst, sigma > 0 and worst > NOISE_DOMINATED)


HULL_KEEPS = 0.9
"""A hull of ONE credible bucket keeping less than this share of the released units
means the rest were spread too thinly to clear the cut bucket by bucket (adaptive edges
on a small cohort): then the buckets are merged into credible runs (`credible_groups`)
instead of reading the rest as empty (AUC 0.500)."""
ALLOCATION_SIGMAS = 1.0
"""Inside a run, a bucket's share of the run's total follows its count less this many
noise stds (a bucket holding only noise keeps weight in ~16% of runs' buckets)."""


def credible_groups(totals: np.ndarray, *, sigma: float, z: float) -> list[tuple[int, int]]:
    """Runs of adjacent buckets, from the lowest score up, each closed as soon as its
    summed count (both classes: noise std sigma sqrt(2k) over k buckets) is credibly
    above the noise (>= z times that); trailing buckets that never get there join the
    last run. [] when no run is credible.

    Adaptive edges spread the held-out units evenly over the buckets, so with a small
    cohort no single bucket clears the cut although the histogram as a whole is far
    above the noise; merging neighbours keeps the resolution the noise allows instead of
    zeroing everything outside one bucket (which read AUC 0.500). The high-pass idea is
    Cormode, Procopiuc, Srivastava & Tran (ICDT 2012), applied to runs of buckets."""
    values = np.asarray(totals, dtype=np.float64).reshape(-1)
    groups: list[tuple[int, int]] = []
    start, running = 0, 0.0
    for index, value in enumerate(values):
        running += value
        width = index - start + 1
        if running > 0 and running >= z * sigma * math.sqrt(2.0 * width):
            groups.append((start, index))
            start, running = index + 1, 0.0
    if groups and start < values.size:
        groups[-1] = (groups[-1][0], values.size - 1)
    return groups


def _allocate(noisy: np.ndarray, *, sigma: float) -> np.ndarray:
    """The run's signed total (an unbiased estimate of its real count, clamped at 0)
    spread over its buckets in proportion to their counts soft-thresholded by
    `ALLOCATION_SIGMAS` noise stds (a bucket holding only noise rarely keeps any weight),
    else their clamped counts, else evenly; as integers that add up to the total
    (largest remainders)."""
    counts = np.asarray(noisy, dtype=np.int64)
    total = max(int(counts.sum()), 0)
    weights = np.maximum(counts - ALLOCATION_SIGMAS * sigma, 0.0).astype(np.float64)
    if weights.sum() <= 0:
        weights = np.maximum(counts, 0).astype(np.float64)
    if weights.sum() <= 0:
        weights = np.ones_like(weights, dtype=np.float64)
    raw: np.ndarray = total * weights / weights.sum()
    out: np.ndarray = np.floor(raw).astype(np.int64)
    short = total - int(out.sum())
    if short > 0:
        out[np.argsort(-(raw - out), kind="stable")[:short]] += 1
    return out


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


def multiclass_score_histogram(
    scores: np.ndarray, labels: np.ndarray, *, bins: int | None = None,
    edges: Sequence[np.ndarray] | None = None,
) -> np.ndarray:
    """K one-vs-rest binary histograms, concatenated: 2 * bins * K int64 counts (class
    k's block counted with ``edges[k]``, or all with `default_edges(bins)`).

    Sums across sites like the binary histogram, so it travels through SecAgg the same way.
    """
    s, y = _check_probabilities(scores, labels)
    if not np.all((s >= 0.0) & (s <= 1.0)):
        raise ValidationError("scores must lie in [0, 1]")
    layout = _block_edges(bins, edges, s.shape[1])
    return np.concatenate([
        score_histogram(s[:, k], (y == k).astype(np.int64), edges=layout[k])
        for k in range(s.shape[1])
    ])


def multiclass_metrics_from_histogram(
    hist: np.ndarray, *, num_classes: int, bins: int | None = None,
    edges: Sequence[np.ndarray] | None = None,
) -> MulticlassMetrics:
    """One-vs-rest AUC per class from a (summed) `multiclass_score_histogram`."""
    counts = np.asarray(hist, dtype=np.int64).reshape(-1)
    if num_classes < 2:
        raise ValidationError("a multi-class histogram has at least 2 classes")
    layout = _block_edges(bins, edges, num_classes)
    sizes = [2 * (e.size - 1) for e in layout]
    if counts.size != sum(sizes):
        raise ValidationError(f"histogram must be {sum(sizes)} counts")
    starts = np.cumsum([0, *sizes])
    parts = [counts[start : start + size] for start, size in zip(starts, sizes, strict=False)]
    aucs = [metrics_from_histogram(part, edges=e).auc
            for part, e in zip(parts, layout, strict=True)]
    return MulticlassMetrics(tuple(aucs), _macro(aucs), int(parts[0].sum()))


