"""The evaluation histogram as a DP release (`common.releases.seam`): the held-out score
histogram every model round carries beside its update, 2 x bins integer counts per
block (negatives, positives), one score per privacy unit.

Noise: the distributed discrete Gaussian (Kairouz, Liu & Steinke, ICML 2021) split
across the round-size floor minus the colluding sites (`evaluation_noise_sites`), so the
secure sum carries the study's `privacy.evaluation.noise_std` per count
(`evaluation_noise_std`). Sensitivity:
each unit adds one count, so L1 = L2 = 1; with K one-vs-rest blocks (a multi-class
study, `bins` covering all of them) one count in each block: L1 = K, L2 = sqrt(K).
The coordinator reads the sum with `common.releases.evaluation` (`denoised_histogram`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from common.core.config import SitePolicySection
from common.privacy.purpose import Purpose
from common.releases.egress import EVALUATION_HISTOGRAM, SEGMENT_KINDS
from common.releases.seam import DpRelease, NoisePlan, ReleaseKind, register_release
from common.study import DEFAULT_EVALUATION_NOISE_STD, Study, study_round_terms


def evaluation_noise_std(study: Study | None, *, own: float | None = None) -> float:
    """The noise std per summed count of a round's score histogram: the study's
    ``privacy.evaluation.noise_std``, one value for every member (the study's digest is
    in every announcement), so a peer configured for less noise cannot make the sum
    carry less than this site's ledger records. Without a study (no production
    federation runs without one) this site's own ``privacy.evaluation_noise_std``
    (`own`), else the default."""
    if study is not None:
        return study.privacy.evaluation.noise_std
    return DEFAULT_EVALUATION_NOISE_STD if own is None else own


def evaluation_noise_sites(
    policy: SitePolicySection, *, threshold: int, secure: bool, study: Study | None = None
) -> int:
    """n_noise: how many honest sites' noise the sum is sure to carry.

    The round-size floor max(min_round_sites, T + 2), lowered to the SecAgg+ threshold
    (the sum holds at least t inputs), minus the T colluders (who know their own
    noise); T and min_round_sites are the study's when there is one (every member then
    adds the same share), else this site's policy. A plain round shows the coordinator
    each vector: then 1 (our noise alone)."""
    if not secure:
        return 1
    colluding, min_sites = study_round_terms(
        study, max_colluding_sites=policy.max_colluding_sites,
        min_round_sites=policy.min_round_sites,
    )
    floor = max(min_sites, colluding + 2)
    return max(1, min(floor, threshold) - colluding)


class EvaluationHistogram(DpRelease):
    """One round's held-out score histogram: `bins` counts per label and `classes`
    one-vs-rest blocks sharing them, noised to `noise_std` per summed count."""

    name = EVALUATION_HISTOGRAM
    purpose = Purpose.EVALUATION

    def __init__(self, *, noise_std: float, bins: int, classes: int = 1) -> None:
        self.noise_std = noise_std
        self.bins = bins
        self.classes = classes

    @property
    def length(self) -> int:
        return 2 * self.bins

    def query(self, site: Any) -> np.ndarray:
        """The exact histogram the site's training plan scored on its held-out split
        (`site.histogram`, `site_agent.held_out.held_out_histogram`)."""
        return np.asarray(site.histogram, dtype=np.int64)

    def plan(self, *, n_noise: int) -> NoisePlan:
        return NoisePlan(
            sigma=self.noise_std, n_noise=n_noise, length=self.length,
            l2_sensitivity=math.sqrt(self.classes), l1_sensitivity=float(self.classes),
        )


register_release(ReleaseKind(
    name=EVALUATION_HISTOGRAM, purpose=Purpose.EVALUATION,
    mechanism=SEGMENT_KINDS[EVALUATION_HISTOGRAM].mechanism,
    description=SEGMENT_KINDS[EVALUATION_HISTOGRAM].description,
))
