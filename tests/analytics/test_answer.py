"""Answers: exact on a noiseless sum, intervals that cover the pooled cohort's exact
value under the real discrete Gaussian noise, monotone survival curves, flags, files."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.releases.analytics.answer import QueryAnswer, answer_query
from common.releases.analytics.statistics.kaplan_meier import survival_curve
from common.releases.analytics.vector import (
    block_slices,
    noise_sigmas,
    query_blocks,
    site_vector,
)
from tests.analytics.helpers import (
    every_kind_toml,
    followup_study,
    query_of,
    random_rows,
    table_of,
)
from tests.analytics.test_vector import HAND

STUDY = followup_study()
QUERY = query_of(every_kind_toml(STUDY), STUDY)


def values(answer: QueryAnswer, statistic: str, quantity: str) -> list[float]:
    return [e.value for e in answer.statistic(statistic).estimates if e.quantity == quantity]


def test_a_noiseless_sum_is_answered_exactly() -> None:
    total = site_vector(QUERY, table_of(HAND), study=STUDY)
    answer = answer_query(QUERY, total, study=STUDY, noise_sigmas=[0.0] * 5, contributors=1)
    assert values(answer, "patients", "count") == [4]
    assert values(answer, "mortality", "rate") == [1.0, 0.0]
    assert values(answer, "mortality", "patients") == [2, 2]
    assert values(answer, "age", "mean") == [pytest.approx(65.25)]  # (51+70+80+60) / 4
    assert values(answer, "age", "sum") == [pytest.approx(261)]
    assert values(answer, "wards", "count") == [2, 1]
    assert answer.statistic("wards").missing.value == 1
    # At risk at 0: A, C, E (D's time is missing); A dies in [0, 30): S = 2/3; nobody
    # dies in [30, 60) (C is censored): S stays 2/3.
    assert values(answer, "survival", "survival") == [pytest.approx(2 / 3)] * 2
    assert values(answer, "survival", "at risk") == [3, 2]
    assert values(answer, "survival", "events") == [1, 0]
    assert answer.statistic("survival").missing.value == 1
    # Without noise only the quantisation of the mean widens an interval (half a step).
    mean = answer.statistic("age").estimates[0]
    assert (mean.low, mean.high) == (pytest.approx(64.75), pytest.approx(65.75))


def pooled(seed: int, sites: int = 3, patients: int = 200) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return sum(
        site_vector(QUERY, table_of(random_rows(rng, patients, prefix=f"S{s}-")), study=STUDY)
        for s in range(sites))


def seeded_source(seed: int) -> Callable[[int], bytes]:
    """A reproducible RandomSource for the test's noise only (production: the OS CSPRNG)."""
    generator = np.random.default_rng(seed)
    return lambda n: generator.bytes(n)


def test_intervals_cover_the_exact_pooled_values_over_seeds() -> None:
    """Three sites' sum noised with the real sampler (each site's discrete Gaussian
    share, n_noise = 2 as at a floor of 3 sites with 1 colluder), 120 noise draws:
    every reported quantity's 95 % interval covers the exact value at least 88 % of the
    time (the binomial 1 % lower quantile of 120 draws at 95 % is ~0.9)."""
    exact_total = pooled(7)
    sigma0 = [0.0] * len(QUERY.statistics)
    exact = answer_query(QUERY, exact_total, study=STUDY, noise_sigmas=sigma0, contributors=3)
    blocks = query_blocks(QUERY, study=STUDY, n_noise=2)
    sigmas = noise_sigmas(blocks, contributors=3)
    truth = {(s.name, e.cell, e.quantity): e.value
             for s in exact.statistics for e in s.estimates}
    covered = dict.fromkeys(truth, 0)
    runs = 120
    for seed in range(runs):
        noise = np.concatenate([
            sum(b.plan().noise(seeded_source(1000 * seed + 10 * i + site)) for site in range(3))
            for i, b in enumerate(blocks)])
        answer = answer_query(QUERY, exact_total + noise, study=STUDY, noise_sigmas=sigmas,
                              contributors=3)
        for s in answer.statistics:
            for e in s.estimates:
                key = (s.name, e.cell, e.quantity)
                covered[key] += e.low - 1e-9 <= truth[key] <= e.high + 1e-9
    rates = {key: hits / runs for key, hits in covered.items()}
    assert min(rates.values()) >= 0.88, sorted(rates.items(), key=lambda kv: kv[1])[:5]
    assert sigmas[0] > 1  # the noise is real


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-50, 400), min_size=7, max_size=7))
def test_survival_is_monotone_and_in_unit_range_whatever_the_noise(cells: list[int]) -> None:
    curve = survival_curve(np.array(cells, dtype=np.float64))
    assert np.all((curve >= 0) & (curve <= 1))
    assert np.all(np.diff(curve) <= 0)


