"""The preprocessor: one-hot in declared order, missing indicators, imputation, clipping
and standardising with the GLOBAL statistics it is given (never fitted locally)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from common.core.errors import ValidationError
from common.study import (
    CategoricalStatistics,
    GlobalStatistics,
    NumericStatistics,
    study_from_mapping,
    study_sha256,
)
from site_agent.data import Preprocessor, load_site_data_for_study, load_study_table
from tests.study.helpers import COLUMNS, hospital_study, study_mapping, write_hospital_csv


def statistics() -> GlobalStatistics:
    study = hospital_study()
    return GlobalStatistics(
        study_sha256=study_sha256(study),
        source="test: fixed values",
        numeric={
            "Age (years)": NumericStatistics(
                mean=60.0, scale=10.0, impute=60.0, clip_low=18.0, clip_high=100.0
            ),
            "Lactate mmol/L": NumericStatistics(
                mean=2.0, scale=0.5, impute=1.5, clip_low=0.0, clip_high=8.0
            ),
        },
        categorical={
            "Sex": CategoricalStatistics(),
            "Admission type": CategoricalStatistics(impute="emergency"),
        },
    )


def test_encoding(tmp_path: Path) -> None:
    path = tmp_path / "few.csv"
    rows = [
        ["p1", "70", "M", "3.0", "transfer", "yes"],
        ["p2", "120", "F", "", "NA", "no"],  # age clipped to 100; lactate, admission missing
        ["p3", "50", "F", "20", "elective", "no"],  # lactate clipped to 8
    ]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    study = hospital_study()
    pre = Preprocessor(study, statistics())
    assert pre.feature_names() == [
        "Age (years)",
        "Sex=F",
        "Sex=M",
        "Lactate mmol/L",
        "Lactate mmol/L__missing",
        "Admission type=elective",
        "Admission type=emergency",
        "Admission type=transfer",
    ]
    table = load_study_table(path, study)
    matrix = pre.transform(table)
    assert matrix.dtype == np.float32 and matrix.shape == (3, 8)
    expected = np.array(
        [
            [1.0, 0, 1, 2.0, 0, 0, 0, 1],
            [4.0, 1, 0, -1.0, 1, 0, 1, 0],  # imputed lactate 1.5, admission "emergency"
            [-1.0, 1, 0, 12.0, 0, 1, 0, 0],
        ],
        dtype=np.float32,
    )
    np.testing.assert_allclose(matrix, expected, rtol=1e-6)
    assert pre.imputations(table) == {"Lactate mmol/L": 1, "Admission type": 1}


def test_categorical_indicator_leaves_one_hot_empty(tmp_path: Path) -> None:
    mapping = study_mapping()
    mapping["features"][3]["missing"] = "indicator"
    study = study_from_mapping(mapping)
    stats = statistics().model_copy(update={"study_sha256": study_sha256(study)})
    path = write_hospital_csv(tmp_path / "h.csv", n_patients=60)
    table = load_study_table(path, study)
    matrix = Preprocessor(study, stats).transform(table)
    missing = table.categorical["Admission type"] < 0
    assert missing.any()
    one_hot = matrix[:, 5:8]
    assert (one_hot[missing] == 0).all() and (one_hot[~missing].sum(axis=1) == 1).all()
    np.testing.assert_array_equal(matrix[:, 8], missing.astype(np.float32))


def test_statistics_must_fit_the_study() -> None:
    study = hospital_study()
    good = statistics()
    with pytest.raises(ValidationError, match="study_sha256"):
        Preprocessor(study, good.model_copy(update={"study_sha256": "0" * 64}))
    partial = dict(good.numeric)
    del partial["Lactate mmol/L"]
    with pytest.raises(ValidationError, match="numeric features"):
        Preprocessor(study, good.model_copy(update={"numeric": partial}))
    wrong_range = dict(good.numeric)
    wrong_range["Age (years)"] = NumericStatistics(
        mean=0, scale=1, impute=0, clip_low=0, clip_high=1
    )
    with pytest.raises(ValidationError, match="clip range"):
        Preprocessor(study, good.model_copy(update={"numeric": wrong_range}))
    no_level = {**good.categorical, "Admission type": CategoricalStatistics()}
    with pytest.raises(ValidationError, match="no level"):
        Preprocessor(study, good.model_copy(update={"categorical": no_level}))
    with pytest.raises(ValueError):
        NumericStatistics(mean=0, scale=0, impute=0, clip_low=0, clip_high=1)


def test_training_loader_encodes_and_checks_cohort(tmp_path: Path) -> None:
    path = write_hospital_csv(tmp_path / "h.csv", n_patients=80)
    data = load_site_data_for_study(path, hospital_study(), statistics(), delta=1e-3)
    assert data.features.shape == (160, 8) and data.num_patients == 80
    assert data.feature_names[4] == "Lactate mmol/L__missing"
    from common.core.errors import DataError

    with pytest.raises(DataError, match="delta"):
        load_site_data_for_study(path, hospital_study(), statistics(), delta=0.1)
