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

Kinds: each is one module of ``common/releases/analytics/statistics/`` (``count``,
``rate`` (outcome by strata), ``mean`` (sum and mean of a numeric feature clipped to
``range`` in steps of ``resolution``, optionally by strata), ``histogram`` (numeric
``bins`` or a categorical feature's levels), ``kaplan_meier`` (time feature ``feature``,
time ``grid``, event = the outcome)); a statistic's fields and the protocol of its kind
are `common.releases.analytics.statistic`. See docs/analytics.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import Field, field_validator, model_validator

from common.core.errors import ValidationError
from common.core.parsing import parse_json, parse_toml
from common.releases.analytics.statistic import (
    Section,
    StatisticSpec,
    StudyCheck,
    check_range,
    kind_of,
    statistic_length,
)
from common.study import NAME_PATTERN, Study, study_sha256
from common.study.schema import FeatureName

QUERY_FORMAT: Literal[1] = 1
MAX_STATISTICS = 64
MAX_CELLS = 100_000
"""Entries of one query's whole vector (every statistic's cells together)."""
MAX_QUERY_BYTES = 1 << 20


class CohortCondition(Section):
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
        return check_range(value)

    @model_validator(mode="after")
    def _one(self) -> CohortCondition:
        if (self.range is None) == (self.levels is None):
            raise ValueError("a cohort condition needs exactly one of range (numeric) or "
                             "levels (categorical)")
        if self.levels is not None and not self.levels:
            raise ValueError("levels must name at least one declared level")
        return self


class Query(Section):
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
        their composition, `common.releases.analytics.cost.ledger_epsilon`)."""
        return float(math.fsum(s.epsilon for s in self.statistics))

    def statistic(self, name: str) -> StatisticSpec:
        for spec in self.statistics:
            if spec.name == name:
                return spec
        raise ValidationError(f"query {self.name!r} has no statistic named {name!r}")


# --------------------------------------------------------------------------- against a study


def _fail(field: str, message: str, *, source: str) -> ValidationError:
    return ValidationError(f"{source}: {field}: {message}")


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
    for i, condition in enumerate(query.cohort):
        check = StudyCheck(study, f"cohort[{i}]", source)
        spec = check.feature("feature", condition.feature)
        if spec.type == "numeric" and condition.range is None:
            raise check.fail("levels", f"levels apply to categorical features; numeric "
                             f"feature {spec.name!r} is filtered by range = [low, high]")
        if spec.type == "categorical":
            if condition.levels is None:
                raise check.fail("range", f"range applies to numeric features; "
                                 f"categorical feature {spec.name!r} is filtered by "
                                 "levels = [...]")
            unknown = [lv for lv in condition.levels if lv not in (spec.levels or ())]
            if unknown:
                raise check.fail("levels", f"{unknown} are not declared levels of "
                                 f"{spec.name!r} ({list(spec.levels or ())})")
    total = 0
    for i, stat in enumerate(query.statistics):
        check = StudyCheck(study, f"statistics[{i}]", source)
        for j, stratum in enumerate(stat.by):
            spec = check.feature(f"by[{j}].feature", stratum.feature)
            if spec.type == "numeric" and stratum.bins is None:
                raise check.fail(f"by[{j}].bins", f"numeric feature {spec.name!r} needs "
                                 "bins = [edges]")
            if spec.type == "categorical" and stratum.bins is not None:
                raise check.fail(f"by[{j}].bins", f"categorical feature {spec.name!r} is "
                                 "stratified by its declared levels (no bins)")
        kind_of(stat).check_against_study(stat, check)
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
