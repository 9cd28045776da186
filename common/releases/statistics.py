"""Federated DP statistics for preprocessing: what every site
releases once per study, before training, and how the coordinator turns the secure sum
into the `GlobalStatistics` every site (and `predict`) standardises and imputes with
(the release itself, as the seam runs it: `common.releases.plugins.statistics`).

Each privacy unit (a patient, or a record when the study has no patient column) gives
ONE value per feature: the mean of its non-missing values (numeric) or its most frequent
level (categorical). The release is one integer vector in the study's feature order:

====================  ======  ==========================================================
segment               length  one unit adds
====================  ======  ==========================================================
``units``             1       1
``<f>.sum``           1       u = (clip(x) - low) / (high - low), rounded to 0/1 at random
``<f>.sumsq``         1       u^2, rounded to 0/1 at random   (declared range only)
``<f>.missing``       1       1 if the unit has no value of f
``<f>.histogram``     B       1 in the fixed signed log-spaced bin of x  (range "auto")
``<f>.levels``        L       1 at the unit's level  (categorical)
====================  ======  ==========================================================

Randomised rounding (E[q] = u) keeps the estimates unbiased while every entry a unit
touches moves by at most 1: adding or removing one unit changes the vector by at most
`l1_sensitivity` in L1 and sqrt(`l2_squared`) in L2, whatever its values (clipping into
[low, high] bounds the real-valued sum by C = max(|low|, |high|) per unit).
Sites add discrete Gaussian noise in the integer ring before masking
(`common.privacy.ddgauss.count_noise`), planned for n_noise = round-size floor minus the
colluding sites (colluders know their own noise); the secure sum then carries the noise
of the distributed discrete Gaussian (Kairouz, Liu & Steinke, ICML 2021, Prop. 14),
recorded as one ledger entry with purpose "statistics".

For range = "auto" the clip range and a robust scale (IQR / 1.349, never below the
standard deviation of the clipped histogram) follow from the DP histogram in the same
release; the imputation value is its median. Only the bins whose
noisy count is credibly above the noise count (common.releases.noisy_counts; a plain clamp at 0
gave each of ~50 empty bins ~0.4 sigma fake units, enough to drag a small cohort's
1 % / 99 % quantiles out to +-1e4). Where the noise swamps a feature's values the
decoded statistics carry a warning naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from common.core.errors import ConfigError, ValidationError
from common.privacy.ddgauss import count_rho, epsilon_from_rho
from common.releases.noisy_counts import credible_support
from common.releases.seam import NoisePlan
from common.study import (
    CategoricalStatistics,
    GlobalStatistics,
    NumericStatistics,
    Study,
    study_sha256,
)

# Fixed signed log-spaced bin edges: 3 per decade from 1e-3 to 1e5 on each side, plus a
# bin around zero and one open bin at each end (51 bins). Public: they depend on nothing.
_POSITIVE_EDGES = 10.0 ** (np.arange(-9, 16) / 3.0)
LOG_EDGES = np.concatenate([-_POSITIVE_EDGES[::-1], _POSITIVE_EDGES])
HISTOGRAM_BINS = LOG_EDGES.size + 1
MIN_SCALE_FRACTION = 1e-3
NOISY_SCALE_FLOOR = 0.25
"""A declared-range feature's scale is never below this fraction of the largest standard
deviation a variable with the released mean can have in its range (Bhatia-Davis:
sqrt(mean_u * (1 - mean_u)) in range units). With few units the noise on the sum of
squares can exceed the variance itself; a scale near zero would blow the standardised
values up by orders of magnitude, while a scale too large only shrinks them (at most 4x
here). Post-processing of the DP release: no privacy cost."""
IQR_TO_STD = 1.349


@dataclass(frozen=True)
class StatisticsSegment:
    name: str
    start: int
    length: int


def statistics_layout(study: Study) -> tuple[StatisticsSegment, ...]:
    """The release's segments in vector order (module docstring)."""
    out: list[StatisticsSegment] = []
    position = 0

    def add(name: str, length: int) -> None:
        nonlocal position
        out.append(StatisticsSegment(name, position, length))
        position += length

    add("units", 1)
    for spec in study.features:
        if spec.type == "numeric":
            if spec.range == "auto":
                add(f"{spec.name}.missing", 1)
                add(f"{spec.name}.histogram", HISTOGRAM_BINS)
            else:
                add(f"{spec.name}.sum", 1)
                add(f"{spec.name}.sumsq", 1)
                add(f"{spec.name}.missing", 1)
        else:
            add(f"{spec.name}.missing", 1)
            add(f"{spec.name}.levels", len(spec.levels or ()))
    return tuple(out)


