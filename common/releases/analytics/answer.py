"""Answers from a query's noisy secure sum, each with its noise and a confidence interval.

Everything here is post-processing of the released sum and the public noise stds: no
privacy cost (Dwork & Roth 2014, Prop. 2.1), nothing new leaves a site. The intervals
are for the exact value of the pooled cohort of the participating sites (what a central
analyst holding every file would compute with the same clipping, quantisation and time
grid): they account for the DP noise, not for sampling the cohort from a population.

* Counts (cohort, histogram bins, excluded for missing): the noisy count, its std sigma
  and noisy +- z sigma (the summed discrete Gaussian has variance at most sigma^2,
  Canonne, Kamath & Steinke, NeurIPS 2020, Prop. 19; z the normal quantile), clipped at 0.
* Rates and means: ratios of two noisy sums (numerator and stratum size). Their
  interval is a parametric bootstrap (Efron & Tibshirani 1993, ch. 6 and 13), as
  `common.releases.evaluation_interval` does for the AUC: the released counts clamped at 0 stand
  in for the true ones, are re-noised `DRAWS` times with the known noise, and read as the
  answer reads them; each bound is the wider of the percentile one and the basic one
  (released value minus the reading's error on the stand-in). A mean's interval is
  widened by half a quantisation step (each unit's value is rounded to the declared
  resolution). The draws are seeded from the query digest and the released sum, so
  anyone holding the release recomputes the same interval.
* Kaplan-Meier (Kaplan & Meier, JASA 1958) on the declared grid: at-risk counts are the
  sums of the released exits of later intervals (plus those beyond the grid), hazards
  d_j / r_j are clipped into [0, 1] and the curve S_j = prod (1 - h_i) is made
  non-increasing by a cumulative minimum (the consistency post-processing of Hay,
  Rastogi, Miklau & Suciu, VLDB 2010, here in its simplest monotone form). Pointwise
  bands come from the same bootstrap and are made non-increasing the same way.
* Flags: a cell is flagged when its count is not credibly above the noise, the cut of
  the statistics release (`common.releases.noisy_counts.credible_z`: z noise stds, Bonferroni
  over the block's cells; Cormode et al., ICDT 2012); a rate or mean when its stratum
  size is not, a survival point when the at-risk count is not.
* Saturation: each site's entry is capped at `MAX_SITE_VALUE` (`vector.site_vector`).
  Entries are non-negative counts, so no site can have reached the cap in a cell whose
  noisy sum is credibly below it; a statistic with a cell that is not is flagged whole,
  with a note (its sums may be lower bounds, its mean biased).
"""

from __future__ import annotations

import csv
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from common.core.errors import ValidationError
from common.releases.analytics.cost import ledger_epsilon
from common.releases.analytics.query import (
    Query,
    StatisticSpec,
    query_sha256,
    statistic_cells,
    steps,
    strata_labels,
    value_range,
)
from common.releases.analytics.vector import (
    MAX_SITE_VALUE,
    block_slices,
)
from common.releases.noisy_counts import credible_z
from common.study import Study, study_sha256

LEVEL = 0.95
"""Nominal coverage of every interval."""
DRAWS = 2000
"""Parametric bootstrap draws per ratio statistic (Monte Carlo error on a 2.5 % quantile
~0.35 percentage points of coverage)."""
FORMULA_STARTS = ("=", "+", "-", "@")


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
        return {"cell": self.cell, "quantity": self.quantity, "value": _num(self.value),
                "std": _num(self.std), "low": _num(self.low), "high": _num(self.high),
                "flagged": self.flagged}


@dataclass(frozen=True)
class StatisticAnswer:
    """One statistic's answer: its estimates, and the units excluded for a missing
    value (a noisy count like the others)."""

    name: str
    kind: str
    epsilon: float
    noise_std: float
    estimates: tuple[Estimate, ...]
    missing: Estimate
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "epsilon": self.epsilon,
                "noise_std": self.noise_std, "missing": self.missing.to_json(),
                "estimates": [e.to_json() for e in self.estimates], "notes": list(self.notes)}


