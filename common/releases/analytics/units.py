"""A site's table as a query reads it: one value per privacy unit.

Every privacy unit (a patient; a record when the study has no patient column) is reduced
to one value per feature exactly as the study's statistics release does
(`common.releases.statistics.unit_values`: the mean of its numeric values, its most
frequent level) and to the set of classes its records carry (a unit has the outcome
when any of its records has the outcome class). Every statistic of a query reads these
values (`common.releases.analytics.statistic.StatisticKind.count`), so one unit lands in
at most one slot of each statistic's block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.core.errors import ValidationError
from common.releases.statistics import TableLike, unit_values
from common.study import Study

MAX_OUTCOME_CLASSES = 62
"""Classes a unit's outcome mask holds (one bit each in an int64)."""


@dataclass(frozen=True)
class Units:
    """A site's table reduced to one value per privacy unit (module docstring)."""

    count: int
    numeric: dict[str, np.ndarray]  # float64, NaN: missing
    categorical: dict[str, np.ndarray]  # level index, -1: missing
    labels: np.ndarray | None  # per unit: the set of classes seen, as a bit mask


def table_units(table: TableLike, study: Study) -> Units:
    """One value per unit of each feature (`common.releases.statistics.unit_values`) and
    the classes each unit's records carry."""
    count, numeric, categorical = unit_values(table, study)
    labels = getattr(table, "labels", None)
    masks = None
    if labels is not None:
        if len(study.study.classes) > MAX_OUTCOME_CLASSES:
            raise ValidationError(
                f"queries read outcomes of studies with at most {MAX_OUTCOME_CLASSES} classes")
        n = len(table)
        ids = table.patient_ids
        index = np.arange(n) if ids is None else np.unique(ids, return_inverse=True)[1].reshape(-1)
        masks = np.zeros(count, dtype=np.int64)
        np.bitwise_or.at(masks, index, np.left_shift(1, np.asarray(labels, dtype=np.int64)))
    return Units(count=count, numeric=numeric, categorical=categorical, labels=masks)


def value_missing(units: Units, name: str) -> np.ndarray:
    """Whether each unit's value of feature `name` is missing."""
    out: np.ndarray = (np.isnan(units.numeric[name]) if name in units.numeric
                       else units.categorical[name] < 0)
    return out
