"""A query's integer vector: what each site sums under SecAgg+, one block per statistic.

Every privacy unit (a patient; a record when the study has no patient column) is
reduced to one value per feature and one outcome first (`common.releases.analytics.units`).
Then each unit lands in at most ONE "slot" of each block, which is what bounds its
contribution: a block is its kind's cells (`StatisticKind.count`, one module per kind in
``common/releases/analytics/statistics/``, where each kind's table of cells and
sensitivity is written), then one "missing" cell. The built-in kinds:

=============  ==========================================================  ==========
kind           cells (in order)                                            one unit
=============  ==========================================================  ==========
count          cohort, missing                                             1
rate           per stratum: with outcome, without outcome; then missing    1
mean           per stratum: sum q, sum (K - q); then missing (adds K)      (q, K - q)
histogram      per bin (or declared level); then missing                   1
kaplan_meier   per interval: events, censored; then beyond grid, missing   1
=============  ==========================================================  ==========

Sensitivity (add/remove one unit): a block moves by at most one slot, so
L1 = L2 = 1 for count, rate, histogram and Kaplan-Meier, and L1 = L2 = K for a mean
(`StatisticKind.sensitivity`).

Missing values: a unit whose value of a feature the statistic needs is missing (a filter
feature, a stratum, the summed or time feature) is excluded from the statistic and
counted in its block's "missing" cell (adding `StatisticKind.missing_scale`: K for a
mean, so the cell moves no more than the block's sensitivity), so the answer says how
many were excluded with DP noise like every other cell. Features declared
missing = "error" never are (the loader refuses the file).

Noise: each block is one distributed discrete Gaussian release (Kairouz, Liu & Steinke,
ICML 2021), its sigma calibrated from the statistic's own epsilon at the study's delta
by `common.releases.statistics.calibrate_count_sigma`, the calibration of the statistics release.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.core.errors import ValidationError
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.releases.analytics.query import Query, check_query_against_study
from common.releases.analytics.statistic import (
    StatisticSpec,
    kind_of,
    statistic_cells,
    statistic_length,
)
from common.releases.analytics.units import Units, table_units, value_missing
from common.releases.seam import NoisePlan
from common.releases.statistics import TableLike, calibrate_count_sigma
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
    return kind_of(spec).sensitivity(spec, study)


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


def cohort_masks(query: Query, units: Units, *, study: Study) -> tuple[np.ndarray, np.ndarray]:
    """(in the cohort, excluded for a missing value): a unit is in when every condition
    holds; excluded for a missing value when none of its known values fails a condition
    but some filter value is missing; out otherwise (counted nowhere)."""
    fails = np.zeros(units.count, dtype=bool)
    missing = np.zeros(units.count, dtype=bool)
    for condition in query.cohort:
        absent = value_missing(units, condition.feature)
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


def statistic_vector(spec: StatisticSpec, study: Study, units: Units, *, inside: np.ndarray,
                     filter_missing: np.ndarray) -> np.ndarray:
    """One statistic's block for a site's units: its kind's cells, then the units excluded
    for a missing value (a filter value, or one its kind reads) times the kind's
    `missing_scale` (module docstring)."""
    kind = kind_of(spec)
    counts, missing = kind.count(spec, study, units, inside=inside)
    length = statistic_length(spec, study)
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape != (length - 1,):
        raise ValidationError(f"statistic {spec.name!r}: {counts.size} counts for its "
                              f"{length - 1} cells")
    excluded = int((filter_missing | missing).sum()) * kind.missing_scale(spec, study)
    return np.concatenate([counts, [excluded]]).astype(np.int64)


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
    `common.releases.seam.sum_noise_sigmas`): sigma * sqrt(K / n_noise)."""
    k = max(contributors, 1)
    return [block.sigma * math.sqrt(k / block.n_noise) for block in blocks]


def describe(block: QueryBlock) -> dict[str, Any]:
    """A block as JSON data (for `query check` and the coordinator's record)."""
    return {"statistic": block.statistic, "kind": block.kind, "length": block.length,
            "epsilon": block.epsilon, "delta": block.delta, "sigma": block.sigma,
            "l1_sensitivity": block.l1_sensitivity, "l2_sensitivity": block.l2_sensitivity}
