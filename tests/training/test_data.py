"""Site data loading: every bad input names file, row and column; splits are by patient."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.core.errors import DataError
from common.study import Study, study_from_mapping
from site_agent.data import (
    MIN_PRIVACY_UNITS,
    DatasetSchema,
    SiteData,
    check_cohort_size,
    load_site_data,
    load_study_table,
    prepare_site_split,
    split_by_patient,
)

SCHEMA = DatasetSchema(features=["hr", "lactate"], label="sepsis", patient_id="pid")


def write_csv(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def good_rows(n_patients: int = 60) -> list[str]:
    rows = ["pid,hr,lactate,sepsis"]
    for i in range(n_patients):
        rows.append(f"p{i},{80 + i % 30},{1.0 + (i % 7) / 10},{i % 2}")
        rows.append(f"p{i},{85 + i % 30},{1.2 + (i % 5) / 10},{(i // 2) % 2}")
    return rows


def test_loads_valid_csv(tmp_path: Path) -> None:
    data = load_site_data(write_csv(tmp_path / "site.csv", good_rows()), SCHEMA, delta=1e-5)
    assert data.features.dtype == np.float32 and data.features.shape == (120, 2)
    assert data.labels.dtype == np.int64 and set(np.unique(data.labels)) == {0, 1}
    assert data.patient_ids is not None and data.num_patients == 60
    assert data.features[1, 0] == pytest.approx(85.0)


@pytest.mark.parametrize(
    ("edit_row", "new_line", "row", "column", "words"),
    [
        (3, "p1,abc,1.1,0", 3, "hr", "not a number"),
        (2, "p0,80,,1", 2, "lactate", "missing value"),
        (4, "p1,80,nan,1", 4, "lactate", "missing value"),
        (5, "p2,80,1.0,2", 5, "sepsis", "label must be 0 or 1"),
        (6, "p2,80,1.0,yes", 6, "sepsis", "label must be 0 or 1"),
        (7, ",80,1.0,1", 7, "pid", "missing patient id"),
        (8, "p3,inf,1.0,1", 8, "hr", "infinite"),
        (9, "p4,80,1.0,", 9, "sepsis", "missing label"),
    ],
)
def test_bad_cells_name_file_row_and_column(
    tmp_path: Path, edit_row: int, new_line: str, row: int, column: str, words: str
) -> None:
    rows = good_rows()
    rows[edit_row - 1] = new_line  # rows[0] is the header, spreadsheet row 1
    path = write_csv(tmp_path / "bad.csv", rows)
    with pytest.raises(DataError) as info:
        load_site_data(path, SCHEMA)
    err = info.value
    assert (err.file, err.row, err.column) == (str(path), row, column)
    assert words in err.message
    assert f"row {row}" in str(err) and repr(column) in str(err) and str(path) in str(err)


def test_missing_column_is_named(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "site.csv", ["pid,hr,sepsis", "p1,80,1"])
    with pytest.raises(DataError) as info:
        load_site_data(path, SCHEMA)
    assert (info.value.column, info.value.row, info.value.file) == ("lactate", 1, str(path))


@pytest.mark.parametrize("content", ["", "pid,hr,lactate,sepsis\n"])
def test_empty_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.csv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as info:
        load_site_data(path, SCHEMA)
    assert info.value.file == str(path)


def test_nan_policies(tmp_path: Path) -> None:
    rows = good_rows()
    rows[1] = "p0,,1.5,1"  # missing hr in row 2
    path = write_csv(tmp_path / "nan.csv", rows)
    dropped = load_site_data(path, DatasetSchema(["hr", "lactate"], "sepsis", "pid", "drop_row"))
    assert len(dropped) == 119
    imputed = load_site_data(
        path, DatasetSchema(["hr", "lactate"], "sepsis", "pid", "impute_median")
    )
    assert len(imputed) == 120
    observed_hr = imputed.features[1:, 0]
    assert imputed.features[0, 0] == pytest.approx(np.median(observed_hr))


def test_too_few_patients_for_delta(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "small.csv", good_rows(n_patients=10))
    assert len(load_site_data(path, SCHEMA)) == 20  # fine without a privacy check
    with pytest.raises(DataError) as info:
        load_site_data(path, SCHEMA, delta=1e-5)
    assert "too few patients" in info.value.message and info.value.file == str(path)


def test_delta_must_not_exceed_one_over_n() -> None:
    check_cohort_size(1000, delta=1e-3, unit="patient")  # delta == 1/N is allowed
    with pytest.raises(DataError, match="delta"):
        check_cohort_size(1000, delta=2e-3, unit="patient")
    with pytest.raises(DataError, match="too few records"):
        check_cohort_size(MIN_PRIVACY_UNITS - 1, delta=1e-9, unit="record")


def test_parquet_reports_rows_like_csv(tmp_path: Path) -> None:
    table = pa.table(
        {
            "pid": [f"p{i}" for i in range(60)],
            "hr": [80.0 + i for i in range(60)],
            "lactate": [1.0] * 59 + [None],
            "sepsis": [i % 2 for i in range(60)],
        }
    )
    path = tmp_path / "site.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataError) as info:
        load_site_data(path, SCHEMA)
    assert (info.value.row, info.value.column) == (61, "lactate")  # record 60 = row 61
    imputed = load_site_data(
        path, DatasetSchema(["hr", "lactate"], "sepsis", "pid", "impute_median"), delta=1e-5
    )
    assert imputed.features.shape == (60, 2) and imputed.num_patients == 60


def _toy(n_patients: int, per_patient: int) -> SiteData:
    ids = np.repeat([f"p{i}" for i in range(n_patients)], per_patient).astype(object)
    rng = np.random.default_rng(0)
    return SiteData(
        features=rng.normal(size=(len(ids), 3)).astype(np.float32),
        labels=rng.integers(0, 2, size=len(ids)),
        patient_ids=ids,
    )


def test_split_is_by_patient_and_deterministic() -> None:
    data = _toy(200, 3)
    train, held = split_by_patient(data, held_out_fraction=0.25, key=b"k" * 32)
    assert train.patient_ids is not None and held.patient_ids is not None
    assert not set(train.patient_ids) & set(held.patient_ids)
    assert len(train) + len(held) == len(data)
    # Each patient held out with probability 0.25: Binomial(200, 0.25), sd 6.1.
    assert abs(len(set(held.patient_ids)) - 50) <= 4 * 6.2
    again, _ = split_by_patient(data, held_out_fraction=0.25, key=b"k" * 32)
    np.testing.assert_array_equal(again.features, train.features)
    other, _ = split_by_patient(data, held_out_fraction=0.25, key=b"K" * 32)
    assert set(other.patient_ids) != set(train.patient_ids)


def test_standardisation_uses_training_split_only() -> None:
    data = _toy(200, 2)
    shifted = SiteData(data.features + 10.0, data.labels, data.patient_ids)
    train, held, standardizer = prepare_site_split(shifted, held_out_fraction=0.3, key=b"k" * 32)
    np.testing.assert_allclose(train.features.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(train.features.std(axis=0), 1.0, atol=1e-4)
    raw_train, raw_held = split_by_patient(shifted, held_out_fraction=0.3, key=b"k" * 32)
    np.testing.assert_allclose(standardizer.mean, raw_train.features.mean(axis=0), rtol=1e-5)
    expected_held = (raw_held.features - standardizer.mean) / standardizer.scale
    np.testing.assert_allclose(held.features, expected_held, rtol=1e-5, atol=1e-5)
    assert not np.allclose(held.features.mean(axis=0), 0.0, atol=1e-6)


# --------------------------------------------------------------------------- under a study


def test_byte_order_mark_and_padded_header(tmp_path: Path) -> None:
    """Spreadsheet exports: a BOM before the first name, spaces around names."""
    rows = good_rows()
    rows[0] = "pid , hr,lactate ,sepsis"
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbf" + ("\n".join(rows) + "\n").encode())
    data = load_site_data(path, SCHEMA)
    assert data.features.shape == (120, 2) and data.num_patients == 60


def _study(missing: str = "error") -> Study:
    return study_from_mapping(
        {
            "study": {"name": "t", "rounds": 1},
            "data": {"label_column": "sepsis", "patient_column": "pid"},
            "features": [
                {"name": "hr", "missing": missing},
                {"name": "ward", "type": "categorical", "levels": ["A", "B"], "missing": missing},
            ],
        }
    )


def test_study_table_from_parquet_reports_rows_like_csv(tmp_path: Path) -> None:
    table = pa.table(
        {
            "pid": [f"p{i}" for i in range(60)],
            "hr": [80.0 + i for i in range(59)] + [None],
            "ward": ["A", "B"] * 30,
            "sepsis": [i % 2 for i in range(60)],
        }
    )
    path = tmp_path / "site.parquet"
    pq.write_table(table, path)
    with pytest.raises(DataError) as info:
        load_study_table(path, _study())
    assert (info.value.row, info.value.column) == (61, "hr")
    loaded = load_study_table(path, _study("indicator"))
    assert len(loaded) == 60 and loaded.missing_counts() == {"hr": 1, "ward": 0}
    assert loaded.labels is not None and loaded.labels.sum() == 30


def test_study_table_for_prediction_needs_only_features(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "new.csv", ["ward,hr", "B,70", "A,"])
    with pytest.raises(DataError) as info:
        load_study_table(path, _study("impute"))
    assert info.value.column == "sepsis" and info.value.row == 1
    table = load_study_table(path, _study("impute"), for_prediction=True)
    assert table.labels is None and table.patient_ids is None
    assert table.categorical["ward"].tolist() == [1, 0]
    assert np.isnan(table.numeric["hr"][1]) and table.rows.tolist() == [2, 3]


def test_repeated_column_is_refused(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "dup.csv", ["pid,hr,hr,ward,sepsis", "p1,1,2,A,0"])
    with pytest.raises(DataError, match="repeated column"):
        load_study_table(path, _study())
