"""The study: one definition of what a federation trains, checked by every site.

A study file (``study.toml``) names the features and their encodings, the label and
patient columns, the model, the training settings and the privacy *requests*. It holds
no operational settings (listen addresses, state folders, deadlines, databases): those
belong to each service's own config. This module is pure (no torch, no I/O beyond
reading the TOML file) so the coordinator, the site agent and the model bundle all
share it.

The coordinator sends `study_bytes` (canonical JSON) to every site at enrolment and
binds `study_sha256` into each round's announcement; a site checks its data against the
study and the study's privacy requests against its own policy (`check_study_against_policy`)
before it sends any key or update. The site's policy always wins.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from common.core.config import DEFAULT_COUNT_EPSILON, SITE_ID_PATTERN, ServerOptimizerName
from common.core.errors import ConfigError, ValidationError
from common.core.parsing import parse_json, parse_toml
from common.models import registry as models

STUDY_FORMAT: Literal[1] = 1
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# ``package.module:factory``: a callable returning an nn.Module, from installed packages.
FACTORY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
MISSING_SUFFIX = "__missing"
ClassLabel = int | str
PrivacyUnit = Literal["record", "patient", "hospital"]
# Stronger units protect more: a hospital-level guarantee covers all of its patients.
UNIT_STRENGTH: Mapping[str, int] = {"record": 0, "patient": 1, "hospital": 2}


class StudyModel(BaseModel):
    """Every study section: unknown fields refused, values frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


DEFAULT_EVALUATION_NOISE_STD = 10.0
"""A study's ``privacy.evaluation.noise_std`` when it names none (the sites' own setting
before the study decided it)."""

MAX_NAME_CHARS = 256
FORMULA_STARTS = ("=", "+", "-", "@")


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_name(value: str, *, what: str, formula_ok: bool = False) -> str:
    """A column name, class label or level as the study may hold it: 1 to MAX_NAME_CHARS
    characters, all printable (no control characters, no terminal escapes, no
    bidirectional overrides), and, unless `formula_ok`, not starting like a spreadsheet
    formula (=, +, -, @) unless it is a number ("-1"). Names such as "Age (years)",
    "sex.M", "Lactate mmol/L" or "time_to_event" pass. Raises ValueError (pydantic)."""
    if not 1 <= len(value) <= MAX_NAME_CHARS:
        raise ValueError(f"{what} must be 1 to {MAX_NAME_CHARS} characters")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(
            f"{what} {value!r} holds the non-printable character U+{ord(bad):04X} "
            "(control characters and terminal escapes are not allowed)"
        )
    if not formula_ok and value.startswith(FORMULA_STARTS) and not _number(value):
        raise ValueError(
            f"{what} {value!r} starts like a spreadsheet formula (=, +, -, @): rename it"
        )
    return value


def _feature_name(value: str) -> str:
    return check_name(value, what="feature name")


FeatureName = Annotated[str, AfterValidator(_feature_name)]
"""A declared feature's name (`check_name`), wherever a study or query names one."""


class StudySection(StudyModel):
    """``[study]``: what is predicted and for how long."""

    name: str = Field(pattern=NAME_PATTERN)
    format: Literal[1] = STUDY_FORMAT
    rounds: int = Field(ge=1, le=1_000_000)
    task: Literal["binary", "multiclass"] = "binary"
    classes: tuple[ClassLabel, ...] = Field(
        default=(0, 1),
        description="labels as written in the label column; for binary, the second is the "
        "positive class",
    )

    @field_validator("classes")
    @classmethod
    def _distinct_classes(cls, value: tuple[ClassLabel, ...]) -> tuple[ClassLabel, ...]:
        if any(isinstance(c, bool) for c in value):
            raise ValueError("class labels are integers or strings, not booleans")
        texts = [str(c).strip() for c in value]
        if any(not t for t in texts):
            raise ValueError("class labels must not be empty")
        for label in value:
            if isinstance(label, str):
                check_name(label, what="class label")
        if len(set(texts)) != len(texts):
            raise ValueError("class labels must be distinct")
        return value


