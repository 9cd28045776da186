"""The federated DP statistics release: bounded per-unit
contributions, noise planned for the round-size floor, decoding into GlobalStatistics."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from common.crypto.random import system_random
from common.privacy.ddgauss import count_rho, epsilon_from_rho
from common.releases.statistics import (
    decode_release,
    encode_release,
    l1_sensitivity,
    l2_squared_sensitivity,
    plan_statistics,
    statistics_layout,
    statistics_length,
)
from common.study import check_statistics, study_from_mapping
from site_agent.data import Preprocessor, load_study_table
from tests.study.helpers import (
    COLUMNS,
    clipped_sums,
    hospital_study,
    ring_to_signed,
    study_mapping,
    write_hospital_csv,
)


def _uniform(seed: int):  # type: ignore[no-untyped-def]
    gen = np.random.default_rng(seed)
    return lambda n: gen.random(n)


def _with_outlier(src: Path, dst: Path, *, age: str) -> Path:
    rows = list(csv.reader(src.open(encoding="utf-8")))
    rows.append(["OUTLIER-1", age, "F", "1e9", "elective", "yes"])
    with dst.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    return dst


def test_one_outlier_moves_the_noiseless_clipped_sum_by_at_most_c(tmp_path: Path) -> None:
    study = hospital_study()
    base = write_hospital_csv(tmp_path / "a.csv", 80, seed=3)
    before = clipped_sums(load_study_table(base, study), study)
    low, high = study.feature("Age (years)").range  # type: ignore[misc]
    bound = max(abs(low), abs(high))  # C: the clip bound of one unit's value
    for age in ("1e12", "-1e12", "55"):
        outlier = _with_outlier(base, tmp_path / f"b{age}.csv", age=age)
        after = clipped_sums(load_study_table(outlier, study), study)
        assert abs(after["Age (years)"] - before["Age (years)"]) <= bound


def test_one_unit_moves_each_entry_by_at_most_one(tmp_path: Path) -> None:
    study = hospital_study()
    base = write_hospital_csv(tmp_path / "a.csv", 60, seed=4)
    outlier = _with_outlier(base, tmp_path / "b.csv", age="1e12")
    a = encode_release(load_study_table(base, study), study, uniform=_uniform(1))
    b = encode_release(load_study_table(outlier, study), study, uniform=_uniform(1))
    diff = np.abs(b - a)
    assert a.shape == (statistics_length(study),)
    # Same rounding draws for the common units, so only the new unit differs ... up to the
    # extra draws it shifts; the per-entry bound holds regardless for the count segments.
    assert diff[0] == 1
    single = _with_outlier(base, tmp_path / "c.csv", age="40")
    one = encode_release(load_study_table(single, study), study, uniform=lambda n: np.zeros(n))
    zero = encode_release(load_study_table(base, study), study, uniform=lambda n: np.zeros(n))
    change = one - zero
    assert np.abs(change).max() <= 1
    assert np.abs(change).sum() <= l1_sensitivity(study)
    assert float((change**2).sum()) <= l2_squared_sensitivity(study)


def test_plan_meets_the_study_epsilon() -> None:
    study = hospital_study()
    plan = plan_statistics(study, n_noise=2)
    rho = count_rho(sigma=plan.sigma, n_noise=2, l2_sensitivity=plan.l2_sensitivity,
                    length=plan.length, l1_sensitivity=plan.l1_sensitivity)
    assert epsilon_from_rho(rho, study.privacy.delta) <= study.privacy.statistics_epsilon
    looser = plan_statistics(study, n_noise=2, epsilon=study.privacy.statistics_epsilon * 4)
    assert looser.sigma < plan.sigma
    assert plan.mechanism().contributors == 2


def test_noisy_sum_decodes_to_usable_statistics(tmp_path: Path) -> None:
    mapping = study_mapping()
    mapping["features"][2]["range"] = "auto"  # lactate: range from the DP histogram
    study = study_from_mapping(mapping, source="test")
    plan = plan_statistics(study, n_noise=2)
    total = np.zeros(plan.length, dtype=np.uint32)
    for seed in (1, 2, 3):
        table = load_study_table(write_hospital_csv(tmp_path / f"{seed}.csv", 150, seed=seed),
                                 study)
        release = encode_release(table, study, uniform=_uniform(seed))
        release = release + plan.noise(system_random)
        total += (release % (1 << 32)).astype(np.uint32)
    stats = decode_release(ring_to_signed(total), study, source="test")
    check_statistics(study, stats)
    age = stats.numeric["Age (years)"]
    assert 40 < age.mean < 75 and 10 < age.scale < 40
    lactate = stats.numeric["Lactate mmol/L"]
    assert 0.5 < lactate.impute < 4 and lactate.clip_low < lactate.clip_high
    assert stats.categorical["Admission type"].impute in ("elective", "emergency", "transfer")
    table = load_study_table(tmp_path / "1.csv", study)
    matrix = Preprocessor(study, stats).transform(table)
    assert np.isfinite(matrix).all()
    assert COLUMNS  # the hospital-style file, not the synthetic cohort's names


def test_noise_swamping_the_variance_never_collapses_the_scale() -> None:
    """With few units the noise on the sum of squares can exceed the variance: the
    released second moment then sits below the squared mean. The scale must not fall to
    the 1e-3-of-range floor (standardised ages would reach +-1000); it is held at a
    quarter of the widest spread the released mean allows (Bhatia-Davis)."""
    study = study_from_mapping(study_mapping(), source="test")
    where = {segment.name: segment for segment in statistics_layout(study)}
    total = np.zeros(statistics_length(study), dtype=np.int64)
    total[0] = 100  # units
    total[where["Age (years).sum"].start] = 50  # mean_u = 0.5
    total[where["Age (years).sumsq"].start] = 20  # m2 = 0.2 < mean_u^2: noise won
    age = decode_release(total, study, source="test").numeric["Age (years)"]
    assert age.scale == pytest.approx(0.25 * 0.5 * (100 - 18))
    # An honest, well-measured spread is kept as released.
    total[where["Age (years).sumsq"].start] = 40  # m2 = 0.4: std_u = sqrt(0.15)
    age = decode_release(total, study, source="test").numeric["Age (years)"]
    assert age.scale == pytest.approx((0.15 ** 0.5) * (100 - 18))
