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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.errors import ConfigError, ValidationError
from common.noisy_counts import (
    NOISE_DOMINATED,
    credible_support,
    credible_z,
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


DEFAULT_LOGIT_SPAN = 6.0
"""`default_edges` spreads its buckets over [-6, 6] on the logit scale (s = 0.0025 ..
0.9975)."""
LOGIT_LIMIT = 12.0
"""`next_edges` works on the logit scale clipped to +-LOGIT_LIMIT (s = 6e-6 .. 0.999994),
so that over the rounds it can follow even a confident model's scores."""
UNIFORM_SHARE = 0.2
"""Share of the buckets `next_edges` spreads evenly over the widened range (the rest
follow the released distribution's quantiles)."""
WIDEN = 0.5
"""`next_edges` widens the released scores' range by this fraction of its width on each
side (at least `MIN_WIDTH` logits in all): room for the model's scores to move."""
MIN_WIDTH = 0.5


def _check_edges(edges: np.ndarray, *, what: str = "histogram edges") -> np.ndarray:
    e = np.asarray(edges, dtype=np.float64).reshape(-1)
    if e.size < 3 or not np.all(np.isfinite(e)):
        raise ValidationError(f"{what}: need at least 3 finite edges (2 buckets)")
    if e[0] != 0.0 or e[-1] != 1.0:
        raise ValidationError(f"{what}: the first edge must be 0 and the last 1")
    if not np.all(np.diff(e) > 0):
        raise ValidationError(f"{what} must be strictly increasing")
    return e


def _layout(bins: int | None, edges: np.ndarray | None) -> np.ndarray:
    """The edges of a call given `bins` (the default layout) or `edges`, not both."""
    if edges is not None:
        if bins is not None:
            raise ConfigError("bins", "give either bins (the default layout) or edges")
        return _check_edges(edges)
    if bins is None:
        raise ConfigError("bins", "give either bins (the default layout) or edges")
    return default_edges(bins)


def default_edges(bins: int) -> np.ndarray:
    """`bins` + 1 edges: 0, then `bins` - 1 equally spaced on the logit scale over
    [-DEFAULT_LOGIT_SPAN, DEFAULT_LOGIT_SPAN], then 1 (for 2 buckets the one inner edge
    is 0.5)."""
    if bins < 2:
        raise ConfigError("bins", "must be >= 2")
    span = DEFAULT_LOGIT_SPAN
    inner = np.linspace(-span, span, bins - 1) if bins > 2 else np.zeros(1)
    return np.concatenate([[0.0], _sigmoid(inner), [1.0]])


def uniform_edges(bins: int) -> np.ndarray:
    """`bins` equal-width buckets on [0, 1] (edges i / bins)."""
    if bins < 2:
        raise ConfigError("bins", "must be >= 2")
    return np.arange(bins + 1, dtype=np.float64) / bins


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64))))


def _logit(p: np.ndarray) -> np.ndarray:
    """log(p / (1 - p)) clipped to +-LOGIT_LIMIT (0 and 1 map to the limits)."""
    q = np.clip(np.asarray(p, dtype=np.float64), 1e-300, 1.0)
    with np.errstate(divide="ignore"):
        z = np.log(q) - np.log1p(-np.minimum(q, 1.0))
    return np.asarray(np.clip(z, -LOGIT_LIMIT, LOGIT_LIMIT))