class DataSection(StudyModel):
    """``[data]``: the shape of every site's file (the site's own path stays local)."""

    kind: Literal["table", "images"] = "table"
    label_column: str = Field(min_length=1)
    patient_column: str | None = Field(default=None, min_length=1)
    # Images: a labels CSV with one file name per row, resized to image_size.
    file_column: str | None = Field(default=None, min_length=1)
    image_size: tuple[int, int] | None = None
    channels: int | None = Field(default=None, ge=1, le=16)

    @field_validator("label_column", "patient_column", "file_column")
    @classmethod
    def _column_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, what="column name")

    @field_validator("image_size")
    @classmethod
    def _positive_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not all(1 <= d <= 8192 for d in value):
            raise ValueError("image_size must be two sizes in 1..8192")
        return value

    @model_validator(mode="after")
    def _kind_fields(self) -> DataSection:
        image_fields = (self.file_column, self.image_size, self.channels)
        if self.kind == "images" and any(f is None for f in image_fields):
            raise ValueError("data.kind = 'images' needs file_column, image_size and channels")
        if self.kind == "table" and any(f is not None for f in image_fields):
            raise ValueError("file_column, image_size and channels apply to images only")
        if self.patient_column is not None and self.patient_column == self.label_column:
            raise ValueError("patient_column and label_column must differ")
        return self


