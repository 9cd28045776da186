"""The synthetic cohort: deterministic, non-IID across sites, a learnable known truth."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from common.releases.evaluation import metrics_from_scores
from site_agent.data import load_site_data
from site_agent.synthetic import (
    FEATURES,
    SCHEMA,
    generate_cohort,
    site_names,
    true_logit,
    write_site_csvs,
)


def test_same_seed_same_cohort_other_seed_different() -> None:
    a = generate_cohort(3, seed=7, patients_per_site=80)
    b = generate_cohort(3, seed=7, patients_per_site=80)
    c = generate_cohort(3, seed=8, patients_per_site=80)
    assert list(a) == ["paediatric", "geriatric", "rural"]
    for site in a:
        np.testing.assert_array_equal(a[site].features, b[site].features)
        np.testing.assert_array_equal(a[site].labels, b[site].labels)
        assert list(a[site].patient_ids) == list(b[site].patient_ids)
        assert not np.array_equal(a[site].features, c[site].features)


def test_a_site_does_not_depend_on_the_other_sites() -> None:
    alone = generate_cohort(["rural"], seed=3, patients_per_site=50)["rural"]
    together = generate_cohort(["geriatric", "rural"], seed=3, patients_per_site=50)["rural"]
    np.testing.assert_array_equal(alone.features, together.features)


def test_sites_are_non_iid() -> None:
    cohort = generate_cohort(5, seed=1)
    age = {site: float(d.features[:, 0].mean()) for site, d in cohort.items()}
    prevalence = {site: float(d.labels.mean()) for site, d in cohort.items()}
    sizes = {site: len(d) for site, d in cohort.items()}
    assert age["paediatric"] < 18 < 65 < age["geriatric"]
    assert prevalence["geriatric"] > 2 * prevalence["paediatric"]
    assert max(prevalence.values()) - min(prevalence.values()) > 0.1
    assert max(sizes.values()) > 2 * min(sizes.values())
    assert all(500 <= n <= 4000 for n in sizes.values())  # "a few thousand encounters"


def test_several_encounters_per_patient_and_learnable_truth() -> None:
    data = generate_cohort(["urban_academic"], seed=2)["urban_academic"]
    assert data.patient_ids is not None
    assert len(data) / data.num_patients > 2.0
    oracle = metrics_from_scores(1 / (1 + np.exp(-true_logit(data.features))), data.labels)
    assert 0.85 < oracle.auc < 0.99  # signal is strong but not trivial


def test_csv_round_trip_through_the_loader(tmp_path: Path) -> None:
    cohort = generate_cohort(2, seed=4, patients_per_site=60)
    paths = write_site_csvs(tmp_path, cohort)
    assert sorted(p.name for p in paths.values()) == ["geriatric.csv", "paediatric.csv"]
    header = paths["paediatric"].read_text(encoding="utf-8").splitlines()[0].split(",")
    assert header == ["patient_id", *FEATURES, "sepsis"]
    loaded = load_site_data(paths["paediatric"], SCHEMA, delta=1e-5)
    np.testing.assert_allclose(loaded.features, cohort["paediatric"].features, rtol=1e-5)
    np.testing.assert_array_equal(loaded.labels, cohort["paediatric"].labels)


def test_site_names_cycle_profiles() -> None:
    assert site_names(7)[5:] == ["paediatric-2", "geriatric-2"]