def next_edges(
    released: np.ndarray, *, edges: np.ndarray, bins: int | None = None
) -> np.ndarray:
    """The `bins` (default: as many as `edges` has; `evaluation_bins` chooses them from
    the noise) bucket edges of the next round from one block ([negatives | positives])
    of the score histogram a round released, counted with `edges`: quantiles of the pooled
    released scores, mixed (1 - UNIFORM_SHARE : UNIFORM_SHARE) with a uniform spread
    over their range widened by `WIDEN` on each side, all on the logit scale.

    Pure post-processing of the released (noisy, already accounted) histogram -- pass
    `denoised_histogram(...).counts`, so that buckets holding only noise do not count.
    Inside a bucket the released mass is taken as uniform in logit. The mixture's CDF is
    strictly increasing over the widened range, so its quantiles are strictly
    increasing edges; the outer edges stay 0 and 1, so every score has a bucket.
    No released mass: `default_edges`.
    """
    e = _check_edges(edges)
    counted = e.size - 1
    bins = counted if bins is None else bins
    if bins < 2:
        raise ConfigError("bins", "must be >= 2")
    counts = np.asarray(released, dtype=np.float64).reshape(-1)
    if counts.shape != (2 * counted,):
        raise ValidationError(f"histogram must be {2 * counted} counts for {counted + 1} edges")
    mass = np.maximum(counts[:counted], 0.0) + np.maximum(counts[counted:], 0.0)
    total = float(mass.sum())
    if not total > 0:
        return default_edges(bins)
    z = _logit(e)
    lower, upper = z[:-1], z[1:]
    occupied = np.flatnonzero(mass > 0)
    a, b = float(lower[occupied[0]]), float(upper[occupied[-1]])
    width = max(b - a, MIN_WIDTH)
    centre = (a + b) / 2.0
    lo = max(centre - (0.5 + WIDEN) * width, -LOGIT_LIMIT)
    hi = min(centre + (0.5 + WIDEN) * width, LOGIT_LIMIT)
    knots = np.unique(np.concatenate([[lo, hi], z[(z > lo) & (z < hi)]]))
    # The released CDF at the knots: each bucket's mass spread evenly over its logits
    # (a bucket of zero logit width, clipped at the limit, counts as a step).
    span = upper - lower
    safe = np.where(span > 0, span, 1.0)
    frac = np.where(
        span[None, :] > 0,
        np.clip((knots[:, None] - lower[None, :]) / safe[None, :], 0.0, 1.0),
        (knots[:, None] >= lower[None, :]).astype(np.float64),
    )
    released_cdf = frac @ mass / total
    cdf = (1.0 - UNIFORM_SHARE) * released_cdf + UNIFORM_SHARE * (knots - lo) / (hi - lo)
    cdf[0], cdf[-1] = 0.0, 1.0  # all released mass lies inside [lo, hi]
    quantiles = np.interp(np.arange(1, bins) / bins, cdf, knots)
    out = np.concatenate([[0.0], _sigmoid(quantiles), [1.0]])
    if not np.all(np.diff(out) > 0):  # float64 cannot separate them: start over
        return default_edges(bins)
    return out


def next_block_edges(
    released: np.ndarray, *, edges: Sequence[np.ndarray], bins: int | None = None
) -> tuple[np.ndarray, ...]:
    """`next_edges` of each one-vs-rest block of a released (multi-class) histogram,
    each with `bins` buckets (default: as many as it has)."""
    counts = np.asarray(released).reshape(-1)
    sizes = [2 * (np.asarray(e).size - 1) for e in edges]
    if counts.size != sum(sizes):
        raise ValidationError(f"histogram of {counts.size} counts does not fit the edges")
    starts = np.cumsum([0, *sizes])
    return tuple(
        next_edges(counts[start : start + size], edges=e, bins=bins)
        for start, size, e in zip(starts, sizes, edges, strict=False)
    )


def round_edges(
    announced: Sequence[float], *, bins: int, blocks: int = 1
) -> tuple[np.ndarray, ...]:
    """The edges of each of `blocks` one-vs-rest blocks of a round whose announced
    ``histogram_bins`` is `bins` (bins / blocks buckets per block): the announced edges
    (`blocks` x (bins / blocks + 1) values, each block strictly increasing from 0 to 1,
    finite) or, when none were announced, `default_edges`. ValidationError otherwise:
    the same edges at every site and at the coordinator, or the sum means nothing."""
    if blocks < 1 or bins % blocks or bins // blocks < 2:
        raise ValidationError(f"histogram_bins {bins} is not (bins >= 2) x {blocks} classes")
    per_block = bins // blocks
    values = tuple(announced)
    if not values:
        return tuple(default_edges(per_block) for _ in range(blocks))
    if len(values) != blocks * (per_block + 1):
        raise ValidationError(
            f"histogram_edges: {len(values)} values, expected {blocks} x {per_block + 1} "
            f"(histogram_bins {bins} in {blocks} block(s))")
    flat = np.asarray(values, dtype=np.float64)
    return tuple(
        _check_edges(flat[k * (per_block + 1) : (k + 1) * (per_block + 1)],
                     what=f"histogram_edges block {k}")
        for k in range(blocks)
    )


