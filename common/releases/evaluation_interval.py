"""The interval of an AUC read from a DP-noised histogram release (`auc_interval`): the
noise simulated from the release itself plus the buckets' resolution; post-processing
of the release, no privacy cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.core.errors import ConfigError, ValidationError
from common.releases.evaluation import denoised_histogram

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
