"""``kind = "mean"``: the mean and sum of a numeric feature, optionally by strata.

A unit's value x is clipped into ``range = [low, high]`` (default: the study's declared
range of the feature) and quantised to q = round((x - low) / resolution) in 0..K,
K = (high - low) / resolution (at most `MAX_STEPS`). Cells: per stratum, sum q and sum
(K - q) (then missing, where an excluded unit adds K). The pair lets the answer read
both the stratum's size n = (sum q + sum (K - q)) / K and its sum, low * n + resolution
* sum q; one unit moves the block by at most K in L1 (|q| + |K - q| = K) and in L2
(sqrt(q^2 + (K - q)^2) <= K). The noise is K times that of a count, i.e. about
(high - low) / K per step: a finer resolution does not add noise to the mean.

The mean's interval is a parametric bootstrap of the share sum q / (sum q + sum (K - q))
(`common.releases.analytics.estimates.bootstrap_interval`), widened by half a
quantisation step (each unit's value is rounded to the resolution).
"""

from __future__ import annotations

import math

import numpy as np

from common.core.errors import ValidationError
from common.releases.analytics.cells import cells_by_stratum, strata_index, strata_labels
from common.releases.analytics.estimates import (
    Estimate,
    bootstrap_interval,
    normal_quantile,
    share_reader,
)
from common.releases.analytics.statistic import (
    Reading,
    StatisticKind,
    StatisticSpec,
    StudyCheck,
    register_statistic,
    require_feature,
)
from common.releases.analytics.units import Units
from common.releases.noisy_counts import credible_z
from common.study import Study

MAX_STEPS = 10_000
"""Most quantisation steps of a clipped sum ((high - low) / resolution): each unit's
value is at most this many integer units, so the summed vector stays far inside the
signed 32-bit ring of the masked vector."""


def value_range(spec: StatisticSpec, study: Study) -> tuple[float, float]:
    """The clip bounds of a mean: the statistic's ``range``, else the study's declared
    range of the feature."""
    if spec.range is not None:
        return spec.range
    feature = study.feature(spec.feature or "")
    if feature.range == "auto":
        raise ValidationError(
            f"statistic {spec.name!r}: feature {feature.name!r} has range = \"auto\" in the "
            "study; declare range = [low, high] in the query")
    return feature.range


def steps(spec: StatisticSpec, study: Study) -> int:
    """K = (high - low) / resolution of a mean: each unit's clipped value is an integer
    in 0..K."""
    low, high = value_range(spec, study)
    resolution = spec.resolution if spec.resolution is not None else (high - low) / 1000
    ratio = (high - low) / resolution
    k = round(ratio)
    if k < 1 or abs(ratio - k) > 1e-6 * max(k, 1):
        raise ValidationError(
            f"statistic {spec.name!r}: (high - low) / resolution = {ratio:g} must be a whole "
            "number of steps")
    if k > MAX_STEPS:
        raise ValidationError(
            f"statistic {spec.name!r}: {k} steps of resolution; at most {MAX_STEPS}")
    return k


def quantised(spec: StatisticSpec, study: Study, values: np.ndarray) -> np.ndarray:
    """q = round((clip(x, low, high) - low) / resolution) in 0..K (NaN stays NaN)."""
    low, high = value_range(spec, study)
    k = steps(spec, study)
    u = (np.clip(values, low, high) - low) / (high - low)
    out: np.ndarray = np.rint(u * k)
    return out


class Mean(StatisticKind):
    name = "mean"
    options = frozenset({"by", "feature", "range", "resolution"})

    def check_fields(self, spec: StatisticSpec) -> None:
        require_feature(spec)

    def check_against_study(self, spec: StatisticSpec, check: StudyCheck) -> None:
        check.feature("feature", spec.feature or "", "numeric")
        try:
            value_range(spec, check.study)
        except ValidationError as exc:
            raise check.fail("range", str(exc)) from None
        try:
            steps(spec, check.study)
        except ValidationError as exc:
            raise check.fail("resolution", str(exc)) from None

    def cells(self, spec: StatisticSpec, study: Study) -> tuple[str, ...]:
        return cells_by_stratum(spec, study, ("sum", "complement"))

    def sensitivity(self, spec: StatisticSpec, study: Study) -> tuple[float, float]:
        k = float(steps(spec, study))
        return k, k

    def missing_scale(self, spec: StatisticSpec, study: Study) -> int:
        return steps(spec, study)

    def count(self, spec: StatisticSpec, study: Study, units: Units, *,
              inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        stratum, strata = strata_index(spec, study, units)
        x = units.numeric[spec.feature or ""]
        stratum = np.where(np.isnan(x), -1, stratum)
        usable = inside & (stratum >= 0)
        k = steps(spec, study)
        q = np.where(usable, quantised(spec, study, x), 0).astype(np.int64)
        where = np.where(usable, stratum, 0)
        out = np.zeros(2 * strata, dtype=np.int64)
        out[0::2] = np.bincount(where, weights=np.where(usable, q, 0),
                                minlength=strata).astype(np.int64)
        out[1::2] = np.bincount(where, weights=np.where(usable, k - q, 0),
                                minlength=strata).astype(np.int64)
        return out, inside & (stratum < 0)

    def answer(self, spec: StatisticSpec, study: Study, sums: np.ndarray, *, sigma: float,
               level: float, rng: np.random.Generator) -> Reading:
        low, high = value_range(spec, study)
        k = steps(spec, study)
        resolution = (high - low) / k
        z = normal_quantile(level)
        out = []
        labels = strata_labels(spec, study)
        cut = credible_z(len(labels))
        read = share_reader(0)
        for i, label in enumerate(labels):
            pair = sums[2 * i : 2 * i + 2].astype(np.float64)
            n = float(pair.sum()) / k
            n_std = sigma * math.sqrt(2.0) / k
            small = sigma > 0 and float(pair.sum()) < cut * sigma * math.sqrt(2.0)
            share, s_low, s_high, spread = bootstrap_interval(
                read, pair, sigma=sigma, rng=rng, level=level, bounds=(0.0, 1.0))
            mean = low + (high - low) * float(share[0])
            half = resolution / 2.0
            mean_low = max(low + (high - low) * float(s_low[0]) - half, low)
            mean_high = min(low + (high - low) * float(s_high[0]) + half, high)
            out.append(Estimate(label, "mean", mean, (high - low) * float(spread[0]), mean_low,
                                mean_high, flagged=small or not math.isfinite(mean)))
            total = low * float(pair.sum()) / k + resolution * float(pair[0])
            total_std = sigma * math.hypot(low / k + resolution, low / k)
            slack = max(n + z * n_std, 0.0) * half
            out.append(Estimate(label, "sum", total, total_std, total - z * total_std - slack,
                                total + z * total_std + slack, flagged=small))
            out.append(Estimate(label, "patients", max(n, 0.0), n_std, max(n - z * n_std, 0.0),
                                max(n + z * n_std, 0.0), flagged=small))
        notes = [f"values clipped into [{low:g}, {high:g}] and rounded to steps of "
                 f"{resolution:g}; intervals are for the mean and sum of the clipped values"]
        return Reading(out, notes)


register_statistic(Mean())
