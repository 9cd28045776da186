"""A follow-up cohort for the analytics benchmarks and tests: the study (age, sex,
lactate with missing values, follow-up days, ward, died; patient-level), a query
touching every statistic kind, and one hospital's CSV export of it (1-2 rows per
patient, strings, blanks for missing values). One definition, so that what
`medfed bench query-coverage` measures is what tests/analytics checks."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.study import Study, study_from_mapping, study_sha256

SEXES = ("F", "M")
WARDS = ("icu", "general")
COLUMNS = ("MRN", "Age (years)", "Sex", "Lactate mmol/L", "Follow-up days", "Ward", "Died")


def followup_mapping(name: str = "followup") -> dict[str, Any]:
    """The study file's contents (as `study_from_mapping` reads them)."""
    return {
        "study": {"name": name, "rounds": 1, "classes": ["alive", "dead"]},
        "data": {"label_column": "Died", "patient_column": "MRN"},
        "features": [
            {"name": "Age (years)", "type": "numeric", "range": [18, 100]},
            {"name": "Sex", "type": "categorical", "levels": list(SEXES)},
            {"name": "Lactate mmol/L", "missing": "impute"},
            {"name": "Follow-up days", "type": "numeric", "range": [0, 400],
             "missing": "impute"},
            {"name": "Ward", "type": "categorical", "levels": list(WARDS),
             "missing": "impute"},
        ],
        "privacy": {"unit": "patient", "epsilon": 4.0, "delta": 1e-5},
    }


def followup_study(name: str = "followup", *, source: str = "bench") -> Study:
    return study_from_mapping(followup_mapping(name), source=source)


def every_kind_query_toml(study: Study, *, epsilon: float, name: str = "every-kind",
                          grid: Sequence[float] = (0, 30, 60)) -> str:
    """A query over patients aged 40 and over: a count, the death rate by sex, the mean
    age, the ward histogram and a Kaplan-Meier curve on `grid` (days), each at
    `epsilon`."""
    days = ", ".join(f"{g:g}" for g in grid)
    return f"""
name = "{name}"
study_sha256 = "{study_sha256(study)}"

[[cohort]]
feature = "Age (years)"
range = [40, 100]

[[statistics]]
name = "patients"
kind = "count"
epsilon = {epsilon}

[[statistics]]
name = "mortality"
kind = "rate"
epsilon = {epsilon}
[[statistics.by]]
feature = "Sex"

[[statistics]]
name = "age"
kind = "mean"
feature = "Age (years)"
range = [0, 100]
resolution = 1
epsilon = {epsilon}

[[statistics]]
name = "wards"
kind = "histogram"
feature = "Ward"
epsilon = {epsilon}

[[statistics]]
name = "survival"
kind = "kaplan_meier"
feature = "Follow-up days"
grid = [{days}]
epsilon = {epsilon}
"""


def write_followup_csv(path: Path, rng: np.random.Generator, *, patients: int, prefix: str,
                       hazard: float) -> None:
    """One hospital's export: 1-2 rows per patient, strings, blanks for missing values;
    death within the follow-up with the given daily `hazard`."""
    with path.open("w", newline="") as handle:
        out = csv.writer(handle)
        out.writerow(COLUMNS)
        for p in range(patients):
            age = int(rng.integers(18, 101))
            sex = SEXES[int(rng.integers(0, 2))]
            days = float(rng.exponential(90.0))
            dead = rng.random() < 1 - math.exp(-days * hazard)
            for _ in range(int(rng.integers(1, 3))):
                ward = "" if rng.random() < 0.1 else WARDS[int(rng.integers(0, 2))]
                time = "" if rng.random() < 0.05 else f"{days:.1f}"
                lactate = "" if rng.random() < 0.1 else f"{rng.gamma(2.0, 1.0):.2f}"
                out.writerow([f"{prefix}{p:05d}", age, sex, lactate, time, ward,
                              "dead" if dead else "alive"])
