"""A query's integer vector: what each site sums under SecAgg+, one block per statistic.

Every privacy unit (a patient; a record when the study has no patient column) is
reduced to one value per feature first, exactly as the study's statistics release does
(`common.releases.statistics.unit_values`: the mean of its numeric values, its most frequent
level) and one outcome (whether any of its records has the outcome class). Then each
unit lands in at most ONE "slot" of each block, which is what bounds its contribution:

=============  ==========================================================  ==========
kind           cells (in order)                                            one unit
=============  ==========================================================  ==========
count          cohort, missing                                             1
rate           per stratum: with outcome, without outcome; then missing    1
mean           per stratum: sum q, sum (K - q); then missing (adds K)      (q, K - q)
histogram      per bin (or declared level); then missing                   1
kaplan_meier   per interval: events, censored; then beyond grid, missing   1
=============  ==========================================================  ==========

A mean's value x is clipped into the declared [low, high] and quantised to
q = round((x - low) / resolution) in 0..K, K = (high - low) / resolution; the pair
(q, K - q) lets the answer read both the stratum's size n = (sum q + sum (K - q)) / K
and its sum, with the L2 norm of one unit's pair at most K (at q = 0 or K).

Sensitivity (add/remove one unit): a block moves by at most one slot, so
L1 = L2 = 1 for count, rate, histogram and Kaplan-Meier, and L1 = L2 = K for a mean
(|q| + |K - q| = K; sqrt(q^2 + (K - q)^2) <= K). The Kaplan-Meier block releases, per
interval, the units whose time falls in it (with or without the event), never the
at-risk counts themselves: a unit is at risk in every interval up to its time, so
releasing at-risk counts directly would move by up to sqrt(k) in L2 over k intervals;
the answer derives at-risk counts as the sums of the later cells (post-processing).

Missing values: a unit whose value of a feature the statistic needs is missing (a filter
feature, a stratum, the summed or time feature) is excluded from the statistic and
counted in its block's "missing" cell, so the answer says how many were excluded with
DP noise like every other cell. Features declared missing = "error" never are (the
loader refuses the file).

Noise: each block is one distributed discrete Gaussian release (Kairouz, Liu & Steinke,
ICML 2021), its sigma calibrated from the statistic's own epsilon at the study's delta
by `common.releases.statistics.calibrate_count_sigma`, the calibration of the statistics release.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.core.errors import ValidationError
from common.privacy.ddgauss import epsilon_from_rho
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.releases.analytics.query import (
    Query,
    StatisticSpec,
    check_query_against_study,
    outcome_index,
    statistic_cells,
    statistic_length,
    steps,
    value_range,
)
from common.releases.seam import NoisePlan
from common.releases.statistics import TableLike, calibrate_count_sigma, unit_values
from common.study import Study

MAX_SITE_VALUE = 1 << 28
"""The public cap of every entry of one site's vector: an entry beyond it saturates at it
(`site_vector`). The masked vector is a signed 32-bit ring (`common.releases.egress`), and the sum
over sites plus noise must stay inside it. Only a mean at a fine resolution over a large
site reaches it (K = 10,000 steps: about 26,800 patients in one stratum)."""


@dataclass(frozen=True)
class QueryBlock:
    """One statistic's part of the query vector and its noise for `n_noise` honest
    sites: `cells` label each entry, `l1_sensitivity` / `l2_sensitivity` bound one
    unit's contribution, `sigma` is the std of the summed noise per entry that spends
    `epsilon` at `delta`."""

    statistic: str
    kind: str
    cells: tuple[str, ...]
    l1_sensitivity: float
    l2_sensitivity: float
    epsilon: float
    delta: float
    n_noise: int
    sigma: float

    @property
    def length(self) -> int:
        return len(self.cells)

    def plan(self) -> NoisePlan:
        """The release seam's plan of this block (`NoisePlan.mechanism()` is its ledger
        record)."""
        return NoisePlan(sigma=self.sigma, n_noise=self.n_noise, length=self.length,
                         l2_sensitivity=self.l2_sensitivity, l1_sensitivity=self.l1_sensitivity)


# --------------------------------------------------------------------------- layout


def statistic_sensitivity(spec: StatisticSpec, study: Study) -> tuple[float, float]:
    """(L1, L2) of one statistic's block for adding or removing one unit."""
    if spec.kind == "mean":
        k = float(steps(spec, study))
        return k, k
    return 1.0, 1.0


