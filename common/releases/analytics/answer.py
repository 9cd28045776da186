"""Answers from a query's noisy secure sum, each with its noise and a confidence interval.

Everything here is post-processing of the released sum and the public noise stds: no
privacy cost (Dwork & Roth 2014, Prop. 2.1), nothing new leaves a site. The intervals
are for the exact value of the pooled cohort of the participating sites (what a central
analyst holding every file would compute with the same clipping, quantisation and time
grid): they account for the DP noise, not for sampling the cohort from a population.

* Each statistic reads its cells as its kind says (`StatisticKind.answer`, one module per
  kind in ``common/releases/analytics/statistics/``): counts as the noisy count, its std
  sigma and noisy +- z sigma, clipped at 0; ratios (rates, means) and the Kaplan-Meier
  curve through a parametric bootstrap (`common.releases.analytics.estimates`). The
  draws are seeded from the query digest and the released sum, so anyone holding the
  release recomputes the same interval.
* Excluded for a missing value: every statistic's last cell, read as a noisy count (in
  units of its kind's `missing_scale`).
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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from common.core.errors import ValidationError
from common.releases.analytics.cost import ledger_epsilon
from common.releases.analytics.estimates import LEVEL, Estimate, count_estimate, json_number
from common.releases.analytics.query import Query, query_sha256
from common.releases.analytics.statistic import kind_of, statistic_kind
from common.releases.analytics.vector import MAX_SITE_VALUE, block_slices
from common.releases.noisy_counts import credible_z
from common.study import Study, study_sha256

FORMULA_STARTS = ("=", "+", "-", "@")


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
            "epsilon_composed": json_number(self.epsilon_composed),
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
        """A PNG per statistic whose kind draws one (`StatisticKind.plots`: a histogram's
        bars with their intervals, a Kaplan-Meier curve's steps with the pointwise band),
        named QUERY-STATISTIC.png (matplotlib)."""
        # matplotlib: loaded only when an operator asks for plots.
        import matplotlib

        matplotlib.use("Agg")
        # matplotlib: its plotting interface, once the Agg backend is chosen.
        import matplotlib.pyplot as plt

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for answer in self.statistics:
            kind = statistic_kind(answer.kind)
            if not kind.plots:
                continue
            figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
            try:
                kind.plot(answer.estimates, axes, grid=self.grids.get(answer.name, ()),
                          level=self.level)
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


def _seed(digest: str, name: str, values: np.ndarray) -> np.random.Generator:
    data = digest.encode() + b"\0" + name.encode() + b"\0" + np.ascontiguousarray(
        values, dtype="<i8").tobytes()
    return np.random.default_rng(int.from_bytes(hashlib.sha256(data).digest()[:8], "big"))


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
        kind = kind_of(spec)
        reading = kind.answer(spec, study, block[:-1], sigma=sigma, level=level, rng=rng)
        estimates, notes = list(reading.estimates), list(reading.notes)
        if reading.grid:
            grids[spec.name] = reading.grid
        scale = float(kind.missing_scale(spec, study))
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
