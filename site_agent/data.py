"""Loading a site's data under a study (or a legacy schema), splitting it by patient, encoding it.

Bad data never reaches training: every problem raises `DataError` naming the file, the
row as a spreadsheet shows it (the header is row 1, the first record row 2) and the
column. Parquet files are reported with the same numbering, as if exported to CSV.

Cohort-size rule (documented for privacy officers in docs/privacy.md):
    Let N be the number of privacy units (patients under patient-level DP, records
    otherwise). We require
      * N >= MIN_PRIVACY_UNITS (too few units: DP noise swamps any signal and the
        held-out split is meaningless), and
      * delta <= 1 / N. A mechanism that publishes one random unit's data outright is
        (0, 1/N)-DP, so a delta at or above 1/N promises nothing; Dwork & Roth 2014,
        Sec. 2.3, ask for delta "less than the inverse of any polynomial in N".
    Note that the second condition bounds N from *above* for a fixed delta: a very
    large cohort needs a smaller delta.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from common.core.errors import ConfigError, DataError
from common.study import (
    GlobalStatistics,
    Study,
    check_statistics,
    class_index,
    encoded_feature_names,
)
from site_agent.unit_split import split_by_patient

if TYPE_CHECKING:
    import torch

NanPolicy = Literal["error", "drop_row", "impute_median"]
MIN_PRIVACY_UNITS = 50
_HEADER_ROW = 1
HEADER_ROW = _HEADER_ROW
"""The header's row number in every `DataError` (the first record is row 2)."""


@dataclass(frozen=True)
class DatasetSchema:
    """Which columns a site's file must have and how missing values are handled."""

    features: list[str]
    label: str
    patient_id: str | None = None
    nan_policy: NanPolicy = "error"

    def __post_init__(self) -> None:
        if not self.features:
            raise ConfigError("schema.features", "at least one feature column is required")
        if len(set(self.features)) != len(self.features):
            raise ConfigError("schema.features", "feature columns must be distinct")
        reserved = {self.label, self.patient_id}
        if reserved & set(self.features):
            raise ConfigError("schema.features", "label/patient id cannot also be a feature")
        if self.nan_policy not in ("error", "drop_row", "impute_median"):
            raise ConfigError("schema.nan_policy", f"unknown policy {self.nan_policy!r}")


