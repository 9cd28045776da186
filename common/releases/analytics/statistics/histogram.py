"""``kind = "histogram"``: a feature's distribution. Cells: per bin of a numeric
feature's ``bins`` (values below the first edge or above the last fall into the end
bins), or per declared level of a categorical feature (then missing). One unit adds 1 to
one cell: L1 = L2 = 1. Each cell reads as a noisy count, flagged when it is not credibly
above the noise (Bonferroni over the block's cells)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from common.releases.analytics.cells import bin_index, bin_labels, count_cells
from common.releases.analytics.estimates import Estimate, count_estimate
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


class Histogram(StatisticKind):
    name = "histogram"
    options = frozenset({"feature", "bins"})
    plots = True

    def check_fields(self, spec: StatisticSpec) -> None:
        require_feature(spec)

    def check_against_study(self, spec: StatisticSpec, check: StudyCheck) -> None:
        feature = check.feature("feature", spec.feature or "")
        if feature.type == "numeric" and spec.bins is None:
            raise check.fail("bins", f"numeric feature {feature.name!r} needs bins = [edges]")
        if feature.type == "categorical" and spec.bins is not None:
            raise check.fail("bins", f"categorical feature {feature.name!r} is counted by its "
                             "declared levels (no bins)")

    def cells(self, spec: StatisticSpec, study: Study) -> tuple[str, ...]:
        feature = study.feature(spec.feature or "")
        return tuple(bin_labels(spec.bins) if spec.bins is not None
                     else feature.levels or ())

    def count(self, spec: StatisticSpec, study: Study, units: Units, *,
              inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        name = spec.feature or ""
        if spec.bins is not None:
            slot = bin_index(units.numeric[name], spec.bins)
        else:
            slot = units.categorical[name].astype(np.int64)
        cells = len(self.cells(spec, study))
        return count_cells(np.where(inside, slot, -1), cells), inside & (slot < 0)

    def answer(self, spec: StatisticSpec, study: Study, sums: np.ndarray, *, sigma: float,
               level: float, rng: np.random.Generator) -> Reading:
        cells = self.cells(spec, study)
        cut = credible_z(len(cells))
        return Reading([count_estimate(float(sums[i]), sigma=sigma, cell=cell,
                                       quantity="count", cut=cut, level=level)
                        for i, cell in enumerate(cells)])

    def plot(self, estimates: Sequence[Estimate], axes: Any, *, grid: tuple[float, ...],
             level: float) -> None:
        """Bars with their intervals, grey where not credibly above the noise."""
        rows = [e for e in estimates if e.quantity == "count"]
        x = np.arange(len(rows))
        values = np.array([e.value for e in rows])
        lows = values - np.array([e.low for e in rows])
        highs = np.array([e.high for e in rows]) - values
        colours = ["#bbbbbb" if e.flagged else "#4477aa" for e in rows]
        axes.bar(x, values, color=colours, yerr=[lows, highs], capsize=2)
        axes.set_xticks(x, [e.cell for e in rows], rotation=45, ha="right", fontsize=7)
        axes.set_ylabel("patients (DP)")


register_statistic(Histogram())
