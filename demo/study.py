"""The study `medfed demo --data DIR` runs: drafted from the folder's CSVs, served with
`coordinator serve --study`, so the demo on a hospital's own files walks the same path as
a real federation (enrolment carries the study, the federated DP statistics round, one
model bundle per round, the final model at every site).

A real federation drafts its study from column names only (`medfed study init`) and
declares categorical levels by hand. The demo holds every site's file on one machine, so
it also reads their values to find which columns are categorical, their levels, which
columns have missing values and the label's classes; it says so when it does.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from common.commands.study import TABLE_DEFAULT_LEARNING_RATE, TABLE_DEFAULT_MODEL
from common.core.errors import ConfigError, DataError
from common.releases.statistics import decode_release, encode_release, statistics_length
from common.study import GlobalStatistics, Study, study_from_mapping
from site_agent.data import is_missing, iter_table_rows
from site_agent.synthetic import FEATURES, LABEL, PATIENT_ID


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


class ColumnSurvey:
    """What the demo learns about one column across every site's file."""

    def __init__(self) -> None:
        self.values: set[str] = set()
        self.missing = False
        self.numeric = True

    def add(self, cell: str) -> None:
        if is_missing(cell):
            self.missing = True
            return
        text = cell.strip()
        if self.numeric and not _is_number(text):
            self.numeric = False
        if not self.numeric or len(self.values) <= 64:
            self.values.add(text)


def survey_csvs(files: Iterable[Path]) -> tuple[list[str], dict[str, ColumnSurvey]]:
    """Column names (the first file's order) and each column's survey over all files;
    every file must have the first file's columns (the message names the file).

    Reads through `site_agent.data.iter_table_rows`, the reader `data check` and training
    use, so the draft sees the same header, cells and "missing" as the sites will."""
    columns: list[str] | None = None
    surveys: dict[str, ColumnSurvey] = {}
    for path in files:
        header, rows = iter_table_rows(path)
        if columns is None:
            columns = header
            surveys = {name: ColumnSurvey() for name in header}
        missing = [name for name in columns if name not in header]
        if missing:
            raise DataError(f"missing column(s) {missing} that the other files have",
                            file=str(path))
        for _row_number, row in rows:
            for name, cell in row.items():
                if name in surveys and cell is not None:
                    surveys[name].add(cell)
    if columns is None:
        raise ConfigError("--data", "no CSV files")
    return columns, surveys


def _classes(survey: ColumnSurvey, label: str) -> list[int | str]:
    if survey.missing:
        raise DataError(f"label column {label!r} has missing values")
    values = sorted(survey.values)
    if len(values) < 2:
        raise DataError(f"label column {label!r} has fewer than two classes: {values}")
    if all(_is_number(v) and float(v).is_integer() for v in values):
        return sorted(int(float(v)) for v in values)
    return list(values)


def draft_demo_study(
    files: dict[str, Path], *, name: str, label_column: str, patient_column: str | None,
    rounds: int, epsilon: float, delta: float, histogram_bins: int,
) -> tuple[Study, list[str]]:
    """The study for the demo's CSV folder, and lines saying what was read from values.

    Model and training are what `medfed study init` drafts (`draft_study`'s defaults),
    so the demo on a hospital's files measures the study a hospital would start from."""
    columns, surveys = survey_csvs(files[site] for site in sorted(files))
    for required, flag in ((label_column, "--label-column"), (patient_column, "--patient-column")):
        if required is not None and required not in columns:
            raise ConfigError(flag, f"no column {required!r} in {files[sorted(files)[0]]} "
                                    f"(columns: {', '.join(columns)})")
    features: list[dict[str, Any]] = []
    notes: list[str] = []
    for column in columns:
        if column in (label_column, patient_column):
            continue
        survey = surveys[column]
        missing = "impute" if survey.missing else "error"
        if survey.numeric:
            features.append({"name": column, "type": "numeric", "missing": missing})
        else:
            levels = sorted(survey.values)
            features.append({"name": column, "type": "categorical", "levels": levels,
                             "missing": "indicator" if survey.missing else "error"})
            notes.append(f"{column}: categorical, levels {', '.join(levels)}")
        if survey.missing:
            notes.append(f"{column}: missing values "
                         f"({'imputed' if survey.numeric else 'own indicator level'})")
    classes = _classes(surveys[label_column], label_column)
    mapping: dict[str, Any] = {
        "study": {"name": name, "rounds": rounds,
                  "task": "binary" if len(classes) == 2 else "multiclass",
                  "classes": classes},
        "data": {"label_column": label_column,
                 **({"patient_column": patient_column} if patient_column else {})},
        "features": features,
        "model": {"name": TABLE_DEFAULT_MODEL},
        "training": {"learning_rate": TABLE_DEFAULT_LEARNING_RATE},
        "privacy": {"unit": "patient" if patient_column else "record",
                    "epsilon": epsilon, "delta": delta,
                    "evaluation": {"histogram_bins": histogram_bins}},
    }
    folder = files[sorted(files)[0]].parent
    return study_from_mapping(mapping, source=f"the demo's study for {folder}"), notes


def exact_statistics(tables: dict[str, Any], study: Study, *, seed: int) -> GlobalStatistics:
    """Noiseless pooled statistics, for the demo's in-process NON-PRIVATE baselines only
    (the federation itself uses the federated DP release)."""
    rng = np.random.default_rng(seed)
    total = np.zeros(statistics_length(study), dtype=np.int64)
    for site in sorted(tables):
        total += encode_release(tables[site], study, uniform=rng.random)
    return decode_release(total, study, source="the demo's non-private baseline (exact)")


def synthetic_demo_study(
    *, name: str, rounds: int, epsilon: float, delta: float, histogram_bins: int,
    local_epochs: int, learning_rate: float, batch_size: int,
) -> Study:
    """The study of the embedded synthetic sepsis cohort (`site_agent.synthetic`): its
    columns as the generator writes them (all numeric, none missing), declared as a real
    study declares them rather than read from the values; the small MLP the cohort's
    ground truth is learnable by, and the demo's training settings."""
    mapping: dict[str, Any] = {
        "study": {"name": name, "rounds": rounds, "task": "binary", "classes": [0, 1]},
        "data": {"label_column": LABEL, "patient_column": PATIENT_ID},
        "features": [{"name": column, "type": "numeric", "missing": "error"}
                     for column in FEATURES],
        "model": {"name": "mlp"},
        "training": {"local_epochs": local_epochs, "learning_rate": learning_rate,
                     "batch_size": batch_size},
        "privacy": {"unit": "patient", "epsilon": epsilon, "delta": delta,
                    "evaluation": {"histogram_bins": histogram_bins}},
    }
    return study_from_mapping(mapping, source="the demo's synthetic cohort")
