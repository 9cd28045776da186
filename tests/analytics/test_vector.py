"""The query vector: pinned by hand on five patients, and each block's per-patient
contribution bound (Hypothesis: adding or removing one patient, whatever its rows)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.core.errors import ValidationError
from common.releases.analytics.statistic import statistic_cells
from common.releases.analytics.vector import (
    block_plans,
    block_slices,
    query_blocks,
    query_length,
    query_mechanisms,
    site_vector,
)
from tests.analytics.helpers import (
    NAN,
    SEXES,
    WARDS,
    Row,
    block_noise,
    every_kind_toml,
    followup_study,
    query_of,
    table_of,
)

STUDY = followup_study()
QUERY = query_of(every_kind_toml(STUDY), STUDY)
STRATIFIED = query_of(f"""
name = "stratified"
study_sha256 = "{QUERY.study_sha256}"

[[cohort]]
feature = "Ward"
levels = ["icu"]

[[statistics]]
name = "mortality"
kind = "rate"
epsilon = 0.5
[[statistics.by]]
feature = "Sex"
[[statistics.by]]
feature = "Age (years)"
bins = [30, 50, 70]

[[statistics]]
name = "lactate"
kind = "mean"
feature = "Lactate mmol/L"
range = [0.5, 2.5]
resolution = 0.5
epsilon = 0.5
[[statistics.by]]
feature = "Sex"

[[statistics]]
name = "ages"
kind = "histogram"
feature = "Age (years)"
bins = [20, 40, 60, 80]
epsilon = 0.5

