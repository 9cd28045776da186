"""What several kinds of statistic share to put units into cells: bin edges and their
labels, strata (the ``by`` features: a categorical feature's declared levels, a numeric
feature cut at its bins; the last stratifier varies fastest), and the outcome a unit
carries. Each unit lands in at most one slot (`count_cells` drops the slot -1: outside
the cohort, or excluded for a missing value)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.core.errors import ValidationError
from common.releases.analytics.statistic import StatisticSpec
from common.releases.analytics.units import Units
from common.study import Study, class_index


def bin_labels(edges: Sequence[float], *, closed_last: bool = True) -> list[str]:
    """``[a, b)`` per bin, the last ``[a, b]`` when `closed_last`."""
    k = len(edges) - 1
    return [f"[{edges[i]:g}, {edges[i + 1]:g}{']' if closed_last and i == k - 1 else ')'}"
            for i in range(k)]


def strata_labels(spec: StatisticSpec, study: Study) -> list[str]:
    """Labels of a statistic's strata, in cell order (the last stratifier varies
    fastest); one empty label without strata."""
    labels = [""]
    for stratum in spec.by:
        feature = study.feature(stratum.feature)
        values = (bin_labels(stratum.bins) if stratum.bins is not None
                  else list(feature.levels or ()))
        named = [f"{stratum.feature}={v}" for v in values]
        labels = [f"{a} & {b}" if a else b for a in labels for b in named]
    return labels


def cells_by_stratum(spec: StatisticSpec, study: Study, parts: Sequence[str]) -> tuple[str, ...]:
    """`parts` for every stratum in turn, each prefixed with its stratum's label."""
    cells: list[str] = []
    for stratum in strata_labels(spec, study):
        prefix = f"{stratum}: " if stratum else ""
        cells += [prefix + part for part in parts]
    return tuple(cells)


def outcome_index(spec: StatisticSpec, study: Study) -> int:
    """The class index of a statistic's outcome (default: the binary study's positive
    class)."""
    if spec.outcome is None:
        if study.study.task != "binary":
            raise ValidationError(
                f"statistic {spec.name!r}: a multiclass study needs outcome = CLASS")
        return 1
    index = class_index(study, str(spec.outcome))
    if index is None:
        raise ValidationError(
            f"statistic {spec.name!r}: outcome {spec.outcome!r} is not one of the study's "
            f"classes {list(study.study.classes)}")
    return index


def bin_index(values: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Bin of each value over `edges`, values outside falling into the end bins; -1 for
    NaN."""
    inner = np.asarray(edges[1:-1], dtype=np.float64)
    index = np.searchsorted(inner, np.nan_to_num(values), side="right").astype(np.int64)
    out: np.ndarray = np.where(np.isnan(values), -1, index)
    return out


def strata_index(spec: StatisticSpec, study: Study, units: Units) -> tuple[np.ndarray, int]:
    """Each unit's stratum (-1: a stratum value is missing) and the number of strata."""
    index = np.zeros(units.count, dtype=np.int64)
    missing = np.zeros(units.count, dtype=bool)
    total = 1
    for stratum in spec.by:
        if stratum.bins is not None:
            part = bin_index(units.numeric[stratum.feature], stratum.bins)
            size = len(stratum.bins) - 1
        else:
            part = units.categorical[stratum.feature]
            size = len(study.feature(stratum.feature).levels or ())
        missing |= part < 0
        index = index * size + np.maximum(part, 0)
        total *= size
    return np.where(missing, -1, index), total


def has_outcome(spec: StatisticSpec, study: Study, units: Units) -> np.ndarray:
    """Whether each unit has the statistic's outcome (any of its records)."""
    if units.labels is None:
        raise ValidationError(
            f"statistic {spec.name!r} needs the outcome: the file has no label column "
            f"{study.data.label_column!r}")
    out: np.ndarray = (units.labels >> outcome_index(spec, study)) & 1 == 1
    return out


def count_cells(slot: np.ndarray, length: int) -> np.ndarray:
    """How many units are in each of `length` slots (a slot of -1 counts nowhere)."""
    return np.bincount(slot[slot >= 0], minlength=length).astype(np.int64)