def announced_edge_blocks(values: Sequence[float], *, bins: int) -> int:
    """How many blocks announced edges cover for ``histogram_bins`` = `bins` (0: none),
    checked the way `round_edges` checks them."""
    if not values:
        return 0
    blocks = len(values) - bins
    if blocks < 1 or bins % blocks:
        raise ValidationError(
            f"histogram_edges: {len(values)} values do not fit histogram_bins {bins}")
    round_edges(values, bins=bins, blocks=blocks)
    return blocks


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
      hull of such buckets both classes hold 0, inside each count is clamped at 0
      (Cormode et al., ICDT 2012; common.noisy_counts). Clamping alone gave every empty
      bucket ~0.4 sigma fake units, which with few held-out positives dragged the ROC and
      Youden's threshold into buckets holding nothing but noise;
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
        support = credible_support(negatives + positives, sigma=sigma * math.sqrt(2.0), z=z)
        lone_bucket = support.first == support.last and (
            support.kept_total < HULL_KEEPS * support.noisy_total
        )
        if not support.empty and not lone_bucket:
            inside = slice(support.first, support.last + 1)
            kept[:bins][inside] = np.maximum(negatives[inside], 0)
            kept[bins:][inside] = np.maximum(positives[inside], 0)
            smaller = float(min(negatives[inside].sum(), positives[inside].sum()))
            width = support.last - support.first + 1
            worst = max(worst, relative_noise(sigma=sigma, bins=width, total=smaller))
            continue
        groups = credible_groups(negatives + positives, sigma=sigma, z=z)
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


def _block_edges(
    bins: int | None, edges: Sequence[np.ndarray] | None, num_classes: int
) -> tuple[np.ndarray, ...]:
    if edges is None:
        return tuple(_layout(bins, None) for _ in range(num_classes))
    if bins is not None or len(edges) != num_classes:
        raise ValidationError(f"give bins, or edges for each of the {num_classes} classes")
    return tuple(_check_edges(e) for e in edges)


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


# ----------------------------------------------------- resolution and interval from noise

