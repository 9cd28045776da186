"""``kind = "kaplan_meier"``: a survival curve (Kaplan & Meier, JASA 1958) of the
study's outcome over a numeric time ``feature`` on the declared time ``grid``.

A unit is at risk in every interval up to its time, so a block of at-risk counts would
move by up to sqrt(k) in L2 over k intervals. The block releases instead, for each
interval, the units whose time falls in it, split by event / censored, plus those beyond
the grid (then missing): one unit adds 1 to one cell, L1 = L2 = 1. The answer derives
the at-risk counts as the sums of the later cells (post-processing): hazards d_j / r_j
are clipped into [0, 1] and the curve S_j = prod (1 - h_i) is made non-increasing by a
cumulative minimum (the consistency post-processing of Hay, Rastogi, Miklau & Suciu,
VLDB 2010, in its simplest monotone form). Pointwise bands come from the parametric
bootstrap (`common.releases.analytics.estimates.bootstrap_interval`), made
non-increasing the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.core.errors import ValidationError
from common.releases.analytics.cells import bin_labels, count_cells, has_outcome, outcome_index
from common.releases.analytics.estimates import (
    Estimate,
    bootstrap_interval,
    count_estimate,
    normal_quantile,
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


def survival_curve(cells: np.ndarray) -> np.ndarray:
    """S at the end of each interval from [..., 2k + 1] cells (events and censored per
    interval, then beyond the grid): hazards clipped into [0, 1], cumulative product,
    cumulative minimum (module docstring). An interval with no one credibly at risk
    (r <= 0) has hazard 0."""
    cells = np.asarray(cells, dtype=np.float64)
    k = (cells.shape[-1] - 1) // 2
    events = cells[..., 0 : 2 * k : 2]
    exits = events + cells[..., 1 : 2 * k : 2]
    beyond = cells[..., 2 * k : 2 * k + 1]
    at_risk = np.flip(np.cumsum(np.flip(exits, -1), -1), -1) + beyond
    with np.errstate(invalid="ignore", divide="ignore"):
        hazard = np.where(at_risk > 0, events / np.where(at_risk > 0, at_risk, 1.0), 0.0)
    hazard = np.clip(hazard, 0.0, 1.0)
    curve = np.cumprod(1.0 - hazard, axis=-1)
    out: np.ndarray = np.clip(np.minimum.accumulate(curve, axis=-1), 0.0, 1.0)
    return out


class KaplanMeier(StatisticKind):
    name = "kaplan_meier"
    options = frozenset({"feature", "grid", "outcome"})
    plots = True

    def check_fields(self, spec: StatisticSpec) -> None:
        require_feature(spec)
        if spec.grid is None:
            raise ValueError("kind = 'kaplan_meier' needs grid = [t0, t1, ...] (the time grid)")

    def check_against_study(self, spec: StatisticSpec, check: StudyCheck) -> None:
        try:
            outcome_index(spec, check.study)
        except ValidationError as exc:
            raise check.fail("outcome", str(exc)) from None
        check.feature("feature", spec.feature or "", "numeric")

    def cells(self, spec: StatisticSpec, study: Study) -> tuple[str, ...]:
        grid = spec.grid or ()
        cells: list[str] = []
        for label in bin_labels(grid, closed_last=False):
            cells += [f"{label}: events", f"{label}: censored"]
        return (*cells, f">= {grid[-1]:g}")

    def count(self, spec: StatisticSpec, study: Study, units: Units, *,
              inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        grid = spec.grid or ()
        t = units.numeric[spec.feature or ""]
        usable = inside & ~np.isnan(t)
        intervals = len(grid) - 1
        interval = np.searchsorted(np.asarray(grid[1:], dtype=np.float64), np.nan_to_num(t),
                                   side="right")
        event = has_outcome(spec, study, units)
        slot = np.where(interval >= intervals, 2 * intervals,
                        2 * interval + np.where(event, 0, 1))
        return count_cells(np.where(usable, slot, -1), 2 * intervals + 1), inside & np.isnan(t)

    def answer(self, spec: StatisticSpec, study: Study, sums: np.ndarray, *, sigma: float,
               level: float, rng: np.random.Generator) -> Reading:
        grid = spec.grid or ()
        k = len(grid) - 1
        cells = sums.astype(np.float64)
        curve, low, high, spread = bootstrap_interval(survival_curve, cells, sigma=sigma,
                                                      rng=rng, level=level, bounds=(0.0, 1.0))
        low = np.minimum.accumulate(np.minimum(low, curve))
        high = np.minimum.accumulate(np.maximum(high, curve))
        events = cells[0 : 2 * k : 2]
        exits = events + cells[1 : 2 * k : 2]
        at_risk = np.flip(np.cumsum(np.flip(exits))) + cells[2 * k]
        z = normal_quantile(level)
        cut = credible_z(k)
        out = []
        for j in range(k):
            label = f"[{grid[j]:g}, {grid[j + 1]:g})"
            risk_std = sigma * math.sqrt(2 * (k - j) + 1)
            not_credible = sigma > 0 and at_risk[j] < cut * risk_std
            out.append(Estimate(label, "survival", float(curve[j]), float(spread[j]),
                                float(low[j]), float(high[j]), flagged=bool(not_credible)))
            out.append(Estimate(label, "at risk", max(float(at_risk[j]), 0.0), risk_std,
                                max(float(at_risk[j]) - z * risk_std, 0.0),
                                max(float(at_risk[j]) + z * risk_std, 0.0),
                                flagged=bool(not_credible)))
            out.append(count_estimate(float(events[j]), sigma=sigma, cell=label,
                                      quantity="events", cut=cut, level=level))
        notes = ["Kaplan-Meier on the grid: a unit is at risk in an interval when its time "
                 "is at or after the interval's start; events and censoring inside an "
                 "interval count at its end"]
        return Reading(out, notes, grid=tuple(grid))

    def plot(self, estimates: Sequence[Estimate], axes: Any, *, grid: tuple[float, ...],
             level: float) -> None:
        """The curve as steps, with its pointwise band."""
        rows = [e for e in estimates if e.quantity == "survival"]
        times = list(grid)
        s = [1.0] + [e.value for e in rows]
        lo = [1.0] + [e.low for e in rows]
        hi = [1.0] + [e.high for e in rows]
        axes.step(times, s, where="post", color="#4477aa", label="survival (DP)")
        axes.fill_between(times, lo, hi, step="post", alpha=0.25, color="#4477aa",
                          label=f"{level:.0%} band")
        axes.set_ylim(0.0, 1.02)
        axes.set_xlabel("time")
        axes.set_ylabel("survival")
        axes.legend(loc="lower left", fontsize=8)


register_statistic(KaplanMeier())