@dataclass(frozen=True)
class SiteData:
    """One site's records: float32 features [N, F], labels 0/1 [N], patient ids or None."""

    features: np.ndarray
    labels: np.ndarray
    patient_ids: np.ndarray | None
    feature_names: list[str] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_patients(self) -> int:
        """Distinct patients (records count as patients when there is no id column)."""
        if self.patient_ids is None:
            return len(self)
        return int(np.unique(self.patient_ids).shape[0])

    def subset(self, index: np.ndarray) -> SiteData:
        """The records at `index` (a copy)."""
        return replace(
            self,
            features=self.features[index],
            labels=self.labels[index],
            patient_ids=None if self.patient_ids is None else self.patient_ids[index],
        )

    @property
    def record_shape(self) -> tuple[int, ...]:
        """Shape of one model input: the row's encoded width."""
        return tuple(self.features.shape[1:])

    def load(self, index: np.ndarray) -> torch.Tensor:
        """The rows at `index` as a float32 batch on the CPU (`Records`)."""
        import torch

        return torch.as_tensor(np.asarray(self.features[index], dtype=np.float32))

    def loader(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """Model inputs of a tensor of record indices: the table lives on `device`
        whole, so a step costs one gather (`Records`)."""
        import torch

        rows = torch.as_tensor(self.features, dtype=torch.float32, device=device)
        return lambda index: rows[index]


def training_units(units: int, *, held_out_fraction: float) -> int:
    """Privacy units expected for DP-SGD after `split_by_patient` holds some out (each unit
    is held out with probability `held_out_fraction`, so the trainer's count is within
    sampling noise of this), for `data check` to judge the cohort before the split."""
    return units - round(held_out_fraction * units)


def check_cohort_size(n_units: int, *, delta: float, unit: str, file: str | None = None) -> None:
    """Refuse cohorts too small to train on, or too large for `delta` (module docstring)."""
    if not 0.0 < delta < 1.0:
        raise ConfigError("delta", "must be in (0, 1)")
    if n_units < MIN_PRIVACY_UNITS:
        raise DataError(
            f"too few {unit}s: {n_units} < {MIN_PRIVACY_UNITS} needed for DP training",
            file=file,
        )
    if delta > 1.0 / n_units:
        raise DataError(
            f"delta {delta:g} is too large for {n_units} {unit}s: "
            f"need delta <= 1/N = {1.0 / n_units:.3g}",
            file=file,
        )


MISSING_TOKENS = frozenset(("", "nan", "na", "n/a", "null", "none"))


def is_missing(text: str) -> bool:
    """Whether a cell means "no value" (case and surrounding blanks ignored).

    The one definition of missing: the demo's draft study (`demo.study`),
    `medfed data check` and training all read cells through it, so a token the draft
    calls missing is never refused later as "not a number"."""
    return text.strip().lower() in MISSING_TOKENS


def _parse_float(text: str | None) -> float | None:
    """Float value of a cell; None for a missing value; raises ValueError if not numeric."""
    if text is None or is_missing(text):
        return None
    stripped = text.strip()
    value = float(stripped)
    if math.isnan(value):
        return None
    return value


def _refuse_other_delimiter(header: list[str], path: Path) -> None:
    """A header read as ONE column that holds semicolons or tabs is a file exported with
    another delimiter (spreadsheets in many locales write `;` and decimal commas):
    say so, instead of `missing column` for every column the study names. Not read
    as such: its decimal commas would be taken for numbers wrongly or refused cell by
    cell, so the file is re-exported as comma-separated CSV."""
    if len(header) != 1:
        return
    for delimiter, name in ((";", "semicolon"), ("\t", "tab")):
        if delimiter in header[0]:
            raise DataError(
                f"the header is a single column holding {name}s: the file looks "
                f"{name}-delimited, and medfed reads comma-separated CSV (RFC 4180, UTF-8). "
                "Save it again as CSV with commas between fields and a point as the "
                "decimal separator (or as Parquet)",
                file=str(path), row=_HEADER_ROW,
            )


def _iter_csv_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    # utf-8-sig: spreadsheet exports often start with a byte-order mark, which would
    # otherwise become part of the first column's name.
    handle = path.open(newline="", encoding="utf-8-sig")
    reader = csv.DictReader(handle)
    try:
        header = reader.fieldnames
    except (csv.Error, UnicodeDecodeError) as exc:
        handle.close()
        raise DataError(f"unreadable header: {exc}", file=str(path), row=_HEADER_ROW) from None
    if header is not None:
        header = [name.strip() for name in header]
        reader.fieldnames = header
        try:
            _refuse_other_delimiter(header, path)
        except DataError:
            handle.close()
            raise

    def rows() -> Iterator[tuple[int, dict[str, str]]]:
        try:
            for index, row in enumerate(reader):
                yield _HEADER_ROW + 1 + index, row
        except (csv.Error, UnicodeDecodeError) as exc:
            raise DataError(f"unreadable CSV: {exc}", file=str(path), row=reader.line_num) from None
        finally:
            handle.close()

    if header is None:
        handle.close()
        raise DataError("file is empty (no header row)", file=str(path))
    return list(header), rows()


def _iter_parquet_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    import pyarrow.parquet as pq  # type: ignore[import-untyped]  # only needed for Parquet

    table = pq.read_table(path)
    columns = {name: table.column(name).to_pylist() for name in table.column_names}

    def cell(value: object) -> str:
        return "" if value is None else str(value)

    def rows() -> Iterator[tuple[int, dict[str, str]]]:
        for index in range(table.num_rows):
            yield (
                _HEADER_ROW + 1 + index,
                {name: cell(values[index]) for name, values in columns.items()},
            )

    return list(table.column_names), rows()


def iter_table_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    """The header and the rows of a CSV or Parquet file, each row with its number as a
    spreadsheet shows it (header = row 1), so every `DataError` names file and row.

    The one reader of a site's tabular files: study tables, legacy schemas and an
    images study's labels CSV (`site_agent.imaging`)."""
    if not path.is_file():
        raise DataError("file not found", file=str(path))
    if path.suffix.lower() in (".parquet", ".pq"):
        return _iter_parquet_rows(path)
    return _iter_csv_rows(path)


def load_site_data(
    path: str | Path, schema: DatasetSchema, *, delta: float | None = None
) -> SiteData:
    """Read a CSV or Parquet file under `schema`; any bad cell raises `DataError`.

    With `delta`, also enforce the cohort-size rule on the privacy unit (patients when
    the schema has a patient column, records otherwise).
    """
    path = Path(path)
    file = str(path)
    header, rows = iter_table_rows(path)
    required = [*schema.features, schema.label]
    if schema.patient_id is not None:
        required.append(schema.patient_id)
    for column in required:
        if column not in header:
            raise DataError("missing column", file=file, row=_HEADER_ROW, column=column)

    feature_rows: list[list[float | None]] = []
    labels: list[int] = []
    patients: list[str] = []
    for row_number, row in rows:
        values: list[float | None] = []
        missing = False
        for column in schema.features:
            try:
                value = _parse_float(row.get(column))
            except ValueError:
                raise DataError(
                    f"not a number: {row.get(column)!r}", file=file, row=row_number, column=column
                ) from None
            if value is not None and not math.isfinite(value):
                raise DataError("infinite value", file=file, row=row_number, column=column)
            if value is None:
                if schema.nan_policy == "error":
                    raise DataError(
                        "missing value (NaN) under nan_policy 'error'",
                        file=file,
                        row=row_number,
                        column=column,
                    )
                missing = True
            values.append(value)
        try:
            label_value = _parse_float(row.get(schema.label))
        except ValueError:
            label_value = math.inf  # reported below as "not 0/1"
        if label_value is None:
            if schema.nan_policy == "drop_row":
                continue
            raise DataError("missing label", file=file, row=row_number, column=schema.label)
        if label_value not in (0.0, 1.0):
            raise DataError(
                f"label must be 0 or 1, got {row.get(schema.label)!r}",
                file=file,
                row=row_number,
                column=schema.label,
            )
        if schema.patient_id is not None:
            patient = (row.get(schema.patient_id) or "").strip()
            if not patient:
                raise DataError(
                    "missing patient id", file=file, row=row_number, column=schema.patient_id
                )
            patients.append(patient)
        if missing and schema.nan_policy == "drop_row":
            if schema.patient_id is not None:
                patients.pop()
            continue
        feature_rows.append(values)
        labels.append(int(label_value))

    if not labels:
        raise DataError("no usable records", file=file)
    matrix = np.array(
        [[np.nan if v is None else v for v in values] for values in feature_rows],
        dtype=np.float64,
    )
    if schema.nan_policy == "impute_median":
        for j, column in enumerate(schema.features):
            missing_mask = np.isnan(matrix[:, j])
            if missing_mask.all():
                raise DataError(
                    "every value is missing; cannot impute a median", file=file, column=column
                )
            matrix[missing_mask, j] = np.median(matrix[~missing_mask, j])
    data = SiteData(
        features=matrix.astype(np.float32),
        labels=np.array(labels, dtype=np.int64),
        patient_ids=np.array(patients, dtype=object) if schema.patient_id is not None else None,
        feature_names=list(schema.features),
        source=file,
    )
    if delta is not None:
        unit = "patient" if data.patient_ids is not None else "record"
        check_cohort_size(data.num_patients, delta=delta, unit=unit, file=file)
    return data


@dataclass(frozen=True)
class Standardizer:
    """Per-feature z-scoring with statistics from the site's own training split only.

    The held-out split is transformed with the training statistics so that evaluation
    does not peek at held-out data.
    """

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, features: np.ndarray) -> Standardizer:
        mean = features.mean(axis=0, dtype=np.float64)
        std = features.std(axis=0, dtype=np.float64)
        # A constant column would divide by zero; leave it centred but unscaled.
        scale = np.where(std > 1e-12, std, 1.0)
        return cls(mean=mean.astype(np.float32), scale=scale.astype(np.float32))

    def transform(self, data: SiteData) -> SiteData:
        scaled = (data.features - self.mean) / self.scale
        return replace(data, features=scaled.astype(np.float32))


