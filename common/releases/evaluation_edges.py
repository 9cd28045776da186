"""Where an evaluation histogram's bucket edges lie and how many buckets it counts with:
the default logit-scale layout, the first round's around a public probe of the model
(`probe_edges`), the next round's edges from the released quantiles moved with the
probe (post-processing of a DP release and of the public model: Dwork & Roth 2014,
Prop. 2.1), the site's boundary
check of announced edges (`round_edges`), and the bucket count that follows the noise
(`evaluation_bins`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from common.core.errors import ConfigError, ValidationError

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


def probe_edges(anchor: float, *, bins: int) -> np.ndarray:
    """The first evaluated round's `bins` + 1 edges around where a public probe of the
    model puts its scores (`common.models.probe`, post-processing of the public model):
    `bins` - 1 inner edges at `anchor` + DEFAULT_LOGIT_SPAN t^3 for t equally spaced on
    [-1, 1] on the logit scale, fine near the probe (0.09 logits either side of it at
    10 buckets) and as wide as `default_edges` at the ends, so a DP model's band a tenth
    of a logit wide lands in a bucket of its own size instead of one 1.5 logits wide.
    `default_edges` when the anchor is so far out that the edges pile at the limits."""
    if bins < 2:
        raise ConfigError("bins", "must be >= 2")
    if not math.isfinite(anchor):
        raise ValidationError("probe anchor must be finite")
    t = np.linspace(-1.0, 1.0, bins - 1) if bins > 2 else np.zeros(1)
    inner = np.clip(anchor + DEFAULT_LOGIT_SPAN * t**3, -LOGIT_LIMIT, LOGIT_LIMIT)
    out = np.concatenate([[0.0], _sigmoid(inner), [1.0]])
    return out if np.all(np.diff(out) > 0) else default_edges(bins)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64))))


def _logit(p: np.ndarray) -> np.ndarray:
    """log(p / (1 - p)) clipped to +-LOGIT_LIMIT (0 and 1 map to the limits)."""
    q = np.clip(np.asarray(p, dtype=np.float64), 1e-300, 1.0)
    with np.errstate(divide="ignore"):
        z = np.log(q) - np.log1p(-np.minimum(q, 1.0))
    return np.asarray(np.clip(z, -LOGIT_LIMIT, LOGIT_LIMIT))


FOLLOW_SHARE = 0.15
"""`next_edges` with a probe: the window around the released band, moved by the probe's
shift, is widened on each side by this share of the shift (the held-out scores and the
probe's do not move exactly together: 5-8% of the step on the imaging demo's DP model),
plus `FOLLOW_SPREAD` of the band's own width and `FOLLOW_FLOOR` logits."""
FOLLOW_SPREAD = 0.1
FOLLOW_FLOOR = 0.02
LOST_SPAN = 0.5
"""With a probe, an end bucket's unbounded side is read as ending this many logits
beyond both its inner edge and the probe (the held-out scores sat within 0.2 logits of
the probe on the imaging demo's DP model): an end bucket holding the released mass then
still places the next round's buckets near the scores."""


