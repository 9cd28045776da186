"""Loading a site's data under a declared schema, splitting it by patient, standardising it.

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
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from common.errors import ConfigError, DataError

NanPolicy = Literal["error", "drop_row", "impute_median"]
MIN_PRIVACY_UNITS = 50
_HEADER_ROW = 1


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


def _parse_float(text: str | None) -> float | None:
    """Float value of a cell; None for a missing value; raises ValueError if not numeric."""
    if text is None:
        return None
    stripped = text.strip()
    if stripped == "" or stripped.lower() in ("nan", "na", "null"):
        return None
    value = float(stripped)
    if math.isnan(value):
        return None
    return value


def _iter_csv_rows(path: Path) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    handle = path.open(newline="", encoding="utf-8")
    reader = csv.DictReader(handle)
    header = reader.fieldnames

    def rows() -> Iterator[tuple[int, dict[str, str]]]:
        try:
            for index, row in enumerate(reader):
                yield _HEADER_ROW + 1 + index, row
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


def load_site_data(
    path: str | Path, schema: DatasetSchema, *, delta: float | None = None
) -> SiteData:
    """Read a CSV or Parquet file under `schema`; any bad cell raises `DataError`.

    With `delta`, also enforce the cohort-size rule on the privacy unit (patients when
    the schema has a patient column, records otherwise).
    """
    path = Path(path)
    file = str(path)
    if not path.is_file():
        raise DataError("file not found", file=file)
    if path.suffix.lower() in (".parquet", ".pq"):
        header, rows = _iter_parquet_rows(path)
    else:
        header, rows = _iter_csv_rows(path)
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


def split_by_patient(
    data: SiteData, *, held_out_fraction: float, seed: int
) -> tuple[SiteData, SiteData]:
    """Train / held-out split with no patient on both sides; deterministic by `seed`."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ConfigError("held_out_fraction", "must be in (0, 1)")
    if data.patient_ids is None:
        unit_of_record = np.arange(len(data))
        n_units = len(data)
    else:
        # Sorting the distinct ids first makes the split independent of row order.
        _, unit_of_record = np.unique(data.patient_ids, return_inverse=True)
        n_units = int(unit_of_record.max()) + 1
    rng = np.random.default_rng(seed)
    permutation = rng.permutation(n_units)
    n_held_out = max(1, round(held_out_fraction * n_units))
    held_out_units = np.zeros(n_units, dtype=bool)
    held_out_units[permutation[:n_held_out]] = True
    held_out_mask = held_out_units[unit_of_record]
    return data.subset(np.flatnonzero(~held_out_mask)), data.subset(np.flatnonzero(held_out_mask))


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
    data: SiteData, *, held_out_fraction: float = 0.2, seed: int
) -> tuple[SiteData, SiteData, Standardizer]:
    """Split by patient, fit the standardiser on the training part, apply it to both."""
    train, held_out = split_by_patient(data, held_out_fraction=held_out_fraction, seed=seed)
    standardizer = Standardizer.fit(train.features)
    return standardizer.transform(train), standardizer.transform(held_out), standardizer