class FeatureSpec(StudyModel):
    """``[[features]]``: one input column, its encoding and its missing-value policy.

    ``missing``: ``error`` refuses the file, ``impute`` fills in the federated (DP) global
    value, ``indicator`` imputes and adds a 0/1 column saying the value was missing.
    ``range``: numeric values are clipped into it before standardising; ``auto`` means the
    range is estimated in the federated DP statistics release.
    """

    name: FeatureName = Field(min_length=1, max_length=256)
    type: Literal["numeric", "categorical"] = "numeric"
    levels: tuple[str, ...] | None = None
    missing: Literal["error", "impute", "indicator"] = "error"
    range: Literal["auto"] | tuple[float, float] = "auto"

    @field_validator("levels")
    @classmethod
    def _printable_levels(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for level in value or ():
            check_name(level, what="level", formula_ok=True)
        return value

    @model_validator(mode="after")
    def _type_fields(self) -> FeatureSpec:
        if self.type == "categorical":
            if not self.levels:
                raise ValueError(f"categorical feature {self.name!r} needs levels = [...]")
            stripped = [level.strip() for level in self.levels]
            if any(not level for level in stripped) or stripped != list(self.levels):
                raise ValueError("levels must be non-empty and without surrounding spaces")
            if len(set(self.levels)) != len(self.levels):
                raise ValueError(f"levels of {self.name!r} must be distinct")
            if self.range != "auto":
                raise ValueError("range applies to numeric features only")
        else:
            if self.levels is not None:
                raise ValueError(f"levels apply to categorical features only ({self.name!r})")
            if self.range != "auto":
                low, high = self.range
                if not (math.isfinite(low) and math.isfinite(high) and low < high):
                    raise ValueError("range must be [low, high] with finite low < high")
        return self


DEFAULT_MAX_ABS_WEIGHT = 1e6
"""The default public bound on every weight of a served global model (`[model]
max_abs_weight`). Trained clinical models hold weights within +-100: inputs are
standardised or scaled to [0, 1], each DP-SGD step moves a weight by at most the learning
rate times the clip norm plus noise, and a diverging run is visible in its loss long
before. 1e6 leaves four orders of magnitude. A model planted to overflow float32 (3.4e38)
on the records it targets needs far larger weights for the tabular models (the default
MLP's logits stay below about 1e24 at this bound): sites refuse a model beyond the bound
before training (`check_served_weights`), and the coordinator never serves one."""
MAX_ABS_WEIGHT_LIMIT = 1e38
"""The largest bound a study may declare (float32 itself ends at 3.4e38)."""


class ModelSection(StudyModel):
    """``[model]``: which architecture, one of the model registry's (`common.models`).

    Exactly one of ``name`` (a built-in) and ``custom`` (``package.module:factory``);
    neither means ``name = "mlp"``. ``max_abs_weight``: the public bound on every weight
    of a global model the coordinator serves (`DEFAULT_MAX_ABS_WEIGHT` says why 1e6);
    part of the study's canonical bytes and digest when it is not the default.
    """

    name: str | None = None
    custom: str | None = Field(default=None, pattern=FACTORY_PATTERN)
    hidden: tuple[int, ...] = Field(default=(64, 32), description="mlp hidden layer sizes")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    options: dict[str, int | float | str | bool] = Field(
        default_factory=dict, description="keyword arguments passed to a custom factory"
    )
    max_abs_weight: float = Field(
        default=DEFAULT_MAX_ABS_WEIGHT, gt=0, le=MAX_ABS_WEIGHT_LIMIT,
        description="the largest |weight| a served global model may hold",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("name") is None and data.get("custom") is None:
            return {**data, "name": "mlp"}
        return data

    @model_validator(mode="after")
    def _one_model(self) -> ModelSection:
        if self.name is not None and self.custom is not None:
            raise ValueError("set either model.name or model.custom, not both")
        if self.name is not None:
            try:
                models.kind_of(self.name)
            except ConfigError:
                known = ", ".join(models.model_names())
                raise ValueError(
                    f"unknown model {self.name!r}; known: {known}, or custom = ..."
                ) from None
        if any(h < 1 or h > 65536 for h in self.hidden):
            raise ValueError("hidden sizes must be in 1..65536")
        return self


class TrainingSection(StudyModel):
    """``[training]``: local DP-SGD and the server optimizer."""

    local_epochs: int = Field(default=1, ge=1, le=1000)
    learning_rate: float = Field(default=0.1, gt=0, le=10)
    batch_size: int = Field(default=256, ge=1, le=1 << 20)
    local_optimizer: Literal["sgd", "adam"] = "sgd"
    fedprox_mu: float = Field(default=0.0, ge=0, le=100)
    server_optimizer: ServerOptimizerName = "fedavg"
    server_learning_rate: float = Field(default=1.0, gt=0, le=100)
    final_evaluation: bool = Field(
        default=True, description="one evaluation-only round at the end (sets the threshold)"
    )


class EvaluationSection(StudyModel):
    """``[privacy.evaluation]``: the DP score histograms behind the ROC and threshold.

    ``max_evaluations``: the DP evaluations (score histograms, one ledger entry each) the
    study asks of every site. Each training round releases one and the final
    evaluation-only round one more, so ``"derived"`` (the default) asks for exactly
    ``study.rounds`` + 1 (+ 0 without ``training.final_evaluation``); an explicit number
    must cover them (`Study.evaluations_needed`), or the study is refused.

    ``noise_std``: the std of the distributed discrete Gaussian noise on each summed
    count of a score histogram. Every member adds its share of it (the study is bound
    into every round's announcement), so no member's own settings can lower the noise
    another member's ledger records; a site whose ``privacy.evaluation_noise_std``
    (the least it accepts) is larger refuses the study.
    """

    histogram_bins: int = Field(default=20, ge=2, le=1000)
    max_evaluations: Literal["derived"] | int = "derived"
    noise_std: float = Field(default=DEFAULT_EVALUATION_NOISE_STD, ge=1.0, le=1e6)

    @field_validator("max_evaluations")
    @classmethod
    def _evaluations_in_range(cls, value: Literal["derived"] | int) -> Literal["derived"] | int:
        if value != "derived" and not 1 <= value <= 100_000:
            raise ValueError("max_evaluations must be \"derived\" or an integer in 1..100000")
        return value


class StudyPrivacySection(StudyModel):
    """``[privacy]``: requests. A site joins only if they are at least as strict as its own
    policy (`check_study_against_policy`), and its own policy still governs its spend."""

    unit: PrivacyUnit = "patient"
    epsilon: float = Field(default=8.0, gt=0, le=100, description="requested total per site")
    delta: float = Field(default=1e-5, gt=0, lt=1)
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6)
    max_epsilon_per_round: float | None = Field(default=None, gt=0, le=100)
    # Hospital-level DP: whole-update clip norm S and adaptive intermediaries.
    update_clip_norm: float | None = Field(default=None, gt=0)
    # z: the securely summed update carries discrete Gaussian noise of std z * S per
    # coordinate. None: planned from epsilon (common.study.hospital_terms.study_terms).
    update_noise_multiplier: float | None = Field(default=None, gt=0, le=1000)
    # v intermediaries per hospital (Jiang et al., MICCAI 2023). 1 (default): true
    # hospital-level DP, the hospital-level epsilon stays within the budget. v > 1 or
    # "auto" (opt-in): the budget is charged per patient (an intermediary's update at
    # 2S); the hospital-level epsilon is then v-fold group privacy of the
    # intermediary-level one and can exceed epsilon (`intermediaries_warning`).
    intermediaries: Literal["auto"] | int = 1
    # Record/patient-level DP-SGD underneath hospital-level DP:
    # "none" trains without DP-SGD (the whole update is still clipped and noised);
    # "record" / "patient" also run Opacus DP-SGD at that unit, its noise planned by each
    # site for record_epsilon over the study's rounds (common.privacy.layered).
    record_level: Literal["none", "record", "patient"] = "none"
    record_epsilon: float | None = Field(default=None, gt=0, le=100)
    # Once-per-study DP releases: statistics for preprocessing, cohort count.
    # Declared by the consortium and spent by every site alike (a site refuses a study
    # asking for more than its own limit); docs/privacy.md "The cohort count".
    statistics_epsilon: float = Field(default=0.5, gt=0, le=100)
    count_epsilon: float = Field(default=DEFAULT_COUNT_EPSILON, gt=0, le=100)
    # The SecAgg+ threat terms every member sizes its share of distributed noise with:
    # at most T = max_colluding_sites sites collude with the coordinator (they know
    # their own noise), and no secure round covers fewer than
    # max(min_round_sites, T + 2) sites. Declared once for all members (bound into the
    # study digest every round announces), so every site adds the same share; a site
    # refuses a study whose terms are weaker than its own policy (`study_round_terms`).
    max_colluding_sites: int = Field(default=1, ge=0, le=10_000)
    min_round_sites: int = Field(default=3, ge=2, le=1_000_000)
    evaluation: EvaluationSection = EvaluationSection()

    @field_validator("intermediaries")
    @classmethod
    def _positive_intermediaries(cls, value: Literal["auto"] | int) -> Literal["auto"] | int:
        if value != "auto" and not 1 <= value <= 10_000:
            raise ValueError("intermediaries must be 'auto' or an integer in 1..10000")
        return value

    @model_validator(mode="after")
    def _hospital_only(self) -> StudyPrivacySection:
        if self.unit != "hospital" and (
            self.update_clip_norm is not None or self.update_noise_multiplier is not None
        ):
            raise ValueError(
                "update_clip_norm and update_noise_multiplier apply to unit = 'hospital' only"
            )
        if self.max_epsilon_per_round is not None and self.max_epsilon_per_round > self.epsilon:
            raise ValueError("max_epsilon_per_round must not exceed epsilon")
        self._check_record_level()
        return self

    def _check_record_level(self) -> None:
        """DP-SGD underneath hospital-level DP: every inconsistency names its field."""
        if self.record_level == "none":
            if self.record_epsilon is not None:
                raise ValueError(
                    "privacy.record_epsilon is set but privacy.record_level is 'none': set "
                    "record_level = 'record' or 'patient', or remove record_epsilon"
                )
            return
        if self.unit != "hospital":
            raise ValueError(
                f"privacy.record_level = {self.record_level!r} applies to unit = 'hospital' "
                f"only (unit = {self.unit!r} already trains with DP-SGD at that unit)"
            )
        if self.record_epsilon is None:
            raise ValueError(
                f"privacy.record_level = {self.record_level!r} needs privacy.record_epsilon "
                "(the record/patient-level epsilon the DP-SGD noise is planned for)"
            )
        if self.record_epsilon > self.epsilon:
            raise ValueError(
                f"privacy.record_epsilon = {self.record_epsilon:g} exceeds privacy.epsilon = "
                f"{self.epsilon:g} (the per-site total)"
            )
        if self.record_epsilon <= self.statistics_epsilon + self.count_epsilon:
            raise ValueError(
                f"privacy.record_epsilon = {self.record_epsilon:g} leaves nothing for DP-SGD "
                "after statistics_epsilon + count_epsilon (both are part of the "
                "record-level history)"
            )
        if self.intermediaries != 1:
            raise ValueError(
                f"privacy.record_level = {self.record_level!r} needs privacy.intermediaries "
                f"= 1 (got {self.intermediaries!r}): DP-SGD inside intermediaries is not "
                "implemented"
            )


def intermediaries_warning(privacy: StudyPrivacySection) -> str | None:
    """The line `study check`, `study init` and the coordinator print when a hospital-level
    study splits its hospitals: its hospital-level epsilon is v-fold, not the budget."""
    if privacy.unit != "hospital" or privacy.intermediaries == 1:
        return None
    v = ("v chosen per round by the adaptive rule, up to 8"
         if privacy.intermediaries == "auto" else f"v = {privacy.intermediaries}")
    return (
        f"warning: privacy.unit = \"hospital\" with privacy.intermediaries = "
        f"{privacy.intermediaries!r}: each site's budget (epsilon {privacy.epsilon:g}) is "
        "charged per patient (a patient moves its intermediary by up to 2S), not per "
        "hospital, so the hospital-level epsilon is v-fold group privacy of the "
        f"intermediary-level one ({v}; the zCDP cost grows v^2-fold) and can exceed epsilon; set "
        "intermediaries = 1 if the agreement caps the hospital-level epsilon"
    )


FINGERPRINT_PATTERN = r"^[0-9a-f]{64}$"
"""A member's public-key fingerprint: the hex SHA-256 of its certificate's
SubjectPublicKeyInfo, as `medfed pki request` / `pki sign` / `pki members` print it."""
_FINGERPRINT = re.compile(FINGERPRINT_PATTERN)


class StudyMember(StudyModel):
    """One hospital of the study: its site id (the name in its certificate) and the
    fingerprint of the public key its officer read out when its CSR was signed. A round
    whose roster holds anyone else, or a member under another key, is refused by every
    site before any share or masked input leaves it."""

    name: str = Field(pattern=SITE_ID_PATTERN)
    fingerprint: str

    @field_validator("fingerprint", mode="before")
    @classmethod
    def _fingerprint(cls, value: Any) -> Any:
        if not isinstance(value, str) or not _FINGERPRINT.fullmatch(value):
            raise ValueError(
                "expected the public key's SHA-256 as 64 lower-case hex digits, as "
                "`medfed pki request` and `medfed pki sign` print it"
            )
        return value



class Study(StudyModel):
    """A whole study file."""

    study: StudySection
    data: DataSection
    features: tuple[FeatureSpec, ...] = ()
    model: ModelSection = ModelSection()
    training: TrainingSection = TrainingSection()
    privacy: StudyPrivacySection = StudyPrivacySection()
    # The hospitals whose sites may be in a round, pinned by key ([[members]]); part of
    # the canonical bytes and digest only when listed (a study without members keeps
    # the digest it had before members existed).
    members: tuple[StudyMember, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> Study:
        _check_members(self.members)
        names = [f.name for f in self.features]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"feature names must be distinct; repeated: {duplicates}")
        reserved = {self.data.label_column, self.data.patient_column, self.data.file_column}
        clash = sorted(n for n in names if n in reserved)
        if clash:
            raise ValueError(f"label/patient/file columns cannot also be features: {clash}")
        encoded = encoded_feature_names(self)
        if len(set(encoded)) != len(encoded):
            raise ValueError(
                f"encoded feature names collide (a column named like 'x{MISSING_SUFFIX}' or "
                "'x=level'?): rename a column"
            )
        if self.data.kind == "table" and not self.features:
            raise ValueError("a table study needs at least one [[features]] entry")
        if self.data.kind == "images" and self.features:
            raise ValueError("an images study takes no [[features]] (the pixels are the input)")
        n_classes = len(self.study.classes)
        if self.study.task == "binary" and n_classes != 2:
            raise ValueError("task = 'binary' needs exactly two classes [negative, positive]")
        if self.study.task == "multiclass" and n_classes < 3:
            raise ValueError("task = 'multiclass' needs at least three classes")
        name = self.model.name
        if name is not None and models.kind_of(name) != self.data.kind:
            other = "images" if self.data.kind == "table" else "tables"
            ours = "tables" if self.data.kind == "table" else "images"
            raise ValueError(f"model {name!r} is for {other}; {ours} use "
                             f"{models.model_names(self.data.kind)}")
        if self.privacy.unit == "patient" and self.data.patient_column is None:
            raise ValueError("privacy.unit = 'patient' needs data.patient_column")
        if self.privacy.record_level == "patient" and self.data.patient_column is None:
            raise ValueError("privacy.record_level = 'patient' needs data.patient_column")
        allowance = self.privacy.evaluation.max_evaluations
        if allowance != "derived" and allowance < self.evaluations_needed:
            raise ValueError(
                f"privacy.evaluation.max_evaluations = {allowance} does not cover the "
                f"study's {self.evaluations_planned_text()}; each of them releases one DP "
                f"evaluation, so no site could answer the last one: set max_evaluations = "
                f"\"derived\" or at least {self.evaluations_needed}, or lower study.rounds"
            )
        return self

    @property
    def evaluations_needed(self) -> int:
        """DP evaluations the study releases at every site: one per training round and
        one for the final evaluation-only round (when ``training.final_evaluation``)."""
        return self.study.rounds + (1 if self.training.final_evaluation else 0)

    @property
    def max_evaluations(self) -> int:
        """The evaluations the study asks of every site (``"derived"``: exactly those
        needed); a site whose policy allows fewer refuses the study at enrolment."""
        allowance = self.privacy.evaluation.max_evaluations
        return self.evaluations_needed if allowance == "derived" else allowance

    def evaluations_planned_text(self) -> str:
        """``study.rounds = 10 training rounds + 1 final evaluation round
        (training.final_evaluation = true)``: the fields the allowance follows from."""
        final = ("+ 1 final evaluation round (training.final_evaluation = true)"
                 if self.training.final_evaluation
                 else "and no final evaluation round (training.final_evaluation = false)")
        return f"study.rounds = {self.study.rounds} training rounds {final}"

    @property
    def num_outputs(self) -> int:
        """One logit for binary, one per class for multi-class."""
        return 1 if self.study.task == "binary" else len(self.study.classes)

    def member_fingerprints(self) -> dict[str, str]:
        """Site id -> public-key fingerprint of every listed member."""
        return {member.name: member.fingerprint for member in self.members}

    def feature(self, name: str) -> FeatureSpec:
        for spec in self.features:
            if spec.name == name:
                return spec
        raise ConfigError("features", f"no feature named {name!r}")


def _check_members(members: Sequence[StudyMember]) -> None:
    """Each hospital once, each key once: a name listed twice (under two keys) or one key
    under two names would let a single hospital count as two in a round's floor."""
    names = [m.name for m in members]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"members: each hospital is listed once; repeated: {repeated}")
    owner: dict[str, str] = {}
    for member in members:
        other = owner.setdefault(member.fingerprint, member.name)
        if other != member.name:
            raise ValueError(
                f"members: {other!r} and {member.name!r} have the same key fingerprint "
                f"{member.fingerprint[:16]}...; every hospital has its own key"
            )


