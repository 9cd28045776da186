"""The study's global preprocessing statistics: what every site and `predict` apply
(means, scales, imputation values, clip ranges), produced by the federated DP statistics
release (`common.releases.statistics`) and checked against the study they were made for."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pydantic
from pydantic import Field, model_validator

from common.core.errors import ConfigError, ValidationError
from common.study.schema import Study, StudyModel, first_problem, study_sha256


class NumericStatistics(StudyModel):
    """Global preprocessing values of one numeric feature (from the federated DP release)."""

    mean: float
    scale: float = Field(gt=0)
    impute: float
    clip_low: float
    clip_high: float

    @model_validator(mode="after")
    def _finite(self) -> NumericStatistics:
        values = (self.mean, self.scale, self.impute, self.clip_low, self.clip_high)
        if not all(math.isfinite(v) for v in values):
            raise ValueError("statistics must be finite")
        if self.clip_low > self.clip_high:
            raise ValueError("clip_low must not exceed clip_high")
        return self


class CategoricalStatistics(StudyModel):
    impute: str | None = Field(default=None, description="level used for a missing value")


class GlobalStatistics(StudyModel):
    """Means, scales, imputation values and clip ranges every site and `predict` apply.

    Preprocessing requires this object: there is deliberately no local fallback that
    fits statistics on one site's data (that would leak noiselessly and make sites scale
    inputs differently). The integrator produces it from the federated DP statistics
    release; ``source`` says where it came from and travels in the model bundle.
    """

    study_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    source: str = Field(min_length=1, max_length=200)
    numeric: dict[str, NumericStatistics] = Field(default_factory=dict)
    categorical: dict[str, CategoricalStatistics] = Field(default_factory=dict)
    # Where the DP noise swamps a feature's released values (common.releases.statistics
    # `release_warnings`): shown by the coordinator and `medfed model show`.
    warnings: tuple[str, ...] = Field(default=(), max_length=200)


def check_statistics(study: Study, statistics: GlobalStatistics) -> None:
    """Refuse statistics made for another study or missing a feature's values."""
    if statistics.study_sha256 != study_sha256(study):
        raise ValidationError("statistics: study_sha256 does not match the study")
    numeric = {f.name: f for f in study.features if f.type == "numeric"}
    categorical = {f.name: f for f in study.features if f.type == "categorical"}
    if set(statistics.numeric) != set(numeric):
        raise ValidationError(
            f"statistics: numeric features {sorted(statistics.numeric)} != study's "
            f"{sorted(numeric)}"
        )
    if set(statistics.categorical) != set(categorical):
        raise ValidationError(
            f"statistics: categorical features {sorted(statistics.categorical)} != study's "
            f"{sorted(categorical)}"
        )
    for name, spec in numeric.items():
        values = statistics.numeric[name]
        if spec.range != "auto" and (values.clip_low, values.clip_high) != tuple(spec.range):
            raise ValidationError(f"statistics: clip range of {name!r} differs from the study")
        # The release decodes mean and imputation value inside the clip range; anything
        # else was not computed from it (a coordinator probing the site's encoding).
        for what, value in (("mean", values.mean), ("impute", values.impute)):
            if not values.clip_low <= value <= values.clip_high:
                raise ValidationError(
                    f"statistics: {what} of {name!r} ({value:g}) lies outside its clip range "
                    f"[{values.clip_low:g}, {values.clip_high:g}]"
                )
    for name, spec in categorical.items():
        level = statistics.categorical[name].impute
        if level is not None and level not in (spec.levels or ()):
            raise ValidationError(f"statistics: impute level of {name!r} is not declared")
        if spec.missing == "impute" and level is None:
            raise ValidationError(f"statistics: {name!r} has missing = 'impute' but no level")


def load_statistics(path: str | Path, study: Study) -> GlobalStatistics:
    """Read statistics (JSON) from an explicit file and check them against `study`."""
    path = Path(path)
    try:
        statistics = statistics_from_bytes(path.read_bytes())
    except OSError as exc:
        raise ConfigError("statistics", f"cannot read {path}: {exc.strerror}") from None
    except ValidationError as exc:
        raise ConfigError("statistics", f"{path}: {exc}") from None
    try:
        check_statistics(study, statistics)
    except ValidationError as exc:
        raise ConfigError("statistics", f"{path}: {exc}") from None
    return statistics


def statistics_from_bytes(data: bytes) -> GlobalStatistics:
    try:
        return GlobalStatistics.model_validate_json(data)
    except pydantic.ValidationError as exc:
        field, message = first_problem(exc)
        raise ValidationError(f"statistics: {field}: {message}") from None


def statistics_bytes(statistics: GlobalStatistics) -> bytes:
    """Canonical JSON; without warnings it is byte-identical to the format before them."""
    dumped = statistics.model_dump(mode="json")
    if not dumped.get("warnings"):
        dumped.pop("warnings", None)
    return json.dumps(dumped, sort_keys=True, separators=(",", ":")).encode("utf-8")
