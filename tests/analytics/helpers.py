"""A follow-up study with a time column, small tables built by hand, and a query
touching every statistic kind."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Sequence

import numpy as np

from bench.analytics_cohort import SEXES as _SEXES
from bench.analytics_cohort import WARDS as _WARDS
from bench.analytics_cohort import every_kind_query_toml
from bench.analytics_cohort import followup_study as _followup_study
from common.privacy.ddgauss import epsilon_from_rho
from common.releases.analytics.query import Query, check_query_against_study, query_from_mapping
from common.releases.analytics.vector import block_plans
from common.releases.seam import NoisePlan
from common.study import Study
from site_agent.data import StudyTable

SEXES = list(_SEXES)
WARDS = list(_WARDS)


def followup_study() -> Study:
    return _followup_study(source="tests.analytics")


Row = tuple[str, float, str, float, float, str | None, str]
"""(MRN, age, sex, lactate, follow-up days, ward or None, "alive"/"dead")."""


def table_of(rows: Sequence[Row]) -> StudyTable:
    """A StudyTable as `load_study_table` returns it (NaN / -1 for a missing value)."""
    return StudyTable(
        numeric={
            "Age (years)": np.array([r[1] for r in rows], dtype=np.float64),
            "Lactate mmol/L": np.array([r[3] for r in rows], dtype=np.float64),
            "Follow-up days": np.array([r[4] for r in rows], dtype=np.float64),
        },
        categorical={
            "Sex": np.array([SEXES.index(r[2]) for r in rows], dtype=np.int64),
            "Ward": np.array([-1 if r[5] is None else WARDS.index(r[5]) for r in rows],
                             dtype=np.int64),
        },
        labels=np.array([["alive", "dead"].index(r[6]) for r in rows], dtype=np.int64),
        patient_ids=np.array([r[0] for r in rows], dtype=object),
        rows=np.arange(2, 2 + len(rows), dtype=np.int64),
        source="hand-made",
    )


NAN = math.nan


def every_kind_toml(study: Study, *, epsilon: float = 0.5) -> str:
    return every_kind_query_toml(study, epsilon=epsilon)


def query_of(text: str, study: Study) -> Query:
    query = query_from_mapping(tomllib.loads(text), source="test")
    check_query_against_study(query, study, source="test")
    return query


def random_rows(rng: np.random.Generator, n: int, *, prefix: str = "P",
                max_visits: int = 2) -> list[Row]:
    """`n` patients, 1..max_visits rows each, some missing ward / follow-up / lactate."""
    rows: list[Row] = []
    for p in range(n):
        age = float(rng.integers(18, 101))
        sex = SEXES[int(rng.integers(0, 2))]
        days = float(rng.exponential(80.0))
        dead = rng.random() < 1 - math.exp(-days / 150.0)
        for _ in range(int(rng.integers(1, max_visits + 1))):
            ward = None if rng.random() < 0.1 else WARDS[int(rng.integers(0, 2))]
            time = NAN if rng.random() < 0.05 else days
            lactate = NAN if rng.random() < 0.1 else float(rng.gamma(2.0, 1.0))
            rows.append((f"{prefix}{p}", age, sex, lactate, time, ward,
                         "dead" if dead else "alive"))
    return rows


def block_noise(plans: Sequence[NoisePlan], rng: Callable[[int], bytes]) -> np.ndarray:
    """A site's noise for a whole query vector (int64), as `site_agent.releases.
    release_vector` adds it: each block's share (`NoisePlan.noise`) from `rng`,
    concatenated in block order."""
    if not plans:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([plan.noise(rng) for plan in plans]).astype(np.int64)


def query_epsilon(query: Query, *, study: Study, n_noise: int) -> float:
    """The query's epsilon at the study's delta with its blocks composed in zCDP (rho
    adds up: Bun & Steinke, TCC 2016, Lemma 2.3; each block's rho from KLS21 Prop. 14,
    `DistributedDiscreteGaussian.zcdp_rho`; converted by CKS20 Cor. 13): the oracle the
    ledger's RDP composition on its grid of orders is checked against."""
    rho = math.fsum(plan.mechanism().zcdp_rho
                    for plan in block_plans(query, study=study, n_noise=n_noise))
    return epsilon_from_rho(rho, study.privacy.delta)