def test_survival_band_is_monotone_and_holds_the_curve() -> None:
    total = pooled(3)
    noise = np.rint(np.random.default_rng(5).normal(0, 30.0, total.size)).astype(np.int64)
    answer = answer_query(QUERY, total + noise, study=STUDY, noise_sigmas=[30.0] * 5,
                          contributors=3)
    rows = [e for e in answer.statistic("survival").estimates if e.quantity == "survival"]
    lows, values_, highs = (np.array([getattr(e, a) for e in rows])
                            for a in ("low", "value", "high"))
    assert np.all(lows <= values_) and np.all(values_ <= highs)
    for series in (lows, values_, highs):
        assert np.all(np.diff(series) <= 1e-12)


def test_cells_not_credibly_above_the_noise_are_flagged() -> None:
    total = site_vector(QUERY, table_of(HAND), study=STUDY)  # 4 patients
    answer = answer_query(QUERY, total, study=STUDY, noise_sigmas=[10.0] * 5, contributors=3)
    assert answer.statistic("patients").estimates[0].flagged  # 4 < 3 sigma
    assert all(e.flagged for e in answer.statistic("mortality").estimates
               if e.quantity == "rate")
    assert any("not credibly above" in note for note in answer.statistic("wards").notes)
    big = answer_query(QUERY, pooled(1), study=STUDY, noise_sigmas=[1.0] * 5, contributors=3)
    assert not big.statistic("patients").estimates[0].flagged


def test_the_same_release_gives_the_same_answer() -> None:
    total = pooled(2) + 3
    one = answer_query(QUERY, total, study=STUDY, noise_sigmas=[5.0] * 5, contributors=3)
    two = answer_query(QUERY, total, study=STUDY, noise_sigmas=[5.0] * 5, contributors=3)
    assert one == two


def test_json_csv_plots_and_text(tmp_path: Path) -> None:
    total = pooled(4)
    answer = answer_query(QUERY, total, study=STUDY, noise_sigmas=[2.0] * 5, contributors=3)
    data = json.loads(json.dumps(answer.to_json()))
    assert [s["name"] for s in data["statistics"]] == [s.name for s in QUERY.statistics]
    assert data["epsilon"] == pytest.approx(QUERY.epsilon)
    assert all({"value", "std", "low", "high", "flagged"} <= set(e)
               for s in data["statistics"] for e in s["estimates"])
    path = answer.write_csv(tmp_path / "answer.csv")
    rows = list(csv.DictReader(path.open(encoding="utf-8")))
    assert {r["statistic"] for r in rows} == {s.name for s in QUERY.statistics}
    assert sum(r["quantity"] == "excluded (missing)" for r in rows) == 5
    assert all(math.isfinite(float(r["value"])) for r in rows)
    plots = answer.write_plots(tmp_path / "plots")
    assert sorted(p.name for p in plots) == ["every-kind-survival.png", "every-kind-wards.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)
    text = answer.render()
    for statistic in QUERY.statistics:
        assert statistic.name in text
    assert "excluded for a missing value" in text and "95%" in text


def test_block_slices_cover_the_vector() -> None:
    slices = block_slices(QUERY, study=STUDY)
    assert next(s.start for s in slices.values()) == 0
    ends = [s.stop for s in slices.values()]
    starts = [s.start for s in slices.values()][1:]
    assert ends[:-1] == starts
    with pytest.raises(Exception, match="holds"):
        answer_query(QUERY, np.zeros(ends[-1] + 1, dtype=np.int64), study=STUDY,
                     noise_sigmas=[0.0] * 5, contributors=1)