def prepare_site_split(
    data: SiteData, *, held_out_fraction: float = 0.2, key: bytes,
    units: np.ndarray | None = None,
) -> tuple[SiteData, SiteData, Standardizer]:
    """Split by patient under the site's split key (`unit_split.split_by_patient`), fit the
    standardiser on the training part, apply it to both."""
    train, held_out = split_by_patient(data, held_out_fraction=held_out_fraction, key=key,
                                       units=units)
    standardizer = Standardizer.fit(train.features)
    return standardizer.transform(train), standardizer.transform(held_out), standardizer


# --------------------------------------------------------------------------- under a study

@dataclass(frozen=True)
class StudyTable:
    """A site's records read under a study, before encoding.

    What the preprocessor, `medfed data check` and the DP statistics release
    start from: numeric columns as float64 with NaN for a missing value, categorical
    columns as indices into the declared levels with -1 for a missing value, labels as
    class indices (None when the file has no label column, as for `predict`).
    """

    numeric: dict[str, np.ndarray]
    categorical: dict[str, np.ndarray]
    labels: np.ndarray | None
    patient_ids: np.ndarray | None
    rows: np.ndarray
    source: str = ""

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def subset(self, index: np.ndarray) -> StudyTable:
        """The records at `index`, as read (a copy)."""
        return replace(
            self,
            numeric={name: v[index] for name, v in self.numeric.items()},
            categorical={name: v[index] for name, v in self.categorical.items()},
            labels=None if self.labels is None else self.labels[index],
            patient_ids=None if self.patient_ids is None else self.patient_ids[index],
            rows=self.rows[index],
        )

    @property
    def num_patients(self) -> int:
        """Distinct patients (records count as patients when there is no id column)."""
        if self.patient_ids is None:
            return len(self)
        return int(np.unique(self.patient_ids).shape[0])

    def missing_counts(self) -> dict[str, int]:
        """Missing values per feature column."""
        counts = {name: int(np.isnan(v).sum()) for name, v in self.numeric.items()}
        counts.update({name: int((v < 0).sum()) for name, v in self.categorical.items()})
        return counts