# --------------------------------------------------------------------------- loading


def _field_of(loc: Sequence[int | str]) -> str:
    """``("features", 2, "levels")`` -> ``features[2].levels``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "study"


def first_problem(exc: pydantic.ValidationError) -> tuple[str, str]:
    problems = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        problems.append((_field_of(loc), err["msg"].removeprefix("Value error, ")))
    first_field, first_message = problems[0]
    rest = "".join(f"; {f}: {m}" for f, m in problems[1:])
    return first_field, first_message + rest


def study_from_mapping(data: Mapping[str, Any], *, source: str = "study") -> Study:
    """Validate a parsed study; a problem is a `ConfigError` naming the field and `source`."""
    try:
        return Study.model_validate(dict(data))
    except pydantic.ValidationError as exc:
        field, message = first_problem(exc)
        raise ConfigError(field, f"{message} (in {source})") from None


def load_study(path: str | Path) -> Study:
    """Read and validate ``study.toml``; every error names the file and the field."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError("study", f"cannot read study file {path}: {exc.strerror}") from None
    try:
        data = parse_toml(raw)
    except ValidationError as exc:
        raise ConfigError("study", f"{path} is not valid TOML: {exc}") from None
    return study_from_mapping(data, source=str(path))


def study_bytes(study: Study) -> bytes:
    """Canonical encoding (JSON, sorted keys, no spaces): what the coordinator sends and
    hashes, so every party agrees byte for byte on what was studied."""
    dumped = study.model_dump(mode="json")
    if not study.members:
        del dumped["members"]  # the digest of a study without members is unchanged
    evaluation = dumped["privacy"]["evaluation"]
    if evaluation["noise_std"] == DEFAULT_EVALUATION_NOISE_STD:
        # Left out at its default: a study pinned before the field existed keeps its
        # digest (its approvals hold), and the bytes still fix the value (absent = 10).
        del evaluation["noise_std"]
    if study.model.max_abs_weight == DEFAULT_MAX_ABS_WEIGHT:
        # Likewise a study keeping the default bound: the default is part of study
        # format 1 (changing it would take a new format), so these bytes still pin it.
        del dumped["model"]["max_abs_weight"]
    return json.dumps(
        dumped, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def study_sha256(study: Study) -> str:
    return hashlib.sha256(study_bytes(study)).hexdigest()


MAX_STUDY_BYTES = 1 << 20


def study_from_bytes(data: bytes) -> Study:
    """Parse a study received from another party; malformed input is a `ValidationError`."""
    if len(data) > MAX_STUDY_BYTES:
        raise ValidationError("study is too large")
    try:
        parsed = parse_json(data)
    except ValidationError as exc:
        raise ValidationError(f"study is not UTF-8 JSON within limits ({exc})") from None
    if not isinstance(parsed, dict):
        raise ValidationError("study must be a JSON object")
    try:
        return Study.model_validate(parsed)
    except pydantic.ValidationError as exc:
        field, message = first_problem(exc)
        raise ValidationError(f"study: {field}: {message}") from None


def study_from_enrolment(data: bytes, *, announced_sha256: str) -> Study:
    """The study a site receives at enrolment: canonical bytes whose SHA-256 is the one
    bound into the round announcements. Anything else is a `ValidationError`."""
    if hashlib.sha256(data).hexdigest() != announced_sha256:
        raise ValidationError("study bytes do not match the announced study_sha256")
    study = study_from_bytes(data)
    if study_bytes(study) != data:
        raise ValidationError("study is not in canonical form")
    return study


# --------------------------------------------------------------------------- encoding


def encoded_feature_names(study: Study) -> list[str]:
    """Column names of the model's input matrix, in order: numeric as is, categorical as
    ``name=level`` per declared level, then ``name__missing`` for indicator features."""
    names: list[str] = []
    for spec in study.features:
        if spec.type == "numeric":
            names.append(spec.name)
        else:
            names.extend(f"{spec.name}={level}" for level in spec.levels or ())
        if spec.missing == "indicator":
            names.append(spec.name + MISSING_SUFFIX)
    return names


def class_index(study: Study, cell: str) -> int | None:
    """Index of the class a label cell names; None if it names none (``1.0`` matches 1)."""
    text = cell.strip()
    for index, label in enumerate(study.study.classes):
        if text == str(label):
            return index
    if any(isinstance(c, int) for c in study.study.classes):
        try:
            number = float(text)
        except ValueError:
            return None
        for index, label in enumerate(study.study.classes):
            if isinstance(label, int) and number == label:
                return index
    return None
