"""``kind = "rate"``: the share of units with the outcome (the study's outcome class,
default its positive class), optionally by strata. Cells: per stratum, with outcome and
without outcome (then missing: a filter or stratum value is missing). The stratum's size
is the sum of its two cells, so it costs nothing extra (a block of "patients" and
"events" cells would move by 2 in L1 per unit): one unit adds 1 to one cell, L1 = L2 = 1.

The rate's interval is a parametric bootstrap of the ratio of the two noisy counts
(`common.releases.analytics.estimates.bootstrap_interval`); a stratum whose size is not
credibly above the noise is flagged."""

from __future__ import annotations

import math

import numpy as np

from common.core.errors import ValidationError
from common.releases.analytics.cells import (
    cells_by_stratum,
    count_cells,
    has_outcome,
    outcome_index,
    strata_index,
    strata_labels,
)
from common.releases.analytics.estimates import (
    Estimate,
    bootstrap_interval,
    count_estimate,
    normal_quantile,
    share_reader,
)
from common.releases.analytics.statistic import (
    Reading,
    StatisticKind,
    StatisticSpec,
    StudyCheck,
    register_statistic,
)
from common.releases.analytics.units import Units
from common.releases.noisy_counts import credible_z
from common.study import Study


class Rate(StatisticKind):
    name = "rate"
    options = frozenset({"by", "outcome"})

    def check_against_study(self, spec: StatisticSpec, check: StudyCheck) -> None:
        try:
            outcome_index(spec, check.study)
        except ValidationError as exc:
            raise check.fail("outcome", str(exc)) from None

    def cells(self, spec: StatisticSpec, study: Study) -> tuple[str, ...]:
        return cells_by_stratum(spec, study, ("with outcome", "without outcome"))

    def count(self, spec: StatisticSpec, study: Study, units: Units, *,
              inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        stratum, strata = strata_index(spec, study, units)
        usable = inside & (stratum >= 0)
        outcome = has_outcome(spec, study, units)
        slot = np.where(usable, 2 * stratum + np.where(outcome, 0, 1), -1)
        return count_cells(slot, 2 * strata), inside & (stratum < 0)

    def answer(self, spec: StatisticSpec, study: Study, sums: np.ndarray, *, sigma: float,
               level: float, rng: np.random.Generator) -> Reading:
        out = []
        labels = strata_labels(spec, study)
        cut = credible_z(len(labels))
        z = normal_quantile(level)
        read = share_reader(0)
        for i, label in enumerate(labels):
            pair = sums[2 * i : 2 * i + 2].astype(np.float64)
            n = float(pair.sum())
            value, low, high, spread = bootstrap_interval(read, pair, sigma=sigma, rng=rng,
                                                          level=level, bounds=(0.0, 1.0))
            small = sigma > 0 and n < cut * sigma * math.sqrt(2.0)
            rate = float(value[0])
            out.append(Estimate(label, "rate", rate, float(spread[0]), float(low[0]),
                                float(high[0]), flagged=small or not math.isfinite(rate)))
            out.append(Estimate(label, "patients", max(n, 0.0), sigma * math.sqrt(2.0),
                                max(n - z * sigma * math.sqrt(2.0), 0.0),
                                max(n + z * sigma * math.sqrt(2.0), 0.0), flagged=small))
            out.append(count_estimate(float(pair[0]), sigma=sigma, cell=label,
                                      quantity="with outcome", cut=cut, level=level))
        return Reading(out)


register_statistic(Rate())
