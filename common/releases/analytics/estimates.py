"""One reported number of a query's answer and how its interval is computed: the reading
tools every statistic's answer is written with (`common.releases.analytics.answer`).

Post-processing of the released sum and the public noise stds only: no privacy cost
(Dwork & Roth 2014, Prop. 2.1).

* A noisy count: its std sigma and noisy +- z sigma (the summed discrete Gaussian has
  variance at most sigma^2, Canonne, Kamath & Steinke, NeurIPS 2020, Prop. 19; z the
  normal quantile), clipped at 0.
* A function of several noisy counts (a ratio, a survival curve): a parametric bootstrap
  (Efron & Tibshirani 1993, ch. 6 and 13), as `common.releases.evaluation_interval` does
  for the AUC: the released counts clamped at 0 stand in for the true ones, are re-noised
  `DRAWS` times with the known noise, and read as the answer reads them; each bound is
  the wider of the percentile one and the basic one (released value minus the reading's
  error on the stand-in).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

LEVEL = 0.95
"""Nominal coverage of every interval."""
DRAWS = 2000
"""Parametric bootstrap draws per ratio statistic (Monte Carlo error on a 2.5 % quantile
~0.35 percentage points of coverage)."""


def json_number(value: float) -> float | None:
    """`value` as JSON holds it: None for NaN and infinities."""
    return float(value) if math.isfinite(value) else None


@dataclass(frozen=True)
class Estimate:
    """One reported number: `value` with the std of its noise and its interval."""

    cell: str
    quantity: str
    value: float
    std: float
    low: float
    high: float
    flagged: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"cell": self.cell, "quantity": self.quantity, "value": json_number(self.value),
                "std": json_number(self.std), "low": json_number(self.low),
                "high": json_number(self.high), "flagged": self.flagged}


def normal_quantile(level: float) -> float:
    """z of a two-sided interval of coverage `level`."""
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def count_estimate(noisy: float, *, sigma: float, cell: str, quantity: str, cut: float,
                   level: float = LEVEL, scale: float = 1.0) -> Estimate:
    """A noisy count (in units of `scale`): clamped at 0, interval noisy +- z sigma;
    flagged when it is not `cut` noise stds above 0."""
    z = normal_quantile(level)
    value = noisy / scale
    std = sigma / scale
    return Estimate(cell, quantity, max(value, 0.0), std, max(value - z * std, 0.0),
                    max(value + z * std, 0.0), flagged=noisy < cut * sigma and sigma > 0)


def bootstrap_interval(
    read: Callable[[np.ndarray], np.ndarray], released: np.ndarray, *, sigma: float,
    rng: np.random.Generator, level: float = LEVEL, draws: int = DRAWS,
    bounds: tuple[float, float] = (-math.inf, math.inf),
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(value, low, high, std) of `read` (a function of a [..., cells] array of counts
    returning [..., outputs]) on the noisy `released` counts: parametric bootstrap with
    the clamped counts as the truth's stand-in (module docstring), each bound the wider
    of the percentile and the basic one, clipped into `bounds`."""
    released = np.asarray(released, dtype=np.float64)
    value = np.asarray(read(released), dtype=np.float64)
    if sigma <= 0:
        return value, value.copy(), value.copy(), np.zeros_like(value)
    truth = np.maximum(released, 0.0)
    plugged = np.asarray(read(truth), dtype=np.float64)
    noise = np.rint(rng.normal(0.0, sigma, size=(draws, released.size)))
    simulated = np.asarray(read(truth[None, :] + noise), dtype=np.float64)
    tail = (1.0 - level) / 2.0
    with np.errstate(invalid="ignore"):
        q_low = np.nanquantile(simulated, tail, axis=0)
        q_high = np.nanquantile(simulated, 1.0 - tail, axis=0)
    low = np.fmin(q_low, value - (q_high - plugged))
    high = np.fmax(q_high, value + (plugged - q_low))
    lo, hi = bounds
    with np.errstate(invalid="ignore"):
        std = np.nanstd(simulated, axis=0)
    return value, np.clip(np.nan_to_num(low, nan=lo), lo, hi), np.clip(
        np.nan_to_num(high, nan=hi), lo, hi), np.nan_to_num(std, nan=math.inf)


def share_reader(numerator_index: int) -> Callable[[np.ndarray], np.ndarray]:
    """The share of a pair of counts [a, b]: a / (a + b), NaN when a + b <= 0."""

    def read(pair: np.ndarray) -> np.ndarray:
        a = pair[..., numerator_index]
        n = pair[..., 0] + pair[..., 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(n > 0, np.clip(a / np.where(n > 0, n, 1.0), 0.0, 1.0), np.nan)
        return np.asarray(share)[..., None]

    return read