def query_length(query: Query, *, study: Study) -> int:
    return sum(statistic_length(spec, study) for spec in query.statistics)


def query_blocks(query: Query, *, study: Study, n_noise: int) -> list[QueryBlock]:
    """Every statistic's block, in query order, its noise planned for `n_noise` honest
    sites from the statistic's epsilon at the study's delta."""
    check_query_against_study(query, study)
    delta = study.privacy.delta
    blocks = []
    for i, spec in enumerate(query.statistics):
        cells = statistic_cells(spec, study)
        l1, l2 = statistic_sensitivity(spec, study)
        sigma = calibrate_count_sigma(
            epsilon=spec.epsilon, delta=delta, n_noise=n_noise, length=len(cells),
            l2_sensitivity=l2, l1_sensitivity=l1, field=f"statistics[{i}].epsilon")
        blocks.append(QueryBlock(
            statistic=spec.name, kind=spec.kind, cells=cells, l1_sensitivity=l1,
            l2_sensitivity=l2, epsilon=spec.epsilon, delta=delta, n_noise=n_noise,
            sigma=sigma))
    return blocks


def block_plans(query: Query, *, study: Study, n_noise: int) -> list[NoisePlan]:
    """One `NoisePlan` per statistic (`QueryBlock.plan`); a site's ledger entry for the
    query holds every plan's `mechanism()`."""
    return [block.plan() for block in query_blocks(query, study=study, n_noise=n_noise)]


def query_mechanisms(query: Query, *, study: Study,
                     n_noise: int) -> list[DistributedDiscreteGaussian]:
    """What a site's ledger entry for the query holds: one mechanism per statistic."""
    return [plan.mechanism() for plan in block_plans(query, study=study, n_noise=n_noise)]


def block_noise(plans: Sequence[NoisePlan], rng: Callable[[int], bytes]) -> np.ndarray:
    """This site's noise for the whole query vector (int64): each block's share
    (`NoisePlan.noise`) from `rng` (a CSPRNG in production:
    `common.crypto.random.system_random`), concatenated in block order."""
    if not plans:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([plan.noise(rng) for plan in plans]).astype(np.int64)


def query_epsilon(query: Query, *, study: Study, n_noise: int) -> float:
    """The query's epsilon at the study's delta with its blocks composed in zCDP (rho
    adds up: Bun & Steinke, TCC 2016, Lemma 2.3; each block's rho from KLS21 Prop. 14,
    `DistributedDiscreteGaussian.zcdp_rho`; converted by CKS20 Cor. 13): never above
    `Query.epsilon`, the sum of the statistics' epsilons. The ledger composes the same
    mechanisms in RDP on a grid of orders (`common.privacy.accountant`), which agrees
    to a fraction of a percent (tests/analytics/test_accounting.py)."""
    rho = math.fsum(plan.mechanism().zcdp_rho
                    for plan in block_plans(query, study=study, n_noise=n_noise))
    return epsilon_from_rho(rho, study.privacy.delta)


def block_slices(query: Query, *, study: Study) -> dict[str, slice]:
    """Where each statistic's block lies in the query vector."""
    out: dict[str, slice] = {}
    start = 0
    for spec in query.statistics:
        length = statistic_length(spec, study)
        out[spec.name] = slice(start, start + length)
        start += length
    return out


# --------------------------------------------------------------------------- site side


@dataclass(frozen=True)
class Units:
    """A site's table reduced to one value per privacy unit (module docstring)."""

    count: int
    numeric: dict[str, np.ndarray]  # float64, NaN: missing
    categorical: dict[str, np.ndarray]  # level index, -1: missing
    labels: np.ndarray | None  # per unit: the set of classes seen, as a bit mask


