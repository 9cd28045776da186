"""`medfed data check` and loading under a study, on a hospital-style CSV: its own column
names, string labels, a string categorical column, missing values."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from common.commands.cli import main_with
from common.commands.study import render_study_toml
from common.core.errors import DataError
from common.study import study_from_mapping
from site_agent.data import load_study_table
from site_agent.datacheck import check_data_against_study
from site_agent.predict_cli import register_data
from tests.study.helpers import (
    ADMISSION,
    COLUMNS,
    hospital_rows,
    hospital_study,
    study_mapping,
    write_hospital_csv,
)


def write_rows(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_study(tmp_path: Path, **privacy: float) -> Path:
    path = tmp_path / "study.toml"
    path.write_text(
        render_study_toml(study_from_mapping(study_mapping(**privacy))), encoding="utf-8"
    )
    return path


def test_hospital_file_passes(tmp_path: Path) -> None:
    data = write_hospital_csv(tmp_path / "st-marys.csv", n_patients=120)
    report = check_data_against_study(data, hospital_study())
    assert report.ok, report.problems
    assert (report.records, report.patients, report.units) == (240, 120, 120)
    assert report.privacy_unit == "patient" and report.max_delta == pytest.approx(1 / 120)
    assert report.missing["Lactate mmol/L"] > 0 and report.missing["Admission type"] > 0
    assert report.missing["Age (years)"] == 0
    assert sum(report.labels.values()) == 240 and set(report.labels) == {"no", "yes"}
    levels = report.levels["Admission type"]
    assert levels.declared == ADMISSION and set(levels.found) == set(ADMISSION)
    table = load_study_table(data, hospital_study())
    assert set(table.labels.tolist()) == {0, 1}  # type: ignore[union-attr]
    assert table.categorical["Sex"].min() >= 0  # "F"/"M" -> 0/1


def test_cli_reports_and_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_hospital_csv(tmp_path / "site.csv", n_patients=120)
    study = write_study(tmp_path)
    argv = ["data", "check", "--study", str(study), "--data", str(data)]
    assert main_with([register_data], argv) == 0
    text = capsys.readouterr().out
    assert "ok" in text and "120 patients" in text and "levels of Admission type" in text
    assert main_with([register_data], [*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["ok"] is True and report["records"] == 240


def test_delta_too_large_for_cohort_exits_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_hospital_csv(tmp_path / "small.csv", n_patients=70)  # 56 train
    study = write_study(tmp_path, delta=0.05)
    argv = ["data", "check", "--study", str(study), "--data", str(data), "--json"]
    assert main_with([register_data], argv) == 1
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["ok"] is False and "delta 0.05 is too large for 56 patients" in str(
        report["problems"]
    )


def _edited(tmp_path: Path, row: int, column: str, value: str, *, drop: str = "") -> Path:
    rows = hospital_rows(60, seed=3)
    header = list(COLUMNS)
    rows[row - 2][header.index(column)] = value  # spreadsheet row 2 is rows[0]
    if drop:
        index = header.index(drop)
        header.pop(index)
        for r in rows:
            r.pop(index)
    return write_rows(tmp_path / "bad.csv", header, rows)


@pytest.mark.parametrize(
    ("row", "column", "value", "err_row", "err_column", "words"),
    [
        (5, "Admission type", "Elective", 5, "Admission type", "level 'Elective' is not declared"),
        (7, "Sex", "X", 7, "Sex", "not declared; the study's levels are ['F', 'M']"),
        (9, "Age (years)", "forty", 9, "Age (years)", "not a number: 'forty'"),
        (4, "Age (years)", "", 4, "Age (years)", "missing = 'error'"),
        (11, "Sex", "", 11, "Sex", "missing = 'error'"),
        (6, "Outcome", "maybe", 6, "Outcome", "not one of the study's classes ['no', 'yes']"),
        (8, "Outcome", "", 8, "Outcome", "missing label"),
        (3, "Patient-ID", " ", 3, "Patient-ID", "missing patient id"),
    ],
)
def test_mismatch_names_file_row_column(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    row: int,
    column: str,
    value: str,
    err_row: int,
    err_column: str,
    words: str,
) -> None:
    path = _edited(tmp_path, row, column, value)
    with pytest.raises(DataError) as info:
        check_data_against_study(path, hospital_study())
    err = info.value
    assert (err.file, err.row, err.column) == (str(path), err_row, err_column)
    assert words in err.message
    study = write_study(tmp_path)
    argv = ["data", "check", "--study", str(study), "--data", str(path), "--json"]
    assert main_with([register_data], argv) == 2
    captured = capsys.readouterr()
    assert f"row {err_row}" in captured.err
    payload = json.loads(captured.out.splitlines()[-1])
    assert payload["ok"] is False and payload["error"]["column"] == err_column


def test_missing_column_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _edited(tmp_path, 2, "Sex", "F", drop="Lactate mmol/L")
    with pytest.raises(DataError) as info:
        check_data_against_study(path, hospital_study())
    assert (info.value.row, info.value.column) == (1, "Lactate mmol/L")
    study = write_study(tmp_path)
    argv = ["data", "check", "--study", str(study), "--data", str(path)]
    assert main_with([register_data], argv) == 2
    assert "column 'Lactate mmol/L'" in capsys.readouterr().err


@pytest.mark.parametrize(("delimiter", "name"), [(";", "semicolon"), ("\t", "tab")])
def test_semicolon_or_tab_delimited_file_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], delimiter: str, name: str
) -> None:
    """A spreadsheet export with `;` (decimal commas) or tabs reads as one column: the
    error says what the file looks like, not `missing column` for a column it has."""
    path = tmp_path / "export.csv"
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter=delimiter)
        writer.writerow(COLUMNS)
        writer.writerows([[cell.replace(".", ",") for cell in row]
                          for row in hospital_rows(40, seed=3)])
    with pytest.raises(DataError, match=f"looks {name}-delimited") as info:
        load_study_table(path, hospital_study())
    assert info.value.row == 1 and info.value.column is None
    study = write_study(tmp_path)
    argv = ["data", "check", "--study", str(study), "--data", str(path)]
    assert main_with([register_data], argv) == 2
    err = capsys.readouterr().err
    assert str(path) in err and f"looks {name}-delimited" in err
    assert "comma-separated" in err and "missing column" not in err


def test_column_order_and_extra_columns_do_not_matter(tmp_path: Path) -> None:
    rows = hospital_rows(60, seed=4)
    order = [5, 3, 0, 4, 2, 1]
    header = [COLUMNS[i] for i in order] + ["Ward"]
    shuffled = [[r[i] for i in order] + ["B2"] for r in rows]
    path = write_rows(tmp_path / "reordered.csv", header, shuffled)
    original = write_rows(tmp_path / "original.csv", COLUMNS, rows)
    a = load_study_table(path, hospital_study())
    b = load_study_table(original, hospital_study())
    for name in a.numeric:
        assert a.numeric[name].tobytes() == b.numeric[name].tobytes()
    for name in a.categorical:
        assert (a.categorical[name] == b.categorical[name]).all()


def test_numeric_labels_match_declared_integers(tmp_path: Path) -> None:
    mapping = study_mapping()
    mapping["study"]["classes"] = [0, 1]
    study = study_from_mapping(mapping)
    rows = hospital_rows(60, seed=5)
    for i, r in enumerate(rows):
        r[5] = ["0", "1.0"][i % 2]
    table = load_study_table(write_rows(tmp_path / "n.csv", COLUMNS, rows), study)
    assert table.labels is not None and table.labels.tolist()[:4] == [0, 1, 0, 1]


def test_site_checks_policy_then_data_before_joining(tmp_path: Path) -> None:
    from common.core.config import PrivacySection, SiteSettings
    from common.core.errors import PrivacyError
    from common.study import SitePrivacyPolicy
    from site_agent.datacheck import check_site_can_join, site_policy

    settings = SiteSettings(
        site="st-marys",
        coordinator="127.0.0.1:7443",
        state=tmp_path / "state",
        pki=tmp_path / "pki",
        privacy=PrivacySection(budget_epsilon=8.0, delta=1e-3, privacy_unit="patient"),
    )
    policy = site_policy(settings)
    assert (policy.epsilon, policy.delta, policy.unit) == (8.0, 1e-3, "patient")
    # The site's count_epsilon is its limit; its per-round cap is read from [policy].
    assert policy.max_count_epsilon == settings.privacy.count_epsilon
    capped = settings.model_copy(update={"policy": settings.policy.model_copy(
        update={"max_epsilon_per_round": 0.7})})
    assert site_policy(capped).max_epsilon_per_round == 0.7
    data = write_hospital_csv(tmp_path / "h.csv", n_patients=120)
    report = check_site_can_join(hospital_study(), policy, data)
    assert report.ok and report.units == 120
    with pytest.raises(PrivacyError, match=r"privacy\.epsilon"):
        check_site_can_join(hospital_study(), SitePrivacyPolicy(epsilon=1.0, delta=1e-3), data)
    small = write_hospital_csv(tmp_path / "small.csv", n_patients=70)  # 56 train
    with pytest.raises(DataError, match="too large for 56 patients") as info:
        check_site_can_join(
            study_from_mapping(study_mapping(delta=1e-3)),
            SitePrivacyPolicy(epsilon=8.0, delta=0.05),
            small,
        )
    assert info.value.file == str(small)


def test_too_few_patients_is_a_problem(tmp_path: Path) -> None:
    data = write_hospital_csv(tmp_path / "tiny.csv", n_patients=30)
    report = check_data_against_study(data, hospital_study())
    assert not report.ok and "too few patients: 24 < 50" in report.problems[0]
    assert "the training split: 30 patients less the 20% held out" in report.problems[0]