[[statistics]]
name = "late"
kind = "kaplan_meier"
feature = "Follow-up days"
grid = [20, 40, 80, 200]
epsilon = 0.5
""", STUDY)

# A: two rows (ages 50 and 52 -> 51; alive then dead -> dead), B: filtered out (age 30),
# C: ward missing, D: follow-up missing, E: beyond the time grid.
HAND: list[Row] = [
    ("A", 50, "F", 2.0, 10, "icu", "alive"),
    ("A", 52, "F", NAN, 10, "icu", "dead"),
    ("B", 30, "M", 1.0, 45, "general", "dead"),
    ("C", 70, "M", 1.5, 45, None, "alive"),
    ("D", 80, "F", 3.0, NAN, "icu", "dead"),
    ("E", 60, "M", 2.5, 90, "general", "alive"),
]


def blocks_of(vector: np.ndarray) -> dict[str, list[int]]:
    return {name: vector[s].tolist() for name, s in block_slices(QUERY, study=STUDY).items()}


def test_every_block_pinned_by_hand() -> None:
    vector = site_vector(QUERY, table_of(HAND), study=STUDY)
    assert vector.dtype == np.int64
    assert vector.size == query_length(QUERY, study=STUDY)
    assert blocks_of(vector) == {
        # cohort = A, C, D, E (age >= 40); no filter value missing
        "patients": [4, 0],
        # F: A dead, D dead; M: C alive, E alive
        "mortality": [2, 0, 0, 2, 0],
        # ages 51 + 70 + 80 + 60 = 261 in steps of 1 from 0; complement 4 * 100 - 261
        "age": [261, 139, 0],
        # icu: A, D; general: E; missing: C
        "wards": [2, 1, 1],
        # [0, 30): A dies at 10; [30, 60): C censored at 45; beyond 60: E; missing: D
        "survival": [1, 0, 0, 1, 1, 1],
    }
    assert statistic_cells(QUERY.statistic("survival"), STUDY) == (
        "[0, 30): events", "[0, 30): censored", "[30, 60): events", "[30, 60): censored",
        ">= 60", "missing")


def test_filter_value_missing_is_counted_as_missing_in_every_block() -> None:
    text = every_kind_toml(STUDY).replace(
        'range = [40, 100]\n', 'range = [40, 100]\n\n[[cohort]]\nfeature = "Ward"\n'
        'levels = ["icu", "general"]\n', 1)
    query = query_of(text, STUDY)
    vector = site_vector(query, table_of(HAND), study=STUDY)
    blocks = {name: vector[s].tolist() for name, s in block_slices(query, study=STUDY).items()}
    # C (ward missing) is now neither in the cohort nor anywhere but "missing".
    assert blocks["patients"] == [3, 1]
    assert blocks["mortality"] == [2, 0, 0, 1, 1]
    assert blocks["age"] == [191, 109, 100]  # the missing cell counts K = 100 per unit
    assert blocks["wards"] == [2, 1, 1]
    assert blocks["survival"] == [1, 0, 0, 0, 1, 2]


def test_a_query_for_another_study_is_refused() -> None:
    other = followup_study().model_copy(update={"features": STUDY.features[:4]})
    with pytest.raises(ValidationError, match="study_sha256"):
        site_vector(QUERY, table_of(HAND), study=other)


def test_block_sensitivities_and_plans() -> None:
    blocks = query_blocks(QUERY, study=STUDY, n_noise=2)
    assert [(b.statistic, b.l1_sensitivity, b.l2_sensitivity) for b in blocks] == [
        ("patients", 1, 1), ("mortality", 1, 1), ("age", 100, 100), ("wards", 1, 1),
        ("survival", 1, 1)]
    plans = block_plans(QUERY, study=STUDY, n_noise=2)
    assert [p.length for p in plans] == [b.length for b in blocks]
    # Same epsilon, 100x the sensitivity: ~100x the noise (the tau terms are negligible).
    assert plans[2].sigma / plans[0].sigma == pytest.approx(100, rel=0.05)
    assert query_mechanisms(QUERY, study=STUDY, n_noise=2) == [p.mechanism() for p in plans]
    generator = np.random.default_rng(0)
    noise = block_noise(plans, lambda n: generator.bytes(n))  # the test's seeded source
    assert noise.dtype == np.int64 and noise.size == query_length(QUERY, study=STUDY)
    assert noise[block_slices(QUERY, study=STUDY)["age"]].std() > 10 * noise[:2].std()


@st.composite
def cohorts(draw: st.DrawFn) -> tuple[list[Row], list[Row]]:
    """A cohort and one more patient (1 to 3 rows of any values, missing included)."""
    def patient(name: str) -> st.SearchStrategy[list[Row]]:
        row = st.tuples(
            st.just(name), st.sampled_from([18.0, 39.0, 40.0, 55.5, 100.0]),
            st.sampled_from(SEXES), st.sampled_from([NAN, 1.0]),
            st.sampled_from([NAN, 0.0, 29.9, 30.0, 59.0, 60.0, 400.0]),
            st.sampled_from([None, *WARDS]), st.sampled_from(["alive", "dead"]))
        return st.lists(row, min_size=1, max_size=3)

    others = draw(st.lists(st.integers(0, 10**6), min_size=0, max_size=6, unique=True))
    rows = [r for i in others for r in draw(patient(f"P{i}"))]
    extra = draw(patient("NEW"))
    return rows, extra


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cohorts())
def test_one_patient_moves_each_block_within_its_sensitivity(
    case: tuple[list[Row], list[Row]],
) -> None:
    rows, extra = case
    for query in (QUERY, STRATIFIED):
        with_patient = site_vector(query, table_of(rows + extra), study=STUDY)
        if rows:
            without = site_vector(query, table_of(rows), study=STUDY)
        else:
            without = np.zeros_like(with_patient)
        slices = block_slices(query, study=STUDY)
        for block in query_blocks(query, study=STUDY, n_noise=1):
            diff = (with_patient - without)[slices[block.statistic]].astype(np.float64)
            assert np.abs(diff).sum() <= block.l1_sensitivity + 1e-9
            assert np.sqrt((diff**2).sum()) <= block.l2_sensitivity + 1e-9
            # Adding a patient never lowers a cell (no cross-patient effects).
            assert np.all(diff >= 0)


def test_strata_cross_product_and_clipping_pinned() -> None:
    vector = site_vector(STRATIFIED, table_of(HAND), study=STUDY)
    blocks = {n: vector[s].tolist() for n, s in block_slices(STRATIFIED, study=STUDY).items()}
    # cohort: ward icu = A, D (C's ward is missing: excluded as missing everywhere)
    # strata F&[30,50), F&[50,70], M&..: A (F, 51) -> F&[50,70] dead; D (F, 80 -> last bin)
    assert blocks["mortality"] == [0, 0, 2, 0, 0, 0, 0, 0, 1]
    # lactate: A mean(2.0) = 2.0 -> q = 3 of K = 4; D 3.0 clipped to 2.5 -> q = 4
    assert blocks["lactate"] == [7, 1, 0, 0, 4]
    assert blocks["ages"] == [0, 1, 1, 1]  # A 51 -> [40, 60); D 80 -> last bin; C missing
    # A at 10 (< 20): first interval, event; D: time missing; C: filter missing
    assert blocks["late"] == [1, 0, 0, 0, 0, 0, 0, 2]


def test_direct_at_risk_counts_would_move_by_the_number_of_intervals() -> None:
    """Why the survival block releases exits, not at-risk counts: one patient followed
    past the grid is at risk in every interval (k of them), so a block of at-risk
    counts would have L2 sensitivity sqrt(k); its exit cell moves by 1."""
    one: list[Row] = [("Z", 50, "F", 1.0, 500, "icu", "alive")]
    vector = blocks_of(site_vector(QUERY, table_of(one), study=STUDY))
    assert vector["survival"] == [0, 0, 0, 0, 1, 0]


def test_the_analytics_package_imports_neither_torch_nor_grpc() -> None:
    code = ("import sys, common.releases.analytics.query, common.releases.analytics.vector, "
            "common.releases.analytics.answer, common.releases.analytics.check, "
            "common.commands.query; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip() == "[]"