def table_units(table: TableLike, study: Study) -> Units:
    """One value per unit of each feature (`common.releases.statistics.unit_values`) and the
    classes each unit's records carry."""
    count, numeric, categorical = unit_values(table, study)
    labels = getattr(table, "labels", None)
    masks = None
    if labels is not None:
        if len(study.study.classes) > 62:
            raise ValidationError("queries read outcomes of studies with at most 62 classes")
        n = len(table)
        ids = table.patient_ids
        index = np.arange(n) if ids is None else np.unique(ids, return_inverse=True)[1].reshape(-1)
        masks = np.zeros(count, dtype=np.int64)
        np.bitwise_or.at(masks, index, np.left_shift(1, np.asarray(labels, dtype=np.int64)))
    return Units(count=count, numeric=numeric, categorical=categorical, labels=masks)


def _value_missing(units: Units, name: str) -> np.ndarray:
    out: np.ndarray = (np.isnan(units.numeric[name]) if name in units.numeric
                       else units.categorical[name] < 0)
    return out


def cohort_masks(query: Query, units: Units, *, study: Study) -> tuple[np.ndarray, np.ndarray]:
    """(in the cohort, excluded for a missing value): a unit is in when every condition
    holds; excluded for a missing value when none of its known values fails a condition
    but some filter value is missing; out otherwise (counted nowhere)."""
    fails = np.zeros(units.count, dtype=bool)
    missing = np.zeros(units.count, dtype=bool)
    for condition in query.cohort:
        absent = _value_missing(units, condition.feature)
        if condition.range is not None:
            values = units.numeric[condition.feature]
            low, high = condition.range
            with np.errstate(invalid="ignore"):
                ok = (values >= low) & (values <= high)
        else:
            levels = list(study.feature(condition.feature).levels or ())
            wanted = [levels.index(level) for level in condition.levels or ()]
            ok = np.isin(units.categorical[condition.feature], wanted)
        fails |= ~absent & ~ok
        missing |= absent
    inside = ~fails & ~missing
    return inside, ~fails & missing


