"""What a statistic of a query is (``[[statistics]]``), and the one protocol every kind of
statistic implements.

A statistic's fields are one format for every kind (`StatisticSpec`: its name, kind and
epsilon, and the optional fields a kind takes: strata ``by``, ``outcome``, ``feature``,
``range``, ``resolution``, ``bins``, ``grid``), so a query's canonical bytes and their
SHA-256 do not depend on which kinds exist. What a kind does with them is a
`StatisticKind`: which fields it takes, what the study must declare for it, its cells,
its sensitivity, how a site counts its units into them, and how the noisy sum reads as
estimates with intervals, for the approval screen and the plots too.

Each kind is one module of ``common/releases/analytics/statistics/`` that calls
`register_statistic` when imported; `load_statistics` imports every module of that
folder (found by file name, as `common.models.registry` finds networks), so a new kind
is one file there and the ``kind`` a query names is checked against what registered.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.core.errors import ValidationError
from common.core.plugins import PluginFolder
from common.releases.analytics.estimates import Estimate
from common.releases.analytics.units import Units
from common.study import FeatureSpec, Study, check_name
from common.study.schema import FeatureName

STATISTICS_PACKAGE: Final = "common.releases.analytics.statistics"
"""The package whose every module registers one kind of statistic (`load_statistics`)."""
STATISTIC_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
MAX_EDGES = 1001
"""Bin edges or time-grid points a statistic may declare (1000 bins / intervals)."""
OPTIONAL_FIELDS: Final = ("by", "outcome", "feature", "range", "resolution", "bins", "grid")
"""The fields of `StatisticSpec` a kind takes or leaves absent (`StatisticKind.options`)."""
MISSING_CELL: Final = "missing"
"""Every statistic's last cell: the units it excludes for a missing value."""