def block_bins(
    released: np.ndarray, *, blocks: int, noise_std: float, max_bins: int
) -> int:
    """`evaluation_bins` of a released histogram of `blocks` one-vs-rest blocks (its
    class totals: the counts' sums per half); the fewest over the blocks, since every
    block of a round has as many buckets."""
    counts = np.asarray(released, dtype=np.float64).reshape(-1)
    if blocks < 1 or counts.size % (2 * blocks):
        raise ValidationError(f"histogram of {counts.size} counts is not {blocks} x 2 halves")
    return min(
        evaluation_bins(positives=float(part[part.size // 2 :].sum()),
                        negatives=float(part[: part.size // 2].sum()),
                        noise_std=noise_std, max_bins=max_bins)
        for part in np.split(counts, blocks)
    )


def evaluation_bins(
    *, positives: float, negatives: float, noise_std: float, max_bins: int
) -> int:
    """How many score buckets (per block) the next DP evaluation should count with, from
    the class totals a previous evaluation RELEASED (`positives`, `negatives`: the noisy
    sums, post-processing) and the public per-count noise std; in [2, `max_bins`].

    The error of an AUC read from a B-bucket histogram has two parts:

    * resolution: a positive and a negative sharing a bucket count as half a correct
      ranking, so the bucketed AUC is within half the share of such pairs of the exact
      one (`metrics_from_histogram`). With quantile edges (`next_edges`) each bucket
      holds ~1/B of the scores, so at worst (classes overlapping) ~1/(2B);
    * noise: every count carries noise of std sigma, whether or not it holds a score.
      AUC = sum_i n_i (P_above_i + p_i / 2) / (P N); dAUC/dp_i = (F_i - AUC) / P and
      dAUC/dn_i = (G_i - AUC) / N with F_i, G_i in [0, 1], so by the delta method its
      noise std is at most sigma sqrt(B) sqrt(1/P^2 + 1/N^2) = sigma sqrt(B) / m
      (m = P N / sqrt(P^2 + N^2), about the smaller class's count).

    1/(2B) + sigma sqrt(B) / m is smallest at B = (m / sigma)^(2/3): the bias-variance
    balance behind histogram bin rules (Scott, Biometrika 1979: n^(1/3) buckets), here
    with the DP noise in the variance term, as for perturbed histograms in Wasserman &
    Zhou, "A statistical framework for differential privacy", JASA 2010. A small
    held-out cohort gets few wide buckets, a large one more; B never grows with sigma
    and never shrinks with the cohort. No noise: `max_bins`. Classes not both released
    above zero: 2 (nothing finer can be read)."""
    if max_bins < 2:
        raise ConfigError("bins", "must be >= 2")
    if not (math.isfinite(positives) and math.isfinite(negatives)
            and math.isfinite(noise_std)):
        raise ValidationError("class totals and noise std must be finite")
    if noise_std <= 0:
        return max_bins
    if positives <= 0 or negatives <= 0:
        return 2
    m = positives * negatives / math.hypot(positives, negatives)
    best = (m / noise_std) ** (2.0 / 3.0)
    return int(min(max(math.floor(best + 1e-9), 2), max_bins))


AUC_INTERVAL_LEVEL = 0.95
"""Nominal coverage of `auc_interval`."""
AUC_INTERVAL_DRAWS = 400
"""Parametric draws behind `auc_interval` (its Monte Carlo error on a 2.5% quantile is
~0.8 percentage points of coverage)."""
UNREADABLE_WIDTH = 0.5
"""An AUC whose interval is wider than this is reported as too noisy to read."""


@dataclass(frozen=True)
class AucInterval:
    """A DP AUC with the interval the exact held-out AUC lies in (`auc_interval`)."""

    auc: float
    low: float
    high: float
    noise_low: float  # the noise part alone: an interval for the bucketed AUC
    noise_high: float
    resolution: float  # half the share of positive-negative pairs sharing a bucket

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def readable(self) -> bool:
        return math.isfinite(self.width) and self.width <= UNREADABLE_WIDTH

    def metrics(self) -> dict[str, float]:
        return {"auc_interval_low": self.low, "auc_interval_high": self.high,
                "auc_resolution": self.resolution}


def _pair_shares(counts: np.ndarray, *, blocks: int) -> tuple[float, float, float]:
    """(AUC, strict, weak) of non-negative bucket counts, each the mean over the
    one-vs-rest blocks: strict = share of positive-negative pairs whose positive lies in
    a higher bucket, weak = that plus the share sharing a bucket, AUC = strict + ties / 2
    (the trapezoid of `metrics_from_histogram`). The exact AUC of the scores behind the
    counts lies in [strict, weak]. A block missing a class: (0.5, 0, 1)."""
    aucs, stricts, weaks = [], [], []
    for part in np.split(np.asarray(counts, dtype=np.float64), blocks):
        bins = part.size // 2
        negatives, positives = part[:bins], part[bins:]
        pairs = float(negatives.sum() * positives.sum())
        if pairs <= 0:
            aucs.append(0.5)
            stricts.append(0.0)
            weaks.append(1.0)
            continue
        above = np.concatenate([np.cumsum(positives[::-1])[::-1][1:], [0.0]])
        strict = float(negatives @ above) / pairs
        tie = float(negatives @ positives) / pairs
        aucs.append(strict + tie / 2.0)
        stricts.append(strict)
        weaks.append(strict + tie)
    return float(np.mean(aucs)), float(np.mean(stricts)), float(np.mean(weaks))


def _read(raw: np.ndarray, *, blocks: int, noise_std: float) -> tuple[float, float, float]:
    """`_pair_shares` of a raw summed histogram read as the coordinator reads it
    (`denoised_histogram` first)."""
    return _pair_shares(
        denoised_histogram(raw, blocks=blocks, noise_std=noise_std).counts, blocks=blocks)


PLUG_IN_SIGMAS = 2.0
"""`auc_interval`'s second stand-in zeroes class counts released under this many noise
stds."""


def _plug_ins(raw: np.ndarray, *, blocks: int, noise_std: float) -> list[np.ndarray]:
    """The counts `auc_interval` re-noises: the denoised release, and the same with each
    class count released under `PLUG_IN_SIGMAS` noise stds set to 0 (one when they are
    the same, e.g. without noise)."""
    counts = denoised_histogram(raw, blocks=blocks, noise_std=noise_std).counts
    zeroed = np.where(raw >= PLUG_IN_SIGMAS * noise_std, counts, 0)
    if np.array_equal(zeroed, counts) or zeroed.sum() <= 0:
        return [counts]
    return [counts, zeroed]


def auc_interval(
    released: np.ndarray, *, edges: Sequence[np.ndarray], noise_std: float,
    rng: np.random.Generator, draws: int = AUC_INTERVAL_DRAWS,
    level: float = AUC_INTERVAL_LEVEL,
) -> AucInterval:
    """The reported DP AUC of a released (raw, noisy, summed) histogram counted with
    `edges` (one array per one-vs-rest block), and an interval, in AUC units, for the
    exact AUC of the held-out scores behind it.

    Computed from the released counts and the public per-count noise std alone:
    post-processing, no privacy cost (Dwork & Roth 2014, Prop. 2.1).

    * Resolution: whatever the scores inside a bucket, the exact AUC lies between the
      share of positive-negative pairs the buckets order strictly ("strict") and that
      plus the share sharing a bucket ("weak"; the bucketed AUC counts ties half). So
      the interval is a lower bound for strict and an upper bound for weak, each at
      (1 - `level`) / 2: a bucket count and its noise both move them, and both are in
      the simulation (a tie share read off the noisy counts as a fixed number was not
      enough: noise in an empty bucket can fake a split).
    * Noise, by parametric bootstrap (Efron & Tibshirani 1993, ch. 6 and 13): counts
      standing in for the true ones (`_plug_ins`) are re-noised `draws` times with the
      known noise (Gaussian of std `noise_std`, rounded: the discrete Gaussian the sites
      add is within a rounding of it) and read exactly as the coordinator reads a
      release (`denoised_histogram`). Reading a noisy release moves strict, weak and the
      AUC (clamped noise adds fake counts): for each stand-in a bound is the wider of
      the percentile one and the basic one, which subtracts the reading's error on the
      stand-in (quantile - value of the stand-in) from the released value; the result
      is the widest over both stand-ins. No single stand-in is right everywhere: the
      denoised release keeps the fake counts (too little error when a class is absent
      from buckets, e.g. separable classes), the one with class counts under 2 sigma
      zeroed drops real small counts (too little when classes overlap). Coverage over
      seeded cohorts and noise: tests/unit/test_evaluation_interval.py.

    `noise_low`/`noise_high` are the same bounds for the bucketed AUC itself; `resolution`
    is half the released tie share. Clipped to [0, 1]. `rng` must be seeded by the
    caller (same release, same seed: the same interval, which anyone holding the release
    can recompute)."""
    if not 0.0 < level < 1.0 or draws < 20:
        raise ConfigError("level", "must lie in (0, 1), with at least 20 draws")
    raw = np.asarray(released, dtype=np.int64).reshape(-1)
    blocks = len(edges)
    if blocks < 1 or raw.size != sum(2 * (np.asarray(e).size - 1) for e in edges):
        raise ValidationError(f"histogram of {raw.size} counts does not fit the edges")
    sigma = max(float(noise_std), 0.0)
    released_values = np.array(_read(raw, blocks=blocks, noise_std=sigma))
    auc, strict, weak = (float(v) for v in released_values)
    low = np.array([auc, strict, strict])  # bounds of (AUC, strict, weak) so far
    high = np.array([auc, weak, weak])
    tail = (1.0 - level) / 2.0
    stand_ins = _plug_ins(raw, blocks=blocks, noise_std=sigma)
    per_stand_in = draws // len(stand_ins) if sigma > 0 else 0
    for truth in stand_ins:
        if per_stand_in == 0:
            break
        noise = np.rint(rng.normal(0.0, sigma, size=(per_stand_in, raw.size)))
        simulated = np.array([
            _read(truth + row.astype(np.int64), blocks=blocks, noise_std=sigma)
            for row in noise
        ])
        q_low, q_high = np.quantile(simulated, [tail, 1.0 - tail], axis=0)
        plugged = np.array(_pair_shares(truth, blocks=blocks))
        low = np.minimum(low, np.minimum(q_low, released_values - (q_high - plugged)))
        high = np.maximum(high, np.maximum(q_high, released_values + (plugged - q_low)))
    low, high = np.clip(low, 0.0, 1.0), np.clip(high, 0.0, 1.0)
    return AucInterval(
        auc, float(low[1]), float(high[2]), float(low[0]), float(high[0]),
        (weak - strict) / 2.0,
    )


def interval_text(auc: float, low: float, high: float) -> str:
    """How the product prints a DP AUC: "0.912 (95% interval 0.85-0.97)", or, for an
    interval wider than `UNREADABLE_WIDTH`, that the evaluation is too noisy to read."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"{auc:.3f}"
    if high - low > UNREADABLE_WIDTH:
        return (f"too noisy to read (DP estimate {auc:.2f}, 95% interval "
                f"{low:.2f}-{high:.2f})")
    return f"{auc:.3f} (95% interval {low:.3f}-{high:.3f})"
