"""``kind = "count"``: the units in the cohort. Cells: cohort (then missing: the units
a filter value is missing for). One unit adds 1 to one cell: L1 = L2 = 1."""

from __future__ import annotations

import numpy as np

from common.releases.analytics.estimates import count_estimate
from common.releases.analytics.statistic import (
    Reading,
    StatisticKind,
    StatisticSpec,
    register_statistic,
)
from common.releases.analytics.units import Units
from common.releases.noisy_counts import credible_z
from common.study import Study


class Count(StatisticKind):
    name = "count"

    def cells(self, spec: StatisticSpec, study: Study) -> tuple[str, ...]:
        return ("cohort",)

    def count(self, spec: StatisticSpec, study: Study, units: Units, *,
              inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return (np.array([int(inside.sum())], dtype=np.int64),
                np.zeros(units.count, dtype=bool))

    def answer(self, spec: StatisticSpec, study: Study, sums: np.ndarray, *, sigma: float,
               level: float, rng: np.random.Generator) -> Reading:
        return Reading([count_estimate(float(sums[0]), sigma=sigma, cell="", quantity="count",
                                       cut=credible_z(1), level=level)])


register_statistic(Count())
