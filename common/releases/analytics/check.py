"""``medfed query check``: a query run offline on a site's own file, releasing nothing.

What a hospital reviews before approving a query: how many of its patients the cohort
filter keeps, what each statistic would release (its cells and their number), the noise
each carries and the epsilon the query will cost on its ledger. The local counts it
prints stay on the operator's screen; nothing is noised, masked or sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from common.releases.analytics.cost import query_cost
from common.releases.analytics.query import Query, query_sha256
from common.releases.analytics.statistic import kind_of
from common.releases.analytics.units import table_units
from common.releases.analytics.vector import (
    QueryBlock,
    block_slices,
    cohort_masks,
    query_blocks,
    site_vector,
)
from common.releases.seam import study_noise_sites
from common.releases.statistics import TableLike
from common.study import SitePrivacyPolicy, Study, study_sha256


def study_n_noise(study: Study) -> int:
    """Honest sites whose noise a query round's sum is sure to carry at the study's
    round floor: max(min_round_sites, T + 2) - T (T colluding sites know their own
    noise), as every release plans it (`common.releases.seam.study_noise_sites`)."""
    return study_noise_sites(study)


@dataclass(frozen=True)
class CheckReport:
    """What `check_query` found (module docstring)."""

    query_name: str
    query_sha256: str
    study_sha256: str
    source: str
    units: int
    cohort: int
    excluded_missing: int
    blocks: tuple[QueryBlock, ...]
    local_missing: tuple[int, ...]
    """Per statistic: this site's units excluded for a missing value."""
    epsilon_sum: float
    epsilon_composed: float
    """What the site's ledger charges for one run on its own (`common.releases.analytics.cost`)."""
    delta: float
    problems: tuple[str, ...] = ()
    cap_text: str = ""
    """The per-round cap the query is held to, and whether it is within it."""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def length(self) -> int:
        return sum(block.length for block in self.blocks)

    def to_json(self) -> dict[str, Any]:
        return {
            "query": self.query_name, "query_sha256": self.query_sha256,
            "study_sha256": self.study_sha256, "source": self.source, "units": self.units,
            "cohort": self.cohort, "excluded_missing": self.excluded_missing,
            "length": self.length,
            "statistics": [
                {"name": b.statistic, "kind": b.kind, "cells": b.length, "epsilon": b.epsilon,
                 "noise_std": b.sigma, "l2_sensitivity": b.l2_sensitivity,
                 "local_missing": missing}
                for b, missing in zip(self.blocks, self.local_missing, strict=True)
            ],
            "epsilon": self.epsilon_sum, "epsilon_composed": self.epsilon_composed,
            "delta": self.delta, "n_noise": self.blocks[0].n_noise if self.blocks else 0,
            "per_round_cap": self.cap_text,
            "problems": list(self.problems), "released": False,
        }

    def render(self) -> str:
        lines = [
            f"query {self.query_name}: sha256 {self.query_sha256}",
            f"  study sha256 {self.study_sha256}",
            f"  this site ({self.source}): {self.units} patients, {self.cohort} in the cohort, "
            f"{self.excluded_missing} excluded for a missing filter value",
            f"  would release {len(self.blocks)} statistics, {self.length} noisy values in all "
            "(masked under SecAgg+; nothing is released by this check):",
        ]
        for block, missing in zip(self.blocks, self.local_missing, strict=True):
            lines.append(
                f"    {block.statistic} ({block.kind}): {block.length} cells, epsilon "
                f"{block.epsilon:g}, noise std {block.sigma:.3g} per cell "
                f"(sensitivity {block.l2_sensitivity:g}); here {missing} excluded for a "
                "missing value")
        lines.append(
            f"  epsilon: {self.epsilon_composed:.4g} charged to this site's ledger if it "
            f"answers (its statistics composed as the ledger composes them; "
            f"{self.epsilon_sum:g} summed) at delta {self.delta:g}")
        if self.cap_text:
            lines.append(f"  per-round cap: {self.cap_text}")
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


def check_query(query: Query, table: TableLike, *, study: Study,
                policy_or_none: SitePrivacyPolicy | None,
                accountant: str = "prv") -> CheckReport:
    """Run `query` on this site's `table` (all of its file under `study`) without noise
    or release: the report of the module docstring. Its cost as the ledger (of
    `accountant`) charges it is held to the study's per-round cap and, with the site's
    policy, to the site's cap, budget and delta (`problems`, `common.releases.analytics.cost`);
    the budget left on the ledger is checked when the query runs."""
    n_noise = study_n_noise(study)
    blocks = query_blocks(query, study=study, n_noise=n_noise)
    vector = site_vector(query, table, study=study)
    units = table_units(table, study)
    inside, missing = cohort_masks(query, units, study=study)
    slices = block_slices(query, study=study)
    local_missing = []
    for spec in query.statistics:
        block = vector[slices[spec.name]]
        scale = block_scale(query, study, spec.name)
        local_missing.append(int(block[-1]) // scale)
    cost = query_cost(query, study=study, policy=policy_or_none, accountant=accountant)
    return CheckReport(
        query_name=query.name, query_sha256=query_sha256(query),
        study_sha256=study_sha256(study), source=str(getattr(table, "source", "")),
        units=units.count, cohort=int(np.sum(inside)), excluded_missing=int(np.sum(missing)),
        blocks=tuple(blocks), local_missing=tuple(local_missing),
        epsilon_sum=query.epsilon, epsilon_composed=cost.epsilon_composed, delta=cost.delta,
        problems=cost.problems, cap_text=cost.cap_text(),
    )


def block_scale(query: Query, study: Study, name: str) -> int:
    """Integer units per unit counted in a statistic's "missing" cell (its kind's
    `missing_scale`: K for a mean)."""
    spec = query.statistic(name)
    return kind_of(spec).missing_scale(spec, study)


__all__ = ["CheckReport", "check_query", "study_n_noise"]