def _bin_index(values: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Bin of each value over `edges`, values outside falling into the end bins; -1 for
    NaN."""
    inner = np.asarray(edges[1:-1], dtype=np.float64)
    index = np.searchsorted(inner, np.nan_to_num(values), side="right").astype(np.int64)
    out: np.ndarray = np.where(np.isnan(values), -1, index)
    return out


def _strata_index(spec: StatisticSpec, study: Study, units: Units) -> tuple[np.ndarray, int]:
    """Each unit's stratum (-1: a stratum value is missing) and the number of strata."""
    index = np.zeros(units.count, dtype=np.int64)
    missing = np.zeros(units.count, dtype=bool)
    total = 1
    for stratum in spec.by:
        if stratum.bins is not None:
            part = _bin_index(units.numeric[stratum.feature], stratum.bins)
            size = len(stratum.bins) - 1
        else:
            part = units.categorical[stratum.feature]
            size = len(study.feature(stratum.feature).levels or ())
        missing |= part < 0
        index = index * size + np.maximum(part, 0)
        total *= size
    return np.where(missing, -1, index), total


def _has_outcome(spec: StatisticSpec, study: Study, units: Units) -> np.ndarray:
    if units.labels is None:
        raise ValidationError(
            f"statistic {spec.name!r} needs the outcome: the file has no label column "
            f"{study.data.label_column!r}")
    out: np.ndarray = (units.labels >> outcome_index(spec, study)) & 1 == 1
    return out


def _count_cells(slot: np.ndarray, length: int) -> np.ndarray:
    return np.bincount(slot[slot >= 0], minlength=length).astype(np.int64)


def quantised(spec: StatisticSpec, study: Study, values: np.ndarray) -> np.ndarray:
    """q = round((clip(x, low, high) - low) / resolution) in 0..K (NaN stays NaN)."""
    low, high = value_range(spec, study)
    k = steps(spec, study)
    u = (np.clip(values, low, high) - low) / (high - low)
    out: np.ndarray = np.rint(u * k)
    return out


def statistic_vector(spec: StatisticSpec, study: Study, units: Units, *, inside: np.ndarray,
                     filter_missing: np.ndarray) -> np.ndarray:
    """One statistic's block for a site's units (module docstring)."""
    length = statistic_length(spec, study)
    out = np.zeros(length, dtype=np.int64)
    missing = filter_missing.copy()
    if spec.kind == "count":
        out[0] = int(inside.sum())
    elif spec.kind in ("rate", "mean"):
        stratum, _ = _strata_index(spec, study, units)
        if spec.kind == "mean":
            x = units.numeric[spec.feature or ""]
            stratum = np.where(np.isnan(x), -1, stratum)
        usable = inside & (stratum >= 0)
        missing |= inside & (stratum < 0)
        if spec.kind == "rate":
            outcome = _has_outcome(spec, study, units)
            slot = np.where(usable, 2 * stratum + np.where(outcome, 0, 1), -1)
            out[:-1] = _count_cells(slot, length - 1)
        else:
            k = steps(spec, study)
            q = np.where(usable, quantised(spec, study, x), 0).astype(np.int64)
            where = np.where(usable, stratum, 0)
            out[0:-1:2] = np.bincount(where, weights=np.where(usable, q, 0),
                                      minlength=(length - 1) // 2).astype(np.int64)
            out[1:-1:2] = np.bincount(where, weights=np.where(usable, k - q, 0),
                                      minlength=(length - 1) // 2).astype(np.int64)
    elif spec.kind == "histogram":
        name = spec.feature or ""
        if spec.bins is not None:
            slot = _bin_index(units.numeric[name], spec.bins)
        else:
            slot = units.categorical[name].astype(np.int64)
        missing |= inside & (slot < 0)
        out[:-1] = _count_cells(np.where(inside, slot, -1), length - 1)
    else:
        grid = spec.grid or ()
        t = units.numeric[spec.feature or ""]
        missing |= inside & np.isnan(t)
        usable = inside & ~np.isnan(t)
        intervals = len(grid) - 1
        interval = np.searchsorted(np.asarray(grid[1:], dtype=np.float64), np.nan_to_num(t),
                                   side="right")
        event = _has_outcome(spec, study, units)
        slot = np.where(interval >= intervals, 2 * intervals,
                        2 * interval + np.where(event, 0, 1))
        out[:-1] = _count_cells(np.where(usable, slot, -1), length - 1)
    scale = steps(spec, study) if spec.kind == "mean" else 1
    out[-1] = int(missing.sum()) * scale
    return out


def site_vector(query: Query, table: TableLike, *, study: Study) -> np.ndarray:
    """This site's exact int64 query vector (every block in query order) from its
    table: ALL the rows of its file under the study (`site_agent.data.load_study_table`),
    not a training split. Each unit's contribution to each block is within the block's
    sensitivities.

    Every entry saturates at the public cap `MAX_SITE_VALUE` instead of refusing the
    query: a refusal there, before any ledger entry, would tell the coordinator that
    some count of this site is past the cap (which site answers and which drops out is
    then an exact count, outside the ledger). Saturation is a contraction (|min(x, c) -
    min(y, c)| <= |x - y| per entry), so the block's L1 and L2 sensitivities hold
    unchanged; `common.releases.analytics.answer` flags a statistic whose sum may hold a
    saturated entry."""
    check_query_against_study(query, study)
    units = table_units(table, study)
    inside, filter_missing = cohort_masks(query, units, study=study)
    parts = [
        statistic_vector(spec, study, units, inside=inside, filter_missing=filter_missing)
        for spec in query.statistics
    ]
    vector: np.ndarray = np.concatenate(parts).astype(np.int64)
    saturated: np.ndarray = np.clip(vector, -MAX_SITE_VALUE, MAX_SITE_VALUE)
    return saturated


def noise_sigmas(blocks: Sequence[QueryBlock], *, contributors: int) -> list[float]:
    """Std of the noise on each entry of each block of the secure sum of `contributors`
    site vectors, every site having planned for n_noise honest shares (as
    `common.releases.seam.sum_noise_sigma`): sigma * sqrt(K / n_noise)."""
    k = max(contributors, 1)
    return [block.sigma * math.sqrt(k / block.n_noise) for block in blocks]


def describe(block: QueryBlock) -> dict[str, Any]:
    """A block as JSON data (for `query check` and the coordinator's record)."""
    return {"statistic": block.statistic, "kind": block.kind, "length": block.length,
            "epsilon": block.epsilon, "delta": block.delta, "sigma": block.sigma,
            "l1_sensitivity": block.l1_sensitivity, "l2_sensitivity": block.l2_sensitivity}