@dataclass(frozen=True)
class QueryAnswer:
    """Every statistic of one query read from its noisy secure sum (`answer_query`)."""

    query_name: str
    query_sha256: str
    study_sha256: str
    contributors: int
    level: float
    statistics: tuple[StatisticAnswer, ...]
    grids: dict[str, tuple[float, ...]] = field(default_factory=dict)
    epsilon_composed: float = math.nan
    """What one run charged each answering site's ledger (`common.releases.analytics.cost.
    ledger_epsilon`, at the study's delta: a site of larger delta was charged less)."""

    @property
    def epsilon_sum(self) -> float:
        return math.fsum(s.epsilon for s in self.statistics)

    def statistic(self, name: str) -> StatisticAnswer:
        for answer in self.statistics:
            if answer.name == name:
                return answer
        raise ValidationError(f"answer has no statistic named {name!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "query": self.query_name, "query_sha256": self.query_sha256,
            "study_sha256": self.study_sha256, "contributors": self.contributors,
            "level": self.level, "epsilon": self.epsilon_sum,
            "epsilon_composed": _num(self.epsilon_composed),
            "statistics": [s.to_json() for s in self.statistics],
        }

    def write_csv(self, path: str | Path) -> Path:
        """One row per estimate (long format): statistic, kind, cell, quantity, value,
        std, low, high, flagged; the excluded-for-missing counts as quantity
        "excluded (missing)". Text cells that a spreadsheet would run as a formula are
        prefixed with an apostrophe."""
        path = Path(path)
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["statistic", "kind", "cell", "quantity", "value", "std", "low",
                             "high", "flagged"])
            for answer in self.statistics:
                for estimate in (*answer.estimates, answer.missing):
                    writer.writerow([
                        answer.name, answer.kind, _cell_text(estimate.cell),
                        estimate.quantity, _csv_num(estimate.value), _csv_num(estimate.std),
                        _csv_num(estimate.low), _csv_num(estimate.high),
                        "yes" if estimate.flagged else "no",
                    ])
        return path

    def write_plots(self, directory: str | Path) -> list[Path]:
        """A PNG per histogram (bars with their intervals) and per Kaplan-Meier curve
        (steps with the pointwise band), named QUERY-STATISTIC.png (matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for answer in self.statistics:
            if answer.kind not in ("histogram", "kaplan_meier"):
                continue
            figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
            try:
                if answer.kind == "histogram":
                    rows = [e for e in answer.estimates if e.quantity == "count"]
                    x = np.arange(len(rows))
                    values = np.array([e.value for e in rows])
                    lows = values - np.array([e.low for e in rows])
                    highs = np.array([e.high for e in rows]) - values
                    colours = ["#bbbbbb" if e.flagged else "#4477aa" for e in rows]
                    axes.bar(x, values, color=colours, yerr=[lows, highs], capsize=2)
                    axes.set_xticks(x, [e.cell for e in rows], rotation=45, ha="right",
                                    fontsize=7)
                    axes.set_ylabel("patients (DP)")
                else:
                    rows = [e for e in answer.estimates if e.quantity == "survival"]
                    grid = self.grids.get(answer.name, ())
                    times = list(grid)
                    s = [1.0] + [e.value for e in rows]
                    lo = [1.0] + [e.low for e in rows]
                    hi = [1.0] + [e.high for e in rows]
                    axes.step(times, s, where="post", color="#4477aa", label="survival (DP)")
                    axes.fill_between(times, lo, hi, step="post", alpha=0.25,
                                      color="#4477aa", label=f"{self.level:.0%} band")
                    axes.set_ylim(0.0, 1.02)
                    axes.set_xlabel("time")
                    axes.set_ylabel("survival")
                    axes.legend(loc="lower left", fontsize=8)
                axes.set_title(f"{self.query_name}: {answer.name} (epsilon {answer.epsilon:g})",
                               fontsize=9)
                figure.tight_layout()
                path = directory / f"{self.query_name}-{answer.name}.png"
                figure.savefig(path)
                written.append(path)
            finally:
                plt.close(figure)
        return written

    def render(self) -> str:
        """The text the operator sees."""
        level = f"{self.level:.0%}"
        lines = [f"query {self.query_name} ({self.query_sha256[:12]}), {self.contributors} "
                 f"sites, epsilon {self.epsilon_composed:.4g} charged to each site's ledger "
                 f"(its statistics composed; {self.epsilon_sum:g} summed)",
                 f"intervals: {level}, for the pooled cohort's exact value, DP noise included;"
                 " * = not credibly above the noise"]
        for answer in self.statistics:
            lines.append("")
            lines.append(f"{answer.name} ({answer.kind}, epsilon {answer.epsilon:g}, noise std "
                         f"{answer.noise_std:.3g} per cell)")
            for e in answer.estimates:
                cell = f"{e.cell}: " if e.cell else ""
                lines.append(f"  {cell}{e.quantity} {_fmt(e.value)} ({level} {_fmt(e.low)} to "
                             f"{_fmt(e.high)}, std {_fmt(e.std)}){' *' if e.flagged else ''}")
            m = answer.missing
            lines.append(f"  excluded for a missing value: {_fmt(m.value)} ({level} "
                         f"{_fmt(m.low)} to {_fmt(m.high)})")
            lines += [f"  note: {note}" for note in answer.notes]
        return "\n".join(lines)


def _num(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _csv_num(value: float) -> str:
    return repr(float(value)) if math.isfinite(value) else ""


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    if value == 0 or 1e-3 <= abs(value) < 1e6:
        return f"{value:.4g}" if abs(value) < 10 else f"{value:.1f}"
    return f"{value:.3g}"


def _cell_text(text: str) -> str:
    return "'" + text if text.startswith(FORMULA_STARTS) else text


# --------------------------------------------------------------------------- reading


def _z(level: float) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2.0)


def count_estimate(noisy: float, *, sigma: float, cell: str, quantity: str, cut: float,
                   level: float = LEVEL, scale: float = 1.0) -> Estimate:
    """A noisy count (in units of `scale`): clamped at 0, interval noisy +- z sigma."""
    z = _z(level)
    value = noisy / scale
    std = sigma / scale
    return Estimate(cell, quantity, max(value, 0.0), std, max(value - z * std, 0.0),
                    max(value + z * std, 0.0), flagged=noisy < cut * sigma and sigma > 0)


def _seed(digest: str, name: str, values: np.ndarray) -> np.random.Generator:
    data = digest.encode() + b"\0" + name.encode() + b"\0" + np.ascontiguousarray(
        values, dtype="<i8").tobytes()
    return np.random.default_rng(int.from_bytes(hashlib.sha256(data).digest()[:8], "big"))


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


def _ratio(numerator_index: int) -> Callable[[np.ndarray], np.ndarray]:
    """The share of a pair of counts [a, b]: a / (a + b), NaN when a + b <= 0."""

    def read(pair: np.ndarray) -> np.ndarray:
        a = pair[..., numerator_index]
        n = pair[..., 0] + pair[..., 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(n > 0, np.clip(a / np.where(n > 0, n, 1.0), 0.0, 1.0), np.nan)
        return np.asarray(share)[..., None]

    return read


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


def _answer_count(noisy: np.ndarray, sigma: float, level: float) -> list[Estimate]:
    return [count_estimate(float(noisy[0]), sigma=sigma, cell="", quantity="count",
                           cut=credible_z(1), level=level)]


def _answer_rate(spec: StatisticSpec, study: Study, noisy: np.ndarray, sigma: float,
                 level: float, rng: np.random.Generator) -> list[Estimate]:
    out = []
    labels = strata_labels(spec, study)
    cut = credible_z(len(labels))
    z = _z(level)
    read = _ratio(0)
    for i, label in enumerate(labels):
        pair = noisy[2 * i : 2 * i + 2].astype(np.float64)
        n = float(pair.sum())
        value, low, high, spread = bootstrap_interval(read, pair, sigma=sigma, rng=rng,
                                                      level=level, bounds=(0.0, 1.0))
        small = sigma > 0 and n < cut * sigma * math.sqrt(2.0)
        rate = float(value[0])
        out.append(Estimate(label, "rate", rate, float(spread[0]), float(low[0]), float(high[0]),
                            flagged=small or not math.isfinite(rate)))
        out.append(Estimate(label, "patients", max(n, 0.0), sigma * math.sqrt(2.0),
                            max(n - z * sigma * math.sqrt(2.0), 0.0),
                            max(n + z * sigma * math.sqrt(2.0), 0.0), flagged=small))
        out.append(count_estimate(float(pair[0]), sigma=sigma, cell=label,
                                  quantity="with outcome", cut=cut, level=level))
    return out


def _answer_mean(spec: StatisticSpec, study: Study, noisy: np.ndarray, sigma: float,
                 level: float, rng: np.random.Generator) -> tuple[list[Estimate], list[str]]:
    low, high = value_range(spec, study)
    k = steps(spec, study)
    resolution = (high - low) / k
    z = _z(level)
    out = []
    labels = strata_labels(spec, study)
    cut = credible_z(len(labels))
    read = _ratio(0)
    for i, label in enumerate(labels):
        pair = noisy[2 * i : 2 * i + 2].astype(np.float64)
        n = float(pair.sum()) / k
        n_std = sigma * math.sqrt(2.0) / k
        small = sigma > 0 and float(pair.sum()) < cut * sigma * math.sqrt(2.0)
        share, s_low, s_high, spread = bootstrap_interval(read, pair, sigma=sigma, rng=rng,
                                                          level=level, bounds=(0.0, 1.0))
        mean = low + (high - low) * float(share[0])
        half = resolution / 2.0
        mean_low = max(low + (high - low) * float(s_low[0]) - half, low)
        mean_high = min(low + (high - low) * float(s_high[0]) + half, high)
        out.append(Estimate(label, "mean", mean, (high - low) * float(spread[0]), mean_low,
                            mean_high,
                            flagged=small or not math.isfinite(mean)))
        total = low * float(pair.sum()) / k + resolution * float(pair[0])
        total_std = sigma * math.hypot(low / k + resolution, low / k)
        slack = max(n + z * n_std, 0.0) * half
        out.append(Estimate(label, "sum", total, total_std, total - z * total_std - slack,
                            total + z * total_std + slack, flagged=small))
        out.append(Estimate(label, "patients", max(n, 0.0), n_std, max(n - z * n_std, 0.0),
                            max(n + z * n_std, 0.0), flagged=small))
    notes = [f"values clipped into [{low:g}, {high:g}] and rounded to steps of "
             f"{resolution:g}; intervals are for the mean and sum of the clipped values"]
    return out, notes


def _answer_histogram(spec: StatisticSpec, study: Study, noisy: np.ndarray, sigma: float,
                      level: float) -> list[Estimate]:
    cells = statistic_cells(spec, study)[:-1]
    cut = credible_z(len(cells))
    return [count_estimate(float(noisy[i]), sigma=sigma, cell=cell, quantity="count",
                           cut=cut, level=level) for i, cell in enumerate(cells)]


def _answer_km(spec: StatisticSpec, noisy: np.ndarray, sigma: float, level: float,
               rng: np.random.Generator) -> list[Estimate]:
    grid = spec.grid or ()
    k = len(grid) - 1
    cells = noisy[:-1].astype(np.float64)
    curve, low, high, spread = bootstrap_interval(survival_curve, cells, sigma=sigma, rng=rng,
                                          level=level, bounds=(0.0, 1.0))
    low = np.minimum.accumulate(np.minimum(low, curve))
    high = np.minimum.accumulate(np.maximum(high, curve))
    events = cells[0 : 2 * k : 2]
    exits = events + cells[1 : 2 * k : 2]
    at_risk = np.flip(np.cumsum(np.flip(exits))) + cells[2 * k]
    z = _z(level)
    cut = credible_z(k)
    out = []
    for j in range(k):
        label = f"[{grid[j]:g}, {grid[j + 1]:g})"
        risk_std = sigma * math.sqrt(2 * (k - j) + 1)
        not_credible = sigma > 0 and at_risk[j] < cut * risk_std
        out.append(Estimate(label, "survival", float(curve[j]), float(spread[j]), float(low[j]),
                            float(high[j]), flagged=bool(not_credible)))
        out.append(Estimate(label, "at risk", max(float(at_risk[j]), 0.0), risk_std,
                            max(float(at_risk[j]) - z * risk_std, 0.0),
                            max(float(at_risk[j]) + z * risk_std, 0.0),
                            flagged=bool(not_credible)))
        out.append(count_estimate(float(events[j]), sigma=sigma, cell=label,
                                  quantity="events", cut=cut, level=level))
    return out


def may_be_saturated(block: np.ndarray, sigma: float) -> bool:
    """Whether some site's entry in `block` (a statistic's noisy secure sum) may have
    been capped at `MAX_SITE_VALUE`: a cell whose sum is not credibly below the cap
    (`credible_z` noise stds, Bonferroni over the block's cells). Entries are
    non-negative, so a site's capped entry puts the whole sum at or above the cap."""
    cut = credible_z(max(int(block.size), 1)) * sigma
    return bool(block.size) and bool(np.max(block) >= MAX_SITE_VALUE - cut)


def answer_query(query: Query, total: np.ndarray, *, study: Study,
                 noise_sigmas: Sequence[float], contributors: int,
                 level: float = LEVEL) -> QueryAnswer:
    """Every statistic of `query` read from `total`, the signed noisy secure sum of the
    sites' vectors (`common.releases.analytics.vector.site_vector`), `noise_sigmas` the std of the
    noise on each entry of each block (`vector.noise_sigmas`; 0 for a noiseless sum),
    `contributors` the sites whose vectors it sums."""
    total = np.asarray(total)
    slices = block_slices(query, study=study)
    length = max((s.stop for s in slices.values()), default=0)
    if total.shape != (length,):
        raise ValidationError(f"query {query.name!r}: the sum holds {total.size} values, the "
                              f"query's vector {length}")
    if len(noise_sigmas) != len(query.statistics):
        raise ValidationError(f"query {query.name!r}: {len(noise_sigmas)} noise stds for "
                              f"{len(query.statistics)} statistics")
    if not 0.0 < level < 1.0:
        raise ValidationError("level must lie in (0, 1)")
    digest = query_sha256(query)
    answers = []
    grids: dict[str, tuple[float, ...]] = {}
    for spec, sigma in zip(query.statistics, noise_sigmas, strict=True):
        sigma = float(sigma)
        if not (math.isfinite(sigma) and sigma >= 0):
            raise ValidationError(f"statistic {spec.name!r}: noise std {sigma!r}")
        block = np.asarray(total[slices[spec.name]], dtype=np.int64)
        rng = _seed(digest, spec.name, block)
        notes: list[str] = []
        scale = 1.0
        if spec.kind == "count":
            estimates = _answer_count(block, sigma, level)
        elif spec.kind == "rate":
            estimates = _answer_rate(spec, study, block, sigma, level, rng)
        elif spec.kind == "mean":
            estimates, notes = _answer_mean(spec, study, block, sigma, level, rng)
            scale = float(steps(spec, study))
        elif spec.kind == "histogram":
            estimates = _answer_histogram(spec, study, block, sigma, level)
        else:
            estimates = _answer_km(spec, block, sigma, level, rng)
            grids[spec.name] = tuple(spec.grid or ())
            notes = ["Kaplan-Meier on the grid: a unit is at risk in an interval when its "
                     "time is at or after the interval's start; events and censoring "
                     "inside an interval count at its end"]
        missing = count_estimate(float(block[-1]), sigma=sigma, cell="",
                                 quantity="excluded (missing)", cut=credible_z(1),
                                 level=level, scale=scale)
        if may_be_saturated(block, sigma):
            estimates = [replace(e, flagged=True) for e in estimates]
            missing = replace(missing, flagged=True)
            notes.append(f"a cell's sum is not credibly below one site's cap ({MAX_SITE_VALUE}"
                         " per entry): a site's count there may be capped, so its sums may "
                         "be low and its mean biased; ask again at a coarser resolution")
        flagged = sum(e.flagged for e in estimates)
        if flagged:
            notes.append(f"{flagged} of {len(estimates)} values are not credibly above the "
                         "DP noise (flagged *)")
        answers.append(StatisticAnswer(spec.name, spec.kind, spec.epsilon, sigma,
                                       tuple(estimates), missing, tuple(notes)))
    return QueryAnswer(query.name, digest, study_sha256(study), contributors, level,
                       tuple(answers), grids,
                       epsilon_composed=ledger_epsilon(query, study=study))
