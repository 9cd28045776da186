"""The federated answer, without noise, is the central one: site vectors add up to the
vector of the pooled file, and the answer read from it equals the statistics computed
directly on the pooled rows by independent, plain-Python code."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.releases.analytics.answer import answer_query
from common.releases.analytics.vector import site_vector
from tests.analytics.helpers import (
    WARDS,
    Row,
    every_kind_toml,
    followup_study,
    query_of,
    random_rows,
    table_of,
)

STUDY = followup_study()
QUERY = query_of(every_kind_toml(STUDY), STUDY)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_site_vectors_add_up_to_the_pooled_files_vector(seed: int, sites: int) -> None:
    rng = np.random.default_rng(seed)
    files = [random_rows(rng, int(rng.integers(1, 30)), prefix=f"S{s}-") for s in range(sites)]
    pooled = [row for rows in files for row in rows]
    total = sum(site_vector(QUERY, table_of(rows), study=STUDY) for rows in files)
    assert np.array_equal(total, site_vector(QUERY, table_of(pooled), study=STUDY))


def central(rows: list[Row]) -> dict[str, object]:
    """The query's statistics computed directly: each patient's mean age and follow-up
    over its rows, most frequent ward (ties: the first declared), dead if any row is."""
    by_patient: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        by_patient[row[0]].append(row)
    patients = []
    for visits in by_patient.values():
        age = sum(v[1] for v in visits) / len(visits)
        times = [v[4] for v in visits if not math.isnan(v[4])]
        wards = Counter(v[5] for v in visits if v[5] is not None)
        ward = (max(WARDS, key=lambda w: (wards[w], -WARDS.index(w))) if wards else None)
        patients.append({"age": age, "sex": visits[0][2], "ward": ward,
                         "time": sum(times) / len(times) if times else None,
                         "dead": any(v[6] == "dead" for v in visits)})
    cohort = [p for p in patients if 40 <= p["age"] <= 100]  # type: ignore[operator]
    rates = {}
    for sex in ("F", "M"):
        group = [p for p in cohort if p["sex"] == sex]
        rates[sex] = sum(bool(p["dead"]) for p in group) / len(group) if group else math.nan
    ages = [min(max(float(p["age"]), 0.0), 100.0) for p in cohort]  # type: ignore[arg-type]
    wards_count = [sum(p["ward"] == w for p in cohort) for w in WARDS]
    timed = [p for p in cohort if p["time"] is not None]
    survival, s = [], 1.0
    for start, end in ((0, 30), (30, 60)):
        at_risk = [p for p in timed if float(p["time"]) >= start]  # type: ignore[arg-type]
        died = [p for p in at_risk if float(p["time"]) < end and p["dead"]]  # type: ignore[arg-type]
        s *= 1 - (len(died) / len(at_risk) if at_risk else 0.0)
        survival.append(s)
    return {"count": len(cohort), "rates": rates, "mean": sum(round(a) for a in ages) / len(ages),
            "wards": wards_count, "survival": survival}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_noiseless_answer_is_the_central_computation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    files = [random_rows(rng, 150, prefix=f"S{s}-", max_visits=3) for s in range(3)]
    total = sum(site_vector(QUERY, table_of(rows), study=STUDY) for rows in files)
    answer = answer_query(QUERY, total, study=STUDY, noise_sigmas=[0.0] * 5, contributors=3)
    expected = central([row for rows in files for row in rows])

    def values(name: str, quantity: str) -> list[float]:
        return [e.value for e in answer.statistic(name).estimates if e.quantity == quantity]

    assert values("patients", "count") == [expected["count"]]
    rates = expected["rates"]
    assert isinstance(rates, dict)
    assert values("mortality", "rate") == [pytest.approx(rates["F"]), pytest.approx(rates["M"])]
    assert values("age", "mean") == [pytest.approx(expected["mean"])]
    assert values("wards", "count") == expected["wards"]
    assert values("survival", "survival") == pytest.approx(expected["survival"])