class Section(BaseModel):
    """A table of a query file: unknown keys refused, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def check_edges(value: tuple[float, ...] | None, *, what: str) -> tuple[float, ...] | None:
    """Bin edges or a time grid: 2 to `MAX_EDGES` finite, strictly increasing values."""
    if value is None:
        return None
    if not 2 <= len(value) <= MAX_EDGES:
        raise ValueError(f"{what} must hold 2 to {MAX_EDGES} values")
    if not all(math.isfinite(v) for v in value):
        raise ValueError(f"{what} must be finite numbers")
    if any(b <= a for a, b in itertools.pairwise(value)):
        raise ValueError(f"{what} must be strictly increasing")
    return value


def check_range(value: tuple[float, float] | None) -> tuple[float, float] | None:
    """``[low, high]`` with finite low < high."""
    if value is not None:
        low, high = value
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError("range must be [low, high] with finite low < high")
    return value


class Stratum(Section):
    """``[[statistics.by]]``: one stratifying feature: a categorical feature's declared
    levels, or a numeric feature cut at ``bins`` (edges; values outside fall into the
    end bins)."""

    feature: FeatureName
    bins: tuple[float, ...] | None = None

    @field_validator("bins")
    @classmethod
    def _bins(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return check_edges(value, what="bins")


class StatisticSpec(Section):
    """``[[statistics]]``: one statistic and its epsilon; `kind` names a registered
    `StatisticKind`, which says which of the optional fields apply."""

    name: str = Field(pattern=STATISTIC_NAME_PATTERN)
    kind: str
    epsilon: float = Field(gt=0, le=100)
    by: tuple[Stratum, ...] = ()
    outcome: int | str | None = None
    feature: FeatureName | None = None
    range: tuple[float, float] | None = None
    resolution: float | None = Field(default=None, gt=0)
    bins: tuple[float, ...] | None = None
    grid: tuple[float, ...] | None = None

    @field_validator("kind")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in load_statistics():
            raise ValueError(f"{value[:64]!r} is not a kind of statistic; known: "
                             + ", ".join(load_statistics()))
        return value

    @field_validator("outcome")
    @classmethod
    def _outcome(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, bool):
            raise ValueError("outcome is a class label as the study writes it, not a boolean")
        if isinstance(value, str):
            check_name(value, what="outcome")
        return value

    @field_validator("range")
    @classmethod
    def _finite(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        return check_range(value)

    @field_validator("bins")
    @classmethod
    def _bins(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return check_edges(value, what="bins")

    @field_validator("grid")
    @classmethod
    def _grid(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return check_edges(value, what="grid")

    @model_validator(mode="after")
    def _kind_fields(self) -> StatisticSpec:
        kind = statistic_kind(self.kind)
        for name in OPTIONAL_FIELDS:
            value = getattr(self, name)
            present = value != () if name == "by" else value is not None
            if present and name not in kind.options:
                raise ValueError(f"{name} does not apply to kind = {self.kind!r}")
        kind.check_fields(self)
        return self


def require_feature(spec: StatisticSpec) -> None:
    """ValueError unless the statistic names its feature (a kind's `check_fields`)."""
    if spec.feature is None:
        raise ValueError(f"kind = {spec.kind!r} needs feature = \"COLUMN\"")


@dataclass(frozen=True)
class StudyCheck:
    """One statistic (or cohort condition) checked against the study: its errors name
    the file (`source`) and the field (`field`, e.g. ``statistics[2]``)."""

    study: Study
    field: str
    source: str

    def fail(self, part: str, message: str) -> ValidationError:
        """The error of field `part` of this one (``statistics[2].bins: ...``)."""
        return ValidationError(f"{self.source}: {self.field}.{part}: {message}")

    def feature(self, part: str, name: str, kind: str | None = None) -> FeatureSpec:
        """The declared feature `name` (of type `kind` when given), named in field
        `part`; refused when the study declares no such feature."""
        for spec in self.study.features:
            if spec.name == name:
                if kind is not None and spec.type != kind:
                    raise self.fail(part, f"feature {name!r} is {spec.type}; this needs a "
                                    f"{kind} one")
                return spec
        raise self.fail(part, f"{name!r} is not a feature the study declares "
                        f"({sorted(f.name for f in self.study.features)})")


@dataclass(frozen=True)
class Reading:
    """What a statistic's noisy sum reads as: its estimates, notes for the operator, and
    the time grid of a curve (for its plot; empty otherwise)."""

    estimates: list[Estimate]
    notes: list[str] = field(default_factory=list)
    grid: tuple[float, ...] = ()


class StatisticKind(ABC):
    """One kind of statistic (``kind = "NAME"``). A site puts each unit inside the cohort
    in at most one slot of the statistic's cells (`count`), which bounds one unit's
    contribution by `sensitivity`; the units it cannot place for a missing value go to
    the last cell, ``missing``, added here for every kind. The coordinator reads the
    noisy sum of every site's cells (`answer`)."""

    name: ClassVar[str]
    options: ClassVar[frozenset[str]] = frozenset()
    """Which of `OPTIONAL_FIELDS` it takes; the others must be absent."""
    plots: ClassVar[bool] = False
    """Whether `plot` draws its answer (a PNG per statistic)."""

    def check_fields(self, spec: StatisticSpec) -> None:
        """The fields it needs, read without the study: ValueError with the message the
        query's author reads (`require_feature`). Nothing by default."""
        del spec

    def check_against_study(self, spec: StatisticSpec, check: StudyCheck) -> None:
        """What the study must declare for it (its strata are checked for every kind):
        raise `check.fail(...)`, or use `check.feature(...)`. Nothing by default."""
        del spec, check

    @abstractmethod
    def cells(self, spec: StatisticSpec, study: Study) -> tuple[str, ...]:
        """Labels of its cells in order, the ``missing`` cell excluded."""

    def sensitivity(self, spec: StatisticSpec, study: Study) -> tuple[float, float]:
        """(L1, L2) of its block when one unit is added or removed: by default a unit
        adds 1 to one cell (the missing cell included)."""
        del spec, study
        return 1.0, 1.0

    def missing_scale(self, spec: StatisticSpec, study: Study) -> int:
        """What one unit excluded for a missing value adds to the ``missing`` cell (1 by
        default), so that the cell moves by no more than `sensitivity` allows."""
        del spec, study
        return 1

    @abstractmethod
    def count(self, spec: StatisticSpec, study: Study, units: Units, *,
              inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This site's exact int64 counts of its `cells` over the units `inside` the
        cohort, and which of those units it excludes for a missing value of a feature
        it reads (a stratum, its own feature)."""

    @abstractmethod
    def answer(self, spec: StatisticSpec, study: Study, sums: np.ndarray, *, sigma: float,
               level: float, rng: np.random.Generator) -> Reading:
        """Its cells' noisy secure sum (`sums`, the ``missing`` cell excluded) read as
        estimates with intervals at `level`, `sigma` the noise std on each cell; `rng`
        for a bootstrap, seeded from the query and the sum."""

    def describe(self, spec: StatisticSpec, study: Study) -> str:
        """One line of the approval screen (`medfed site approve`): its kind, feature,
        strata, epsilon, number of cells and the other fields it was given."""
        cells = statistic_cells(spec, study)
        extra = spec.model_dump(exclude_none=True, exclude={"name", "kind", "epsilon", "by"})
        by = ", ".join(s.feature for s in spec.by)
        return (f"{spec.name}: {spec.kind}"
                + (f" of {extra.pop('feature')}" if "feature" in extra else "")
                + (f" by {by}" if by else "")
                + f", epsilon {spec.epsilon:g}, {len(cells)} cells"
                + "".join(f", {k} {v}" for k, v in sorted(extra.items())))

    def plot(self, estimates: Sequence[Estimate], axes: Any, *, grid: tuple[float, ...],
             level: float) -> None:
        """Draw its answer on matplotlib `axes` (only where `plots`)."""
        del estimates, axes, grid, level


STATISTIC_KINDS: Final[dict[str, StatisticKind]] = {}


def register_statistic(kind: StatisticKind) -> StatisticKind:
    """Add a kind of statistic (idempotent for one of the same class); a second kind of
    the same name, or one taking a field `StatisticSpec` does not have, is refused. The
    plug-ins are loaded first, so a clash with one of them is refused whichever came
    first."""
    _PLUGIN_FOLDER.load()
    existing = STATISTIC_KINDS.get(kind.name)
    if existing is not None and type(existing) is not type(kind):
        raise ValidationError(f"statistic kind {kind.name!r} registered twice, differently")
    unknown = sorted(kind.options - set(OPTIONAL_FIELDS))
    if unknown:
        raise ValidationError(f"statistic kind {kind.name!r} takes fields a query cannot "
                              f"write: {unknown}")
    STATISTIC_KINDS[kind.name] = kind
    return kind


_PLUGIN_FOLDER: Final = PluginFolder(STATISTICS_PACKAGE, Path(__file__).parent / "statistics")


def load_statistics() -> tuple[str, ...]:
    """The registered kinds' names, sorted, after importing every module of
    `STATISTICS_PACKAGE` (names starting with ``_`` are helpers) once per process."""
    _PLUGIN_FOLDER.load()
    return tuple(sorted(STATISTIC_KINDS))


def statistic_kind(name: str) -> StatisticKind:
    """The registered kind `name` (ValidationError when there is none)."""
    if name not in STATISTIC_KINDS:
        load_statistics()
    kind = STATISTIC_KINDS.get(name)
    if kind is None:
        raise ValidationError(f"no kind of statistic named {name!r} is registered")
    return kind


def kind_of(spec: StatisticSpec) -> StatisticKind:
    return statistic_kind(spec.kind)


def statistic_cells(spec: StatisticSpec, study: Study) -> tuple[str, ...]:
    """Labels of a statistic's cells: its kind's, then ``missing``."""
    return (*kind_of(spec).cells(spec, study), MISSING_CELL)


def statistic_length(spec: StatisticSpec, study: Study) -> int:
    return len(statistic_cells(spec, study))
