"""The study's statistics as a DP release (`common.releases.seam`), run once per study
in its own round before training: the vector of `common.releases.statistics`, planned for
the study's `privacy.statistics_epsilon`, decoded into the `GlobalStatistics` every site
then preprocesses with."""

from __future__ import annotations

from typing import Any

import numpy as np

from common.core.errors import ValidationError
from common.privacy.purpose import Purpose
from common.releases.egress import SEGMENT_KINDS, STATISTICS
from common.releases.seam import KIND_STATISTICS, DpRelease, ReleaseKind, register_release
from common.releases.statistics import (
    StatisticsPlan,
    decode_release,
    plan_statistics,
    statistics_length,
)
from common.study import GlobalStatistics, Study


class StatisticsQuery(DpRelease):
    """The study's statistics release: one vector per site (module docstring)."""

    name = STATISTICS
    purpose = Purpose.STATISTICS

    def __init__(self, study: Study) -> None:
        self.study = study

    @property
    def length(self) -> int:
        return statistics_length(self.study)

    def query(self, site: Any) -> np.ndarray:
        """`site.statistics_release()`: the site's training plan encodes its table (or
        counts an images study's units) with `encode_release`."""
        vector = np.asarray(site.statistics_release())
        if vector.shape != (self.length,):
            raise ValidationError("statistics vector length differs from this site's study")
        return vector

    def plan(self, *, n_noise: int) -> StatisticsPlan:
        return plan_statistics(self.study, n_noise=n_noise)

    def decode(self, total: np.ndarray, *, noise_sigma: float, round_number: int,
               contributors: int) -> GlobalStatistics:
        privacy = self.study.privacy
        source = (
            f"federated DP release, round {round_number}: {contributors} "
            f"sites, epsilon {privacy.statistics_epsilon:g}, delta {privacy.delta:g} "
            "(distributed discrete Gaussian)"
        )
        return decode_release(total, self.study, source=source, noise_sigma=noise_sigma)


register_release(ReleaseKind(
    name=STATISTICS, purpose=Purpose.STATISTICS, build=StatisticsQuery,
    mechanism=SEGMENT_KINDS[STATISTICS].mechanism,
    description=SEGMENT_KINDS[STATISTICS].description,
    round_kind=KIND_STATISTICS, once_per_study=True,
))