def statistics_length(study: Study) -> int:
    last = statistics_layout(study)[-1]
    return last.start + last.length


def l2_squared_sensitivity(study: Study) -> int:
    """Largest squared L2 change of the vector when one unit is added or removed:
    1 (units) + 2 per declared-range numeric feature (sum and sumsq) + 1 per other."""
    total = 1
    for spec in study.features:
        total += 2 if spec.type == "numeric" and spec.range != "auto" else 1
    return total


def l1_sensitivity(study: Study) -> int:
    """Every entry moves by at most 1, so the L1 bound equals the squared L2 one."""
    return l2_squared_sensitivity(study)


# --------------------------------------------------------------------------- site side


def _unit_index(patient_ids: np.ndarray | None, n: int) -> tuple[np.ndarray, int]:
    if patient_ids is None:
        return np.arange(n), n
    _, inverse = np.unique(patient_ids, return_inverse=True)
    return inverse.reshape(-1), int(inverse.max()) + 1 if n else 0


def unit_values(
    table: TableLike, study: Study
) -> tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(units, numeric, categorical): per unit, the mean of its non-missing values of each
    numeric feature (NaN: none) and its most frequent level index (-1: none)."""
    n = len(table)
    index, units = _unit_index(table.patient_ids, n)
    numeric: dict[str, np.ndarray] = {}
    categorical: dict[str, np.ndarray] = {}
    for spec in study.features:
        if spec.type == "numeric":
            raw = table.numeric[spec.name]
            present = ~np.isnan(raw)
            sums = np.bincount(index, weights=np.where(present, raw, 0.0), minlength=units)
            counts = np.bincount(index, weights=present.astype(np.float64), minlength=units)
            with np.errstate(invalid="ignore", divide="ignore"):
                numeric[spec.name] = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        else:
            levels = len(spec.levels or ())
            codes = table.categorical[spec.name]
            seen = codes >= 0
            grid = np.bincount(
                index[seen] * levels + codes[seen], minlength=units * levels
            ).reshape(units, levels)
            categorical[spec.name] = np.where(grid.sum(axis=1) > 0, grid.argmax(axis=1), -1)
    return units, numeric, categorical


def histogram_bin(values: np.ndarray) -> np.ndarray:
    """Index of each value's fixed log-spaced bin (0 .. HISTOGRAM_BINS - 1): the open
    bins at both ends, and the bin around zero in the middle.

    >>> histogram_bin(np.array([-1e6, -2e-3, 0.0, 2e-3, 1e6])).tolist()
    [0, 24, 25, 26, 50]
    """
    return np.searchsorted(LOG_EDGES, values, side="right")


def encode_release(
    table: TableLike, study: Study, *, uniform: Callable[[int], np.ndarray]
) -> np.ndarray:
    """This site's noiseless integer release (int64), `uniform(n)` giving n draws in
    [0, 1) for the randomised rounding (a CSPRNG in production)."""
    units, numeric, categorical = unit_values(table, study)
    vector = np.zeros(statistics_length(study), dtype=np.int64)
    where = {segment.name: segment for segment in statistics_layout(study)}
    vector[0] = units
    for spec in study.features:
        name = spec.name
        if spec.type == "numeric":
            values = numeric[name]
            present = ~np.isnan(values)
            vector[where[f"{name}.missing"].start] = int((~present).sum())
            kept = values[present]
            if spec.range == "auto":
                segment = where[f"{name}.histogram"]
                counts = np.bincount(histogram_bin(kept), minlength=HISTOGRAM_BINS)
                vector[segment.start : segment.start + segment.length] = counts
            else:
                low, high = spec.range
                u = (np.clip(kept, low, high) - low) / (high - low)
                vector[where[f"{name}.sum"].start] = int((uniform(u.size) < u).sum())
                vector[where[f"{name}.sumsq"].start] = int((uniform(u.size) < u * u).sum())
        else:
            codes = categorical[name]
            vector[where[f"{name}.missing"].start] = int((codes < 0).sum())
            segment = where[f"{name}.levels"]
            counts = np.bincount(codes[codes >= 0], minlength=segment.length)
            vector[segment.start : segment.start + segment.length] = counts
    return vector


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class StatisticsPlan(NoisePlan):
    """The noise of the release (`NoisePlan`: `sigma` of the summed noise per entry,
    split over `n_noise` sites, each adding N_Z(0, sigma^2 / n_noise)) and the
    `epsilon` at `delta` it was planned for."""

    epsilon: float
    delta: float


def _epsilon(sigma: float, *, n_noise: int, l2: float, l1: float, length: int,
             delta: float) -> float:
    rho = count_rho(sigma=sigma, n_noise=n_noise, l2_sensitivity=l2, length=length,
                    l1_sensitivity=l1)
    return epsilon_from_rho(rho, delta)


def calibrate_count_sigma(
    *, epsilon: float, delta: float, n_noise: int, length: int, l2_sensitivity: float,
    l1_sensitivity: float, field: str = "privacy.statistics_epsilon",
) -> float:
    """Smallest summed noise sigma of the distributed discrete Gaussian on an integer
    vector of `length` entries (sensitivities `l2_sensitivity`, `l1_sensitivity` per
    privacy unit) whose release costs at most `epsilon` at `delta`: bisection on the
    zCDP bound of `count_rho` (KLS21 Prop. 14 -> CKS20 Cor. 13). An epsilon too small
    to plan is a `ConfigError` naming `field`."""
    if n_noise < 1:
        raise ConfigError("n_noise", "at least one honest site must add noise")
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ConfigError(field, f"{epsilon!r} must be a positive number")
    l2, l1 = float(l2_sensitivity), float(l1_sensitivity)
    # Each site's discrete Gaussian needs a parameter of at least 1/2 (Prop. 14).
    low, high = 0.5 * math.sqrt(n_noise), 1e7
    if _epsilon(high, n_noise=n_noise, l2=l2, l1=l1, length=length, delta=delta) > epsilon:
        # Large sensitivities (clipped sums in fine steps) need a wider bracket.
        high = 1e7 * max(l2, 1.0)
        if _epsilon(high, n_noise=n_noise, l2=l2, l1=l1, length=length,
                    delta=delta) > epsilon:
            raise ConfigError(field, f"{epsilon:g} is too small to plan")
    if _epsilon(low, n_noise=n_noise, l2=l2, l1=l1, length=length, delta=delta) <= epsilon:
        high = low
    for _ in range(200):
        if high / low < 1 + 1e-6:
            break
        middle = math.sqrt(low * high)
        if _epsilon(middle, n_noise=n_noise, l2=l2, l1=l1, length=length,
                    delta=delta) <= epsilon:
            high = middle
        else:
            low = middle
    return high


def plan_statistics(study: Study, *, n_noise: int, epsilon: float | None = None,
                    delta: float | None = None) -> StatisticsPlan:
    """Smallest summed noise sigma whose release costs at most `epsilon` (default: the
    study's privacy.statistics_epsilon) at `delta` (default: the study's)
    (`calibrate_count_sigma`)."""
    eps = study.privacy.statistics_epsilon if epsilon is None else epsilon
    dlt = study.privacy.delta if delta is None else delta
    length = statistics_length(study)
    l2 = math.sqrt(l2_squared_sensitivity(study))
    l1 = float(l1_sensitivity(study))
    sigma = calibrate_count_sigma(epsilon=eps, delta=dlt, n_noise=n_noise, length=length,
                                  l2_sensitivity=l2, l1_sensitivity=l1)
    return StatisticsPlan(
        sigma=sigma, n_noise=n_noise, length=length, l2_sensitivity=l2, l1_sensitivity=l1,
        epsilon=eps, delta=dlt,
    )


# --------------------------------------------------------------------------- coordinator


def _quantile(counts: np.ndarray, q: float) -> float:
    """Quantile of a histogram over LOG_EDGES, linear inside a bin."""
    total = counts.sum()
    target = q * total
    cumulative = np.cumsum(counts)
    index = int(np.searchsorted(cumulative, target, side="left"))
    index = min(index, counts.size - 1)
    lower = LOG_EDGES[index - 1] if index > 0 else LOG_EDGES[0]
    upper = LOG_EDGES[index] if index < LOG_EDGES.size else LOG_EDGES[-1]
    before = cumulative[index - 1] if index > 0 else 0.0
    inside = counts[index]
    fraction = 0.5 if inside <= 0 else min(max((target - before) / inside, 0.0), 1.0)
    return float(lower + fraction * (upper - lower))


def _clipped_std(counts: np.ndarray, *, low: float, high: float) -> float:
    """Standard deviation of a histogram over LOG_EDGES clipped into [low, high], each
    bin's units spread uniformly over its clipped width (within-bin variance width^2/12).

    The scale's floor: where most units share one bin (a 0/1 column with rare ones, a
    count that is mostly zero) the IQR lies inside that bin and comes out orders of
    magnitude below the feature's spread, which would blow the rare values up to
    hundreds of standard units and make them dominate every clipped gradient.
    Post-processing of the released histogram: no privacy cost."""
    total = float(counts.sum())
    if total <= 0:
        return 0.0
    lower = np.concatenate([[LOG_EDGES[0]], LOG_EDGES])
    upper = np.concatenate([LOG_EDGES, [LOG_EDGES[-1]]])
    a, b = np.clip(lower, low, high), np.clip(upper, low, high)
    weights = counts.astype(np.float64) / total
    centres = (a + b) / 2.0
    mean = float(np.sum(weights * centres))
    variance = float(np.sum(weights * ((centres - mean) ** 2 + (b - a) ** 2 / 12.0)))
    return math.sqrt(max(variance, 0.0))


FALLBACK_LOW = float(LOG_EDGES[0])
FALLBACK_HIGH = float(LOG_EDGES[-1])
KEPT_FRACTION = 0.5
"""Below this fraction of the released units in credible bins, the "auto" range of a
feature is flagged as noise-dominated."""


def auto_statistics(
    noisy: np.ndarray, *, name: str, sigma: float, warnings: list[str]
) -> NumericStatistics:
    """Median, IQR / 1.349 and the 1 % / 99 % quantiles of the credible part of a noisy
    log-spaced histogram (`common.releases.noisy_counts.credible_support`: bins not credibly
    above the noise hold nothing; Cormode et al., ICDT 2012). Nothing credible: the
    neutral fallback (median 0, scale 1, the bins' whole range) and a warning."""
    support = credible_support(noisy, sigma=sigma)
    if support.empty:
        if sigma > 0:
            warnings.append(
                f"feature {name!r}: no histogram bin is credibly above the DP noise (sigma "
                f"{sigma:.3g} per bin); using median 0, scale 1, clip range "
                f"[{FALLBACK_LOW:g}, {FALLBACK_HIGH:g}]: declare its range in the study"
            )
        return NumericStatistics(
            mean=0.0, scale=1.0, impute=0.0, clip_low=FALLBACK_LOW, clip_high=FALLBACK_HIGH
        )
    counts = support.counts
    median = _quantile(counts, 0.5)
    iqr = _quantile(counts, 0.75) - _quantile(counts, 0.25)
    low, high = _quantile(counts, 0.01), _quantile(counts, 0.99)
    low, high = min(low, median), max(high, median)
    floor = max(abs(median), high - low, 1.0) * MIN_SCALE_FRACTION
    scale = max(iqr / IQR_TO_STD, _clipped_std(counts, low=low, high=high), floor)
    if high <= low:
        low, high = low - scale, high + scale
    # Noise-only mass a plain clamp at 0 would have added: ~0.4 sigma per empty bin.
    outside = counts.size - (support.last - support.first + 1)
    noise_mass = sigma / math.sqrt(2.0 * math.pi) * outside
    if sigma > 0 and (
        support.kept_total < KEPT_FRACTION * support.noisy_total
        or support.kept_total < noise_mass
    ):
        warnings.append(
            f"feature {name!r}: only {support.kept_total:.0f} of ~{support.noisy_total:.0f} "
            f"released units lie in histogram bins credibly above the DP noise (sigma "
            f"{sigma:.3g} per bin): its range [{low:.3g}, {high:.3g}] and scale "
            f"{scale:.3g} are uncertain; declare its range in the study"
        )
    return NumericStatistics(mean=median, scale=scale, impute=median, clip_low=low,
                             clip_high=high)


def decode_release(
    total: np.ndarray, study: Study, *, source: str, noise_sigma: float = 0.0
) -> GlobalStatistics:
    """GlobalStatistics from the noisy secure sum (int64); `noise_sigma`: the std of the
    noise on each entry (`common.releases.seam.sum_noise_sigmas`; 0 for a noiseless
    sum). Every estimate is clamped into what its definition allows; where the noise
    swamps a feature's values the result's `warnings` say so, naming the feature."""
    if total.shape != (statistics_length(study),):
        raise ValidationError("statistics sum does not match the study's layout")
    where = {segment.name: segment for segment in statistics_layout(study)}
    units = max(float(total[0]), 1.0)
    numeric: dict[str, NumericStatistics] = {}
    categorical: dict[str, CategoricalStatistics] = {}
    warnings: list[str] = []
    for spec in study.features:
        name = spec.name
        missing = max(float(total[where[f"{name}.missing"].start]), 0.0)
        if spec.type == "numeric" and spec.range != "auto":
            low, high = spec.range
            present = max(units - missing, 1.0)
            mean_u = min(max(float(total[where[f"{name}.sum"].start]) / present, 0.0), 1.0)
            m2 = min(max(float(total[where[f"{name}.sumsq"].start]) / present, 0.0), 1.0)
            widest = math.sqrt(mean_u * (1.0 - mean_u))
            measured = math.sqrt(max(m2 - mean_u * mean_u, 0.0))
            scale_u = max(measured, NOISY_SCALE_FLOOR * widest, MIN_SCALE_FRACTION)
            if noise_sigma > 0 and measured < NOISY_SCALE_FLOOR * widest:
                warnings.append(
                    f"feature {name!r}: the DP noise (sigma {noise_sigma:.3g} on sums over "
                    f"~{present:.0f} units) swamps its variance; scale held at "
                    f"{NOISY_SCALE_FLOOR:g} of the widest its mean allows "
                    f"({(high - low) * scale_u:.3g})"
                )
            mean = low + (high - low) * mean_u
            numeric[name] = NumericStatistics(
                mean=mean, scale=(high - low) * scale_u, impute=mean, clip_low=low,
                clip_high=high,
            )
        elif spec.type == "numeric":
            segment = where[f"{name}.histogram"]
            numeric[name] = auto_statistics(
                total[segment.start : segment.start + segment.length],
                name=name, sigma=noise_sigma, warnings=warnings,
            )
        else:
            segment = where[f"{name}.levels"]
            counts = total[segment.start : segment.start + segment.length]
            levels = list(spec.levels or ())
            categorical[name] = CategoricalStatistics(impute=levels[int(np.argmax(counts))])
    return GlobalStatistics(
        study_sha256=study_sha256(study), source=source[:200], numeric=numeric,
        categorical=categorical, warnings=tuple(w[:400] for w in warnings),
    )


class TableLike(Protocol):
    """What `unit_values` reads (site_agent.data.StudyTable satisfies it)."""

    @property
    def numeric(self) -> dict[str, np.ndarray]: ...
    @property
    def categorical(self) -> dict[str, np.ndarray]: ...
    @property
    def patient_ids(self) -> np.ndarray | None: ...

    def __len__(self) -> int: ...
