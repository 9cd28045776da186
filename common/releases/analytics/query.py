"""The query file: a question asked of the pooled cohort, written against one study.

A query (``query.toml``) names the study it is written for (``study_sha256``: a site
refuses a query for another study), a cohort filter over the study's declared features
(numeric ranges, declared levels) and one or more statistics, each with its own
epsilon. Every feature it names is one the study declares; every bound, bin and time
grid is written in the file, so the vector a site computes has a length and a
per-patient sensitivity fixed by the file alone (`common.releases.analytics.vector`).

    name = "sepsis-rates"
    study_sha256 = "..."

    [[cohort]]
    feature = "age"
    range = [18, 90]          # numeric: low <= value <= high

    [[statistics]]
    name = "patients"
    kind = "count"
    epsilon = 0.2

    [[statistics]]
    name = "mortality"
    kind = "rate"             # the study's outcome (default: its positive class)
    epsilon = 0.3
    [[statistics.by]]
    feature = "sex"           # categorical: its declared levels
    [[statistics.by]]
    feature = "age"
    bins = [18, 40, 65, 90]   # numeric: declared bin edges

Kinds: ``count``, ``rate`` (outcome by strata), ``mean`` (sum and mean of a numeric
feature clipped to ``range`` in steps of ``resolution``, optionally by strata),
``histogram`` (numeric ``bins`` or a categorical feature's levels) and
``kaplan_meier`` (time feature ``feature``, time ``grid``, event = the outcome).
See docs/analytics.md.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.core.errors import ValidationError
from common.core.parsing import parse_json, parse_toml
from common.study import (
    NAME_PATTERN,
    Study,
    check_name,
    class_index,
    study_sha256,
)
from common.study.schema import FeatureName

QUERY_FORMAT: Literal[1] = 1
STATISTIC_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
MAX_STATISTICS = 64
MAX_EDGES = 1001
"""Bin edges or time-grid points a statistic may declare (1000 bins / intervals)."""
MAX_CELLS = 100_000
"""Entries of one query's whole vector (every statistic's cells together)."""
MAX_STEPS = 10_000
"""Most quantisation steps of a clipped sum ((high - low) / resolution): each patient's
value is at most this many integer units, so the summed vector stays far inside the
signed 32-bit ring of the masked vector."""
MAX_QUERY_BYTES = 1 << 20

StatisticKind = Literal["count", "rate", "mean", "histogram", "kaplan_meier"]
KINDS: tuple[str, ...] = ("count", "rate", "mean", "histogram", "kaplan_meier")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _edges(value: tuple[float, ...] | None, *, what: str) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not 2 <= len(value) <= MAX_EDGES:
        raise ValueError(f"{what} must hold 2 to {MAX_EDGES} values")
    if not all(math.isfinite(v) for v in value):
        raise ValueError(f"{what} must be finite numbers")
    if any(b <= a for a, b in itertools.pairwise(value)):
        raise ValueError(f"{what} must be strictly increasing")
    return value


def _range(value: tuple[float, float] | None) -> tuple[float, float] | None:
    if value is not None:
        low, high = value
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError("range must be [low, high] with finite low < high")
    return value


class CohortCondition(_Section):
    """``[[cohort]]``: one condition of the filter (all must hold). Numeric features:
    ``range = [low, high]`` (both inclusive); categorical: ``levels = [...]`` (declared
    levels). A patient whose value of a filter feature is missing, and who passes every
    condition whose value is known, is counted as excluded for a missing value."""

    feature: FeatureName
    range: tuple[float, float] | None = None
    levels: tuple[str, ...] | None = None

    @field_validator("range")
    @classmethod
    def _finite(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        return _range(value)

    @model_validator(mode="after")
    def _one(self) -> CohortCondition:
        if (self.range is None) == (self.levels is None):
            raise ValueError("a cohort condition needs exactly one of range (numeric) or "
                             "levels (categorical)")
        if self.levels is not None and not self.levels:
            raise ValueError("levels must name at least one declared level")
        return self


class Stratum(_Section):
    """``[[statistics.by]]``: one stratifying feature: a categorical feature's declared
    levels, or a numeric feature cut at ``bins`` (edges; values outside fall into the
    end bins)."""

    feature: FeatureName
    bins: tuple[float, ...] | None = None

    @field_validator("bins")
    @classmethod
    def _bins(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return _edges(value, what="bins")


# Which optional fields each kind takes (the rest must be absent).
_FIELDS: dict[str, frozenset[str]] = {
    "count": frozenset(),
    "rate": frozenset({"by", "outcome"}),
    "mean": frozenset({"by", "feature", "range", "resolution"}),
    "histogram": frozenset({"feature", "bins"}),
    "kaplan_meier": frozenset({"feature", "grid", "outcome"}),
}
_OPTIONAL = ("by", "outcome", "feature", "range", "resolution", "bins", "grid")


class StatisticSpec(_Section):
    """``[[statistics]]``: one statistic and its epsilon (module docstring)."""

    name: str = Field(pattern=STATISTIC_NAME_PATTERN)
    kind: StatisticKind
    epsilon: float = Field(gt=0, le=100)
    by: tuple[Stratum, ...] = ()
    outcome: int | str | None = None
    feature: FeatureName | None = None
    range: tuple[float, float] | None = None
    resolution: float | None = Field(default=None, gt=0)
    bins: tuple[float, ...] | None = None
    grid: tuple[float, ...] | None = None

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
        return _range(value)

    @field_validator("bins")
    @classmethod
    def _bins(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return _edges(value, what="bins")

    @field_validator("grid")
    @classmethod
    def _grid(cls, value: tuple[float, ...] | None) -> tuple[float, ...] | None:
        return _edges(value, what="grid")

    @model_validator(mode="after")
    def _kind_fields(self) -> StatisticSpec:
        allowed = _FIELDS[self.kind]
        for field in _OPTIONAL:
            value = getattr(self, field)
            present = value != () if field == "by" else value is not None
            if present and field not in allowed:
                raise ValueError(f"{field} does not apply to kind = {self.kind!r}")
        if self.kind in ("mean", "histogram", "kaplan_meier") and self.feature is None:
            raise ValueError(f"kind = {self.kind!r} needs feature = \"COLUMN\"")
        if self.kind == "kaplan_meier" and self.grid is None:
            raise ValueError("kind = 'kaplan_meier' needs grid = [t0, t1, ...] (the time grid)")
        return self


class Query(_Section):
    """A whole query file. `epsilon` is the sum of its statistics' epsilons: what it
    costs at most on a site's ledger (each statistic is one distributed discrete
    Gaussian release; composed in zCDP the total is usually lower)."""

    format: Literal[1] = QUERY_FORMAT
    name: str = Field(pattern=NAME_PATTERN)
    study_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    description: str = Field(default="", max_length=500)
    cohort: tuple[CohortCondition, ...] = ()
    statistics: tuple[StatisticSpec, ...] = Field(min_length=1, max_length=MAX_STATISTICS)

    @field_validator("description")
    @classmethod
    def _printable(cls, value: str) -> str:
        if value and not value.isprintable():
            raise ValueError("description must be printable text on one line")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> Query:
        names = [s.name for s in self.statistics]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"statistic names must be distinct; repeated: {repeated}")
        return self

    @property
    def epsilon(self) -> float:
        """The query's total epsilon: the sum of its statistics' (an upper bound on
        their composition, `common.releases.analytics.vector.query_epsilon`)."""
        return float(math.fsum(s.epsilon for s in self.statistics))

    def statistic(self, name: str) -> StatisticSpec:
        for spec in self.statistics:
            if spec.name == name:
                return spec
        raise ValidationError(f"query {self.name!r} has no statistic named {name!r}")


# --------------------------------------------------------------------------- against a study


def _fail(field: str, message: str, *, source: str) -> ValidationError:
    return ValidationError(f"{source}: {field}: {message}")


def outcome_index(spec: StatisticSpec, study: Study) -> int:
    """The class index of a rate's or survival curve's outcome (default: the binary
    study's positive class)."""
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


def steps(spec: StatisticSpec, study: Study) -> int:
    """K = (high - low) / resolution of a mean: each patient's clipped value is an
    integer in 0..K."""
    low, high = value_range(spec, study)
    resolution = spec.resolution if spec.resolution is not None else (high - low) / 1000
    ratio = (high - low) / resolution
    k = round(ratio)
    if k < 1 or abs(ratio - k) > 1e-6 * max(k, 1):
        raise ValidationError(
            f"statistic {spec.name!r}: (high - low) / resolution = {ratio:g} must be a whole "
            "number of steps")
    if k > MAX_STEPS:
        raise ValidationError(
            f"statistic {spec.name!r}: {k} steps of resolution; at most {MAX_STEPS}")
    return k


def value_range(spec: StatisticSpec, study: Study) -> tuple[float, float]:
    """The clip bounds of a mean: the statistic's ``range``, else the study's declared
    range of the feature."""
    if spec.range is not None:
        return spec.range
    feature = study.feature(spec.feature or "")
    if feature.range == "auto":
        raise ValidationError(
            f"statistic {spec.name!r}: feature {feature.name!r} has range = \"auto\" in the "
            "study; declare range = [low, high] in the query")
    return feature.range


# --------------------------------------------------------------------------- cells


def _bin_labels(edges: Sequence[float], *, closed_last: bool = True) -> list[str]:
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
        values = (_bin_labels(stratum.bins) if stratum.bins is not None
                  else list(feature.levels or ()))
        named = [f"{stratum.feature}={v}" for v in values]
        labels = [f"{a} & {b}" if a else b for a in labels for b in named]
    return labels


def statistic_cells(spec: StatisticSpec, study: Study) -> tuple[str, ...]:
    """Labels of a statistic's cells (module docstring's table)."""
    if spec.kind == "count":
        return ("cohort", "missing")
    if spec.kind in ("rate", "mean"):
        parts = (("with outcome", "without outcome") if spec.kind == "rate"
                 else ("sum", "complement"))
        cells = []
        for stratum in strata_labels(spec, study):
            prefix = f"{stratum}: " if stratum else ""
            cells += [prefix + part for part in parts]
        return (*cells, "missing")
    if spec.kind == "histogram":
        feature = study.feature(spec.feature or "")
        bins = (_bin_labels(spec.bins) if spec.bins is not None
                else list(feature.levels or ()))
        return (*bins, "missing")
    grid = spec.grid or ()
    cells = []
    for label in _bin_labels(grid, closed_last=False):
        cells += [f"{label}: events", f"{label}: censored"]
    return (*cells, f">= {grid[-1]:g}", "missing")


def statistic_length(spec: StatisticSpec, study: Study) -> int:
    return len(statistic_cells(spec, study))


def check_query_against_study(query: Query, study: Study, *, source: str = "query") -> None:
    """Refuse a query that is not for `study` or names what the study does not declare;
    the error names `source` and the field."""
    if query.study_sha256 != study_sha256(study):
        raise _fail("study_sha256", "the query is written for another study (sha256 "
                    f"{query.study_sha256[:12]}..., this study is {study_sha256(study)[:12]}...)",
                    source=source)
    if study.data.kind != "table":
        raise _fail("study_sha256", "queries apply to table studies only", source=source)
    if study.privacy.unit == "hospital":
        raise _fail("study_sha256", "the study's privacy.unit is 'hospital': queries bound "
                    "one patient's contribution, not a hospital's", source=source)
    features = {f.name: f for f in study.features}

    def feature(field: str, name: str, kind: str | None = None) -> Any:
        spec = features.get(name)
        if spec is None:
            raise _fail(field, f"{name!r} is not a feature the study declares "
                        f"({sorted(features)})", source=source)
        if kind is not None and spec.type != kind:
            raise _fail(field, f"feature {name!r} is {spec.type}; this needs a {kind} one",
                        source=source)
        return spec

    for i, condition in enumerate(query.cohort):
        field = f"cohort[{i}]"
        spec = feature(f"{field}.feature", condition.feature)
        if spec.type == "numeric" and condition.range is None:
            raise _fail(f"{field}.levels", f"levels apply to categorical features; numeric "
                        f"feature {spec.name!r} is filtered by range = [low, high]",
                        source=source)
        if spec.type == "categorical":
            if condition.levels is None:
                raise _fail(f"{field}.range", f"range applies to numeric features; "
                            f"categorical feature {spec.name!r} is filtered by levels = [...]",
                            source=source)
            unknown = [lv for lv in condition.levels if lv not in (spec.levels or ())]
            if unknown:
                raise _fail(f"{field}.levels", f"{unknown} are not declared levels of "
                            f"{spec.name!r} ({list(spec.levels or ())})", source=source)
    total = 0
    for i, stat in enumerate(query.statistics):
        field = f"statistics[{i}]"
        for j, stratum in enumerate(stat.by):
            spec = feature(f"{field}.by[{j}].feature", stratum.feature)
            if spec.type == "numeric" and stratum.bins is None:
                raise _fail(f"{field}.by[{j}].bins", f"numeric feature {spec.name!r} needs "
                            "bins = [edges]", source=source)
            if spec.type == "categorical" and stratum.bins is not None:
                raise _fail(f"{field}.by[{j}].bins", f"categorical feature {spec.name!r} is "
                            "stratified by its declared levels (no bins)", source=source)
        if stat.kind in ("rate", "kaplan_meier"):
            try:
                outcome_index(stat, study)
            except ValidationError as exc:
                raise _fail(f"{field}.outcome", str(exc), source=source) from None
        if stat.kind == "mean":
            feature(f"{field}.feature", stat.feature or "", "numeric")
            try:
                value_range(stat, study)
            except ValidationError as exc:
                raise _fail(f"{field}.range", str(exc), source=source) from None
            try:
                steps(stat, study)
            except ValidationError as exc:
                raise _fail(f"{field}.resolution", str(exc), source=source) from None
        if stat.kind == "histogram":
            spec = feature(f"{field}.feature", stat.feature or "")
            if spec.type == "numeric" and stat.bins is None:
                raise _fail(f"{field}.bins", f"numeric feature {spec.name!r} needs "
                            "bins = [edges]", source=source)
            if spec.type == "categorical" and stat.bins is not None:
                raise _fail(f"{field}.bins", f"categorical feature {spec.name!r} is "
                            "counted by its declared levels (no bins)", source=source)
        if stat.kind == "kaplan_meier":
            feature(f"{field}.feature", stat.feature or "", "numeric")
        total += statistic_length(stat, study)
    if total > MAX_CELLS:
        raise _fail("statistics", f"{total} cells in all; at most {MAX_CELLS}", source=source)


# --------------------------------------------------------------------------- reading


def _field_of(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("function-"):
            out += ("." if out else "") + part
    return out or "query"


def query_from_mapping(data: Any, *, source: str = "query") -> Query:
    """Validate a parsed query; a problem is a `ValidationError` naming `source` and the
    field (``statistics[1].bins: ...``)."""
    if not isinstance(data, dict):
        raise ValidationError(f"{source}: a query is a table of keys")
    try:
        return Query.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = [
            f"{_field_of(tuple(err['loc']))}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
        ]
        raise ValidationError(f"{source}: " + "; ".join(problems)) from None


def load_query(path: str | Path, *, study: Study) -> Query:
    """Read ``query.toml`` and check it against `study`; every error is a
    `ValidationError` naming the file and the field."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValidationError(f"{path}: cannot read the query file: {exc.strerror}") from None
    if len(raw) > MAX_QUERY_BYTES:
        raise ValidationError(f"{path}: the query file is larger than {MAX_QUERY_BYTES} bytes")
    try:
        data = parse_toml(raw)
    except ValidationError as exc:
        raise ValidationError(f"{path}: not valid TOML: {exc}") from None
    query = query_from_mapping(data, source=str(path))
    check_query_against_study(query, study, source=str(path))
    return query


def query_bytes(query: Query) -> bytes:
    """Canonical encoding (JSON, sorted keys, no spaces): what the coordinator sends and
    every site approves by its digest."""
    return json.dumps(query.model_dump(mode="json"), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode("utf-8")


def query_sha256(query: Query) -> str:
    return hashlib.sha256(query_bytes(query)).hexdigest()


def query_from_bytes(data: bytes, *, study: Study, sha256: str | None = None) -> Query:
    """A query received from another party: canonical JSON (with `sha256`, exactly the
    bytes of that digest), written for `study`. Anything else is a `ValidationError`."""
    if len(data) > MAX_QUERY_BYTES:
        raise ValidationError("query is too large")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ValidationError("query bytes do not match the announced query sha256")
    try:
        parsed = parse_json(data)
    except ValidationError as exc:
        raise ValidationError(f"query is not UTF-8 JSON within limits ({exc})") from None
    query = query_from_mapping(parsed)
    if query_bytes(query) != data:
        raise ValidationError("query is not in canonical form")
    check_query_against_study(query, study)
    return query


# --------------------------------------------------------------------------- drafting


def _toml_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else "nan"
    return str(value)


def draft_query(study: Study, *, name: str, epsilon: float = 1.0) -> str:
    """A query file (TOML) for `study`, for ``medfed query init``: a count of the whole
    cohort, and where the study allows, the outcome's rate by the first categorical
    feature, the mean of the first numeric feature with a declared range and its
    histogram; a Kaplan-Meier curve commented out (it needs a time column and grid).
    `epsilon` is split evenly. It validates against `study` as written."""
    if study.data.kind != "table":
        raise ValidationError("queries apply to table studies only")
    categorical = [f for f in study.features if f.type == "categorical"]
    ranged = [f for f in study.features if f.type == "numeric" and f.range != "auto"]
    numeric = [f for f in study.features if f.type == "numeric"]
    stats: list[list[tuple[str, Any]]] = [[("name", "patients"), ("kind", "count")]]
    by: list[tuple[str, Any]] = []
    if study.study.task == "binary":
        rate: list[tuple[str, Any]] = [("name", "outcome_rate"), ("kind", "rate")]
        if categorical:
            by = [("feature", categorical[0].name)]
        stats.append(rate)
    if ranged and ranged[0].range != "auto":
        low, high = ranged[0].range
        stats.append([("name", "mean_" + _safe(ranged[0].name)), ("kind", "mean"),
                      ("feature", ranged[0].name), ("range", [low, high]),
                      ("resolution", (high - low) / 1000)])
        edges = [low + (high - low) * i / 10 for i in range(11)]
        stats.append([("name", "histogram_" + _safe(ranged[0].name)), ("kind", "histogram"),
                      ("feature", ranged[0].name), ("bins", edges)])
    each = epsilon / len(stats)
    lines = [
        "# A medfed query: a question asked of the pooled cohort (docs/analytics.md).",
        "# Every site checks it with `medfed query check` and approves its digest; each",
        "# statistic costs its epsilon on every participating site's ledger.",
        f"name = {_toml_value(name)}",
        f"study_sha256 = {_toml_value(study_sha256(study))}",
        "",
        "# The cohort filter (all conditions hold): numeric range = [low, high] (inclusive),",
        "# categorical levels = [...]. None: every patient.",
    ]
    if categorical:
        spec = categorical[0]
        lines += ["# [[cohort]]", f"# feature = {_toml_value(spec.name)}",
                  f"# levels = {_toml_value(list(spec.levels or ())[:1])}"]
    elif numeric:
        lines += ["# [[cohort]]", f"# feature = {_toml_value(numeric[0].name)}",
                  "# range = [0, 100]"]
    for stat in stats:
        lines += ["", "[[statistics]]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in stat]
        lines.append(f"epsilon = {_toml_value(round(each, 6))}")
        if stat[1][1] == "rate" and by:
            lines += ["[[statistics.by]]"] + [f"{k} = {_toml_value(v)}" for k, v in by]
    time = numeric[0].name if numeric else "time"
    lines += [
        "",
        "# A Kaplan-Meier curve of the outcome: a numeric time column and the time grid",
        "# (intervals [t0, t1), [t1, t2), ...):",
        "# [[statistics]]",
        "# name = \"survival\"",
        "# kind = \"kaplan_meier\"",
        f"# feature = {_toml_value(time)}",
        "# grid = [0, 30, 60, 90, 180, 365]",
        "# epsilon = 0.25",
    ]
    text = "\n".join(lines) + "\n"
    query = query_from_mapping(parse_toml(text), source="draft")
    check_query_against_study(query, study, source="draft")
    return text


def _safe(name: str) -> str:
    out = "".join(c if c.isascii() and (c.isalnum() or c in "_-") else "_" for c in name)
    return out[:40] or "feature"