def load_study_table(path: str | Path, study: Study, *, for_prediction: bool = False) -> StudyTable:
    """Read a CSV or Parquet file under `study`; a mismatch is a `DataError` naming the
    file, the row (as a spreadsheet shows it) and the column.

    Checks: every feature column is present (any order, extra columns ignored), numeric
    cells are numbers, categorical cells are declared levels, a missing value only where
    the feature's policy allows it, labels are among the study's classes, patient ids
    are present. With `for_prediction`, the label and patient columns may be absent.
    """
    path = Path(path)
    file = str(path)
    if study.data.kind != "table":
        raise DataError(f"study data.kind is {study.data.kind!r}; this file is a table", file=file)
    header, rows = iter_table_rows(path)
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        raise DataError(f"repeated column names {repeated}", file=file, row=_HEADER_ROW)
    label_column = study.data.label_column
    patient_column = study.data.patient_column
    has_label = label_column in header
    has_patient = patient_column is not None and patient_column in header
    required = [f.name for f in study.features]
    if not for_prediction:
        required.append(label_column)
        if patient_column is not None:
            required.append(patient_column)
    for column in required:
        if column not in header:
            raise DataError(
                "missing column (the study requires it)", file=file, row=_HEADER_ROW, column=column
            )

    numeric_specs = [f for f in study.features if f.type == "numeric"]
    categorical_specs = [f for f in study.features if f.type == "categorical"]
    level_index = {
        f.name: {lv: i for i, lv in enumerate(f.levels or ())} for f in categorical_specs
    }
    numeric: dict[str, list[float]] = {f.name: [] for f in numeric_specs}
    categorical: dict[str, list[int]] = {f.name: [] for f in categorical_specs}
    labels: list[int] = []
    patients: list[str] = []
    row_numbers: list[int] = []
    for row_number, row in rows:
        for spec in numeric_specs:
            cell = row.get(spec.name) or ""
            try:
                value = _parse_float(cell)
            except ValueError:
                raise DataError(
                    f"not a number: {cell!r} (the study declares this feature numeric)",
                    file=file,
                    row=row_number,
                    column=spec.name,
                ) from None
            if value is not None and not math.isfinite(value):
                raise DataError("infinite value", file=file, row=row_number, column=spec.name)
            if value is None and spec.missing == "error":
                raise DataError(
                    "missing value, and the study says missing = 'error' for this feature",
                    file=file,
                    row=row_number,
                    column=spec.name,
                )
            numeric[spec.name].append(math.nan if value is None else value)
        for spec in categorical_specs:
            cell = (row.get(spec.name) or "").strip()
            code = level_index[spec.name].get(cell)
            if code is None:
                if not is_missing(cell):
                    raise DataError(
                        f"level {cell!r} is not declared; the study's levels are "
                        f"{list(spec.levels or ())}",
                        file=file,
                        row=row_number,
                        column=spec.name,
                    )
                if spec.missing == "error":
                    raise DataError(
                        "missing value, and the study says missing = 'error' for this feature",
                        file=file,
                        row=row_number,
                        column=spec.name,
                    )
                code = -1
            categorical[spec.name].append(code)
        if has_label:
            cell = row.get(label_column) or ""
            if is_missing(cell):
                raise DataError("missing label", file=file, row=row_number, column=label_column)
            index = class_index(study, cell)
            if index is None:
                raise DataError(
                    f"label {cell.strip()!r} is not one of the study's classes "
                    f"{list(study.study.classes)}",
                    file=file,
                    row=row_number,
                    column=label_column,
                )
            labels.append(index)
        if has_patient:
            patient = (row.get(patient_column or "") or "").strip()
            if not patient:
                raise DataError(
                    "missing patient id", file=file, row=row_number, column=patient_column
                )
            patients.append(patient)
        row_numbers.append(row_number)
    if not row_numbers:
        raise DataError("no records", file=file)
    return StudyTable(
        numeric={k: np.array(v, dtype=np.float64) for k, v in numeric.items()},
        categorical={k: np.array(v, dtype=np.int64) for k, v in categorical.items()},
        labels=np.array(labels, dtype=np.int64) if has_label else None,
        patient_ids=np.array(patients, dtype=object) if has_patient else None,
        rows=np.array(row_numbers, dtype=np.int64),
        source=file,
    )