def next_edges(
    released: np.ndarray, *, edges: np.ndarray, bins: int | None = None,
    shift: float | None = None, anchor: float | None = None,
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

    With `shift` (the logit distance a public probe of the model moved in the step
    since the release, `common.models.probe`) and `anchor` (the probe's logit on the
    model the release evaluated), the next round evaluates a model whose scores moved:
    the released distribution is moved by `shift`, and instead of widening by `WIDEN`
    (at least `MIN_WIDTH` logits, far coarser than a DP model's band of a tenth of a
    logit) its range is widened by what the probe cannot know: `FOLLOW_SHARE` of the
    shift, `FOLLOW_SPREAD` of the range, `FOLLOW_FLOOR`. End buckets reach the logit
    limits; with an `anchor` their unbounded side ends as far beyond their inner edge
    as the occupied inner buckets reach (at most `LOST_SPAN`), or, with no inner bucket
    occupied, `LOST_SPAN` beyond the probe (a release that missed the band is found
    again near the probe instead of spread over a dozen logits). Post-processing of
    the release and the public model, as above.
    """
    e = _check_edges(edges)
    counted = e.size - 1
    bins = counted if bins is None else bins
    if bins < 2:
        raise ConfigError("bins", "must be >= 2")
    counts = np.asarray(released, dtype=np.float64).reshape(-1)
    if counts.shape != (2 * counted,):
        raise ValidationError(f"histogram must be {2 * counted} counts for {counted + 1} edges")
    negatives, positives = np.maximum(counts[:counted], 0.0), np.maximum(counts[counted:], 0.0)
    mass = negatives + positives
    if shift is not None and negatives.sum() > 0 and positives.sum() > 0:
        # Each class weighs the same: with the few buckets the noise allows, the middle
        # edge falls where the classes meet, not inside the larger class.
        mass = negatives / negatives.sum() + positives / positives.sum()
    total = float(mass.sum())
    if not total > 0:
        return default_edges(bins)
    z = _logit(e)
    occupied = np.flatnonzero(mass > 0)
    if shift is not None and anchor is not None:
        if not (math.isfinite(shift) and math.isfinite(anchor)):
            raise ValidationError("probe shift and anchor must be finite")
        inner = occupied[(occupied > 0) & (occupied < counted - 1)]
        if inner.size:  # the band reaches into an end bucket by about its inner width
            reach = min(float(z[inner[-1] + 1] - z[inner[0]]), LOST_SPAN)
            z[0] = max(-LOGIT_LIMIT, z[1] - reach)
            z[-1] = min(LOGIT_LIMIT, z[-2] + reach)
        else:
            z[0] = max(-LOGIT_LIMIT, min(z[1], anchor) - LOST_SPAN)
            z[-1] = min(LOGIT_LIMIT, max(z[-2], anchor) + LOST_SPAN)
        if occupied.size == 1:  # a band narrower than its bucket: look near the probe
            k = int(occupied[0])
            low = max(z[k], min(z[k + 1], anchor) - LOST_SPAN)
            high = min(z[k + 1], max(z[k], anchor) + LOST_SPAN)
            z[k], z[k + 1] = low, high
            z = np.maximum.accumulate(z)
    lower, upper = z[:-1], z[1:]
    a, b = float(lower[occupied[0]]), float(upper[occupied[-1]])
    if shift is None:
        width = max(b - a, MIN_WIDTH)
        centre = (a + b) / 2.0
        lo = max(centre - (0.5 + WIDEN) * width, -LOGIT_LIMIT)
        hi = min(centre + (0.5 + WIDEN) * width, LOGIT_LIMIT)
    else:
        if not math.isfinite(shift):
            raise ValidationError("probe shift must be finite")
        z = np.clip(z + shift, -LOGIT_LIMIT, LOGIT_LIMIT)
        lower, upper = z[:-1], z[1:]
        a, b = float(lower[occupied[0]]), float(upper[occupied[-1]])
        margin = FOLLOW_SHARE * abs(shift) + FOLLOW_SPREAD * (b - a) + FOLLOW_FLOOR
        lo, hi = max(a - margin, -LOGIT_LIMIT), min(b + margin, LOGIT_LIMIT)
        if not hi > lo:
            return default_edges(bins)
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
    released: np.ndarray, *, edges: Sequence[np.ndarray], bins: int | None = None,
    shifts: Sequence[float] | None = None, anchors: Sequence[float] | None = None,
) -> tuple[np.ndarray, ...]:
    """`next_edges` of each one-vs-rest block of a released (multi-class) histogram,
    each with `bins` buckets (default: as many as it has), each block followed by its
    probe's shift from its anchor where `shifts` and `anchors` are given."""
    counts = np.asarray(released).reshape(-1)
    sizes = [2 * (np.asarray(e).size - 1) for e in edges]
    if counts.size != sum(sizes):
        raise ValidationError(f"histogram of {counts.size} counts does not fit the edges")
    starts = np.cumsum([0, *sizes])
    if (shifts is None) != (anchors is None) or (
            shifts is not None and anchors is not None
            and not len(shifts) == len(anchors) == len(edges)):
        raise ValidationError(f"give a probe shift and anchor for each of {len(edges)} blocks")
    moves: list[tuple[float | None, float | None]] = (
        [(None, None)] * len(edges) if shifts is None or anchors is None
        else [(float(s), float(a)) for s, a in zip(shifts, anchors, strict=True)])
    return tuple(
        next_edges(counts[start : start + size], edges=e, bins=bins, shift=by, anchor=at)
        for start, size, e, (by, at) in zip(starts, sizes, edges, moves, strict=False)
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


def _block_edges(
    bins: int | None, edges: Sequence[np.ndarray] | None, num_classes: int
) -> tuple[np.ndarray, ...]:
    if edges is None:
        return tuple(_layout(bins, None) for _ in range(num_classes))
    if bins is not None or len(edges) != num_classes:
        raise ValidationError(f"give bins, or edges for each of the {num_classes} classes")
    return tuple(_check_edges(e) for e in edges)


def announced_histogram_bins(bins: int, *, num_classes: int) -> tuple[int, int]:
    """(aggregation.histogram_bins, aggregation.histogram_classes) for a study's
    ``[privacy.evaluation] histogram_bins`` and class count: K one-vs-rest blocks for
    K >= 3 classes (the announced bins cover all K blocks, so the vector keeps its
    ``2 * histogram_bins`` integer tail and only the layout inside it depends on the
    study both sides hold), the plain histogram for binary."""
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