class Preprocessor:
    """The one encoding of a study's features, used for training and for `predict`.

    Per feature, in the study's order: a numeric value is imputed (if missing) with the
    global imputation value, clipped into the global range and standardised with the
    global mean and scale; a categorical value is one-hot encoded in the declared level
    order (a missing one imputes the global level, or is all zeros under ``indicator``);
    ``indicator`` features add a 0/1 was-missing column. The statistics are required:
    they come from the federated DP release or the model bundle, never from
    this site's data alone, so every site and every hospital using the model scale alike.
    """

    def __init__(self, study: Study, statistics: GlobalStatistics) -> None:
        check_statistics(study, statistics)
        self.study = study
        self.statistics = statistics

    def feature_names(self) -> list[str]:
        return encoded_feature_names(self.study)

    def transform(self, table: StudyTable) -> np.ndarray:
        """Encoded float32 matrix [records, len(feature_names())]."""
        columns: list[np.ndarray] = []
        n = len(table)
        for spec in self.study.features:
            if spec.type == "numeric":
                raw = table.numeric[spec.name]
                missing = np.isnan(raw)
                stats = self.statistics.numeric[spec.name]
                values = np.where(missing, stats.impute, raw)
                values = np.clip(values, stats.clip_low, stats.clip_high)
                columns.append(((values - stats.mean) / stats.scale).reshape(n, 1))
            else:
                codes = table.categorical[spec.name]
                missing = codes < 0
                levels = list(spec.levels or ())
                impute = self.statistics.categorical[spec.name].impute
                if spec.missing == "impute" and impute is not None:
                    codes = np.where(missing, levels.index(impute), codes)
                one_hot = np.zeros((n, len(levels)), dtype=np.float64)
                present = codes >= 0
                one_hot[np.flatnonzero(present), codes[present]] = 1.0
                columns.append(one_hot)
            if spec.missing == "indicator":
                columns.append(missing.astype(np.float64).reshape(n, 1))
        matrix = np.concatenate(columns, axis=1) if columns else np.zeros((n, 0))
        return matrix.astype(np.float32)

    def imputations(self, table: StudyTable) -> dict[str, int]:
        """How many values of each feature were filled in (for the site's log)."""
        return {name: count for name, count in table.missing_counts().items() if count}

    def site_data(self, table: StudyTable) -> SiteData:
        """Encoded records ready for training (labels are class indices)."""
        if table.labels is None:
            raise DataError("no label column: cannot train", file=table.source)
        return SiteData(
            features=self.transform(table),
            labels=table.labels,
            patient_ids=table.patient_ids,
            feature_names=self.feature_names(),
            source=table.source,
        )


def load_site_data_for_study(
    path: str | Path,
    study: Study,
    statistics: GlobalStatistics,
    *,
    delta: float | None = None,
) -> SiteData:
    """Load, check and encode a site's file for training under `study`.

    With `delta`, also enforce the cohort-size rule (module docstring) on the privacy
    unit: patients when the study has a patient column, records otherwise.
    """
    table = load_study_table(path, study)
    data = Preprocessor(study, statistics).site_data(table)
    if delta is not None:
        unit = "patient" if data.patient_ids is not None else "record"
        check_cohort_size(data.num_patients, delta=delta, unit=unit, file=str(path))
    return data
