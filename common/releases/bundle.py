"""The model bundle: one ``.safetensors`` file a hospital can use without medfed's internals.

The tensors are the model's parameters, one per ``named_parameters()`` name, float32.
The metadata (safetensors allows string values only; ours are JSON) carries everything
needed to apply and to judge the model:

=====================  =========================================================
``medfed.format``      ``medfed-bundle/1``
``medfed.study``       the study, canonical bytes (`common.study.study_bytes`)
``medfed.architecture`` model name or custom factory and its parameters
``medfed.statistics``  the global preprocessing statistics (DP release)
``medfed.threshold``   the decision threshold (Youden's J on the DP ROC)
``medfed.privacy_card`` epsilon and delta per site, unit, accountant, mechanisms,
                       rounds, SecAgg parameters (for auditors)
``medfed.parameters``  parameter names and shapes in flat-vector order
``medfed.round``       the round this model closes; ``medfed.final``: last one?
``medfed.sha256``      SHA-256 over the other metadata and the tensor bytes
=====================  =========================================================

safetensors is a plain header plus raw bytes: reading one never runs code (no pickle).
The SHA-256 detects corruption and naive edits; it is not a signature (anyone who
edits the file can recompute it), so a bundle's authenticity comes from how it was
obtained (downloaded over the federation's mTLS channel).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors import SafetensorError
from safetensors.numpy import load, save

from common.core.errors import StateError, ValidationError
from common.core.fileio import atomic_write, read_parsed
from common.core.tensor_file import (
    MAX_HEADER_BYTES,
    header_metadata,
    metadata_digest,
    parameters_layout,
)
from common.core.tensor_file import (
    canonical_json as _json,
)
from common.models.architecture import Architecture, architecture_from_study
from common.releases.evaluation_interval import interval_text
from common.releases.evaluation_threshold import youden_threshold
from common.releases.noisy_counts import NOISE_DOMINATED
from common.study import (
    GlobalStatistics,
    PrivacyUnit,
    Study,
    check_statistics,
    encoded_feature_names,
    statistics_bytes,
    statistics_from_bytes,
    study_bytes,
    study_from_bytes,
    study_sha256,
)

BUNDLE_FORMAT = "medfed-bundle/1"
HEADER_MARGIN_BYTES = 8 + MAX_HEADER_BYTES
"""The most a bundle holds besides its float32 tensors: the 8-byte header length and the
header, which `bundle_from_bytes` refuses above MAX_HEADER_BYTES anyway."""


def bundle_size_limit(*, model_elements: int) -> int:
    """The largest valid bundle of a model with `model_elements` parameters (float32
    tensors plus `HEADER_MARGIN_BYTES`): a site refuses a final-model download beyond it
    before writing more."""
    return 4 * model_elements + HEADER_MARGIN_BYTES


MAX_ROUND_DIGITS = 15
ROUND_TEXT = re.compile(rf"[0-9]{{1,{MAX_ROUND_DIGITS}}}")
"""``medfed.round``: ASCII digits only (``str.isdigit`` also accepts "²"), few enough
that int() never meets Python's 4,300-digit limit."""

_KEYS = (
    "medfed.format",
    "medfed.study",
    "medfed.architecture",
    "medfed.statistics",
    "medfed.threshold",
    "medfed.privacy_card",
    "medfed.parameters",
    "medfed.round",
    "medfed.final",
    "medfed.sha256",
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Threshold(_Section):
    """The operating point: predict positive when the score is >= ``value``.

    Chosen by Youden's J on the federation's DP score histogram (`common.releases.evaluation`);
    multi-class models predict the arg-max and have no threshold."""

    value: float | None = Field(default=None, ge=0.0, le=1.0)
    method: Literal["youden-dp-roc", "fixed", "argmax"] = "youden-dp-roc"
    histogram_bins: int | None = Field(default=None, ge=2)
    # The bucket edges of the histogram the threshold was chosen from (None: the
    # default layout of `histogram_bins`, common.releases.evaluation_edges.default_edges).
    histogram_edges: tuple[float, ...] | None = Field(default=None, max_length=1001)
    # The federated DP AUC of the same histogram and how far its noise lets it be
    # trusted (common.releases.evaluation.NoisyHistogram): the noise std per score bucket, that
    # noise on the smaller class's count relative to the count, and the flag.
    auc: float | None = Field(default=None, ge=0.0, le=1.0)
    noise_std: float | None = Field(default=None, ge=0.0)
    relative_noise: float | None = Field(default=None, ge=0.0)
    noise_dominated: bool = False
    # The 95% interval the exact held-out AUC lies in
    # (common.releases.evaluation_interval.auc_interval):
    # the DP noise on the released counts, simulated, plus the buckets' resolution.
    auc_interval_low: float | None = Field(default=None, ge=0.0, le=1.0)
    auc_interval_high: float | None = Field(default=None, ge=0.0, le=1.0)


class SitePrivacy(_Section):
    """One site's guarantee as the site reports it (from its noised counts)."""

    site: str = Field(min_length=1, max_length=64)
    epsilon: float = Field(ge=0)
    delta: float = Field(ge=0, lt=1)


class GroupGuarantee(_Section):
    """A further guarantee stated plainly. Under hospital-level DP three per
    site: unit "hospital" (add/remove one hospital, model updates only; v-fold group
    privacy of the intermediary-level one when split), "intermediary" (add/remove one
    unit clipped to S) and "patient" (or "record": every release, a patient's records
    changed inside a unit that stays in the round, i.e. the updates at 2S)."""

    unit: str = Field(min_length=1, max_length=32)
    epsilon: float = Field(ge=0)
    delta: float = Field(ge=0, lt=1)
    note: str = Field(default="", max_length=500)


class SecAggCard(_Section):
    """Secure aggregation as run: SecAgg+ (Bell et al., CCS 2020)."""

    protocol: str = "secagg+"
    threshold: int = Field(ge=1)
    neighbours: int | None = Field(default=None, ge=1)
    max_colluding_sites: int = Field(ge=0)
    max_dropouts: int | None = Field(default=None, ge=0)
    ring_bits: int = Field(ge=1, le=128)
    clip: float | None = Field(default=None, gt=0)


class QueryRun(_Section):
    """A federated DP query the federation answered before this model (`medfed query
    run`), already inside sites[].epsilon; named here so a reader of the model knows
    what else was asked. `epsilon` is the sum of its statistics' epsilons,
    `epsilon_composed` what each participating site's ledger charged for it (the
    statistics composed, at the study's delta; None on a card written before it was
    recorded)."""

    name: str = Field(min_length=1, max_length=64)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    round: int = Field(ge=1)
    epsilon: float = Field(ge=0)
    contributors: int = Field(ge=1)
    epsilon_composed: float | None = Field(default=None, ge=0)


class PrivacyCard(_Section):
    """What an auditor needs to judge the model's privacy."""

    unit: PrivacyUnit
    accountant: str = Field(min_length=1, max_length=32)
    mechanisms: tuple[str, ...]
    rounds: int = Field(ge=0)
    sites: tuple[SitePrivacy, ...]
    group_guarantees: tuple[GroupGuarantee, ...] = ()
    # DP-SGD beneath hospital-level DP (study privacy.record_level): then
    # sites[].epsilon is this unit's epsilon (common.privacy.layered). Under hospital-level
    # DP sites[].epsilon is always what each site's budget is charged with; the
    # per-patient figure is the group guarantee of unit "patient" ("record").
    record_level: Literal["record", "patient"] | None = None
    # Under hospital-level DP: what each site's budget (sites[].epsilon) is charged with,
    # its ledger's term (common.privacy.signed.CHARGES): "record_level", the per-patient
    # figure (model updates at 2S), or "unit", the add/remove-one-unit composition at S
    # (None: a card written before the field, which charged "unit").
    budget_charge: Literal["unit", "record_level"] | None = None
    secagg: SecAggCard | None = Field(default=None, description="None: plain aggregation")
    statistics_release: str | None = Field(default=None, max_length=500)
    queries: tuple[QueryRun, ...] = Field(default=(), max_length=10_000)
    notes: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _distinct_sites(self) -> PrivacyCard:
        names = [s.site for s in self.sites]
        if len(set(names)) != len(names):
            raise ValueError("a site appears twice")
        return self


def threshold_from_histogram(
    hist: np.ndarray, *, bins: int, evaluation: Mapping[str, float] | None = None,
    edges: np.ndarray | None = None,
) -> Threshold:
    """Youden's threshold of the federation's summed DP score histogram (the evaluation
    round's, already reduced to its credible buckets, counted with `edges`, default
    `default_edges(bins)`), as the bundle records it, with the round's AUC and noise
    indication (`evaluation`: the round's metrics)."""
    found = evaluation or {}

    def finite(key: str) -> float | None:
        value = found.get(key)
        return float(value) if value is not None and math.isfinite(value) else None

    auc = finite("auc")
    low, high = finite("auc_interval_low"), finite("auc_interval_high")
    return Threshold(
        value=youden_threshold(hist, bins=None if edges is not None else bins, edges=edges),
        method="youden-dp-roc",
        histogram_bins=bins if edges is None else int(np.asarray(edges).size - 1),
        histogram_edges=None if edges is None else tuple(float(v) for v in edges),
        auc=None if auc is None else min(max(auc, 0.0), 1.0),
        noise_std=finite("auc_noise_std"), relative_noise=finite("auc_relative_noise"),
        noise_dominated=bool(found.get("auc_noise_dominated", 0.0)),
        auc_interval_low=None if low is None or high is None else min(max(low, 0.0), 1.0),
        auc_interval_high=None if low is None or high is None else min(max(high, 0.0), 1.0),
    )


@dataclass(frozen=True)
class ModelBundle:
    """A global model with everything needed to use and audit it."""

    study: Study
    architecture: Architecture
    statistics: GlobalStatistics
    threshold: Threshold
    card: PrivacyCard
    parameters: Mapping[str, np.ndarray]  # in flat-vector (named_parameters) order
    round: int = 0
    final: bool = False

    def flat(self) -> np.ndarray:
        """All parameters as one float32 vector, in the federation's order."""
        parts = [np.asarray(v, dtype=np.float32).reshape(-1) for v in self.parameters.values()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def parameters_from_flat(
    layout: Sequence[tuple[str, tuple[int, ...]]], flat: np.ndarray
) -> dict[str, np.ndarray]:
    """Split a flat vector into named tensors (`layout`: name and shape, in order)."""
    vector = np.asarray(flat, dtype=np.float32).reshape(-1)
    sizes = [math.prod(shape) for _, shape in layout]
    if sum(sizes) != vector.size:
        raise ValidationError(f"flat vector has {vector.size} values, layout needs {sum(sizes)}")
    out: dict[str, np.ndarray] = {}
    start = 0
    for (name, shape), size in zip(layout, sizes, strict=True):
        out[name] = vector[start : start + size].reshape(shape).copy()
        start += size
    return out


def card_json(card: PrivacyCard) -> dict[str, Any]:
    """The card as stored; without queries (or a budget charge) byte-identical to the
    format before them."""
    dumped = card.model_dump(mode="json")
    if not dumped.get("queries"):
        dumped.pop("queries", None)
    if dumped.get("budget_charge") is None:
        dumped.pop("budget_charge", None)
    return dumped


def _check_consistent(bundle: ModelBundle) -> None:
    """Everything in a bundle must describe the same study and model."""
    if bundle.architecture.custom is None and bundle.architecture != architecture_from_study(
        bundle.study
    ):
        raise ValidationError("medfed.architecture: does not match the study's model")
    if bundle.architecture.custom is not None and bundle.architecture.custom != (
        bundle.study.model.custom
    ):
        raise ValidationError("medfed.architecture: custom factory differs from the study's")
    try:
        check_statistics(bundle.study, bundle.statistics)
    except ValidationError as exc:
        raise ValidationError(f"medfed.statistics: {exc}") from None
    binary = bundle.study.study.task == "binary"
    if binary and bundle.threshold.value is None:
        raise ValidationError("medfed.threshold: a binary model needs a threshold value")
    if not binary and bundle.threshold.value is not None:
        raise ValidationError("medfed.threshold: a multi-class model predicts the arg-max")
    if bundle.card.unit != bundle.study.privacy.unit:
        raise ValidationError("medfed.privacy_card: unit differs from the study's")
    if (bundle.card.record_level or "none") != bundle.study.privacy.record_level:
        raise ValidationError("medfed.privacy_card: record_level differs from the study's")
    if bundle.card.budget_charge is not None and bundle.card.unit != "hospital":
        raise ValidationError("medfed.privacy_card: budget_charge applies to unit hospital")
    if bundle.round < 0:
        raise ValidationError("medfed.round: must be >= 0")
    if not bundle.parameters:
        raise ValidationError("medfed.parameters: a bundle needs at least one tensor")
    for name, value in bundle.parameters.items():
        array = np.asarray(value)
        if array.dtype != np.float32:
            raise ValidationError(f"tensor {name!r}: dtype {array.dtype}, expected float32")
        if not np.all(np.isfinite(array)):
            raise ValidationError(f"tensor {name!r}: contains NaN or infinity")


def bundle_metadata(bundle: ModelBundle) -> dict[str, str]:
    """The metadata strings of `bundle` (without its digest)."""
    return {
        "medfed.format": BUNDLE_FORMAT,
        "medfed.study": study_bytes(bundle.study).decode("utf-8"),
        "medfed.architecture": _json(bundle.architecture.model_dump(mode="json")),
        "medfed.statistics": statistics_bytes(bundle.statistics).decode("utf-8"),
        "medfed.threshold": _json(bundle.threshold.model_dump(mode="json")),
        "medfed.privacy_card": _json(card_json(bundle.card)),
        "medfed.parameters": _json(
            [{"name": n, "shape": list(np.shape(v))} for n, v in bundle.parameters.items()]
        ),
        "medfed.round": str(int(bundle.round)),
        "medfed.final": "true" if bundle.final else "false",
    }


def bundle_bytes(bundle: ModelBundle) -> bytes:
    """The bundle as safetensors bytes (what `write_bundle` writes and sites download)."""
    _check_consistent(bundle)
    tensors = {
        name: np.ascontiguousarray(value, dtype=np.float32)
        for name, value in bundle.parameters.items()
    }
    metadata = bundle_metadata(bundle)
    metadata["medfed.sha256"] = metadata_digest(metadata, tensors)
    data: bytes = save(tensors, metadata=metadata)
    return data


def write_bundle(path: str | Path, bundle: ModelBundle) -> str:
    """Atomically write `bundle` to `path` (temporary file, fsync, rename); returns the
    SHA-256 of the file, for reports."""
    path = Path(path)
    data = bundle_bytes(bundle)
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise StateError(f"cannot write model bundle {path}: {exc.strerror}") from None
    return hashlib.sha256(data).hexdigest()


def _section(key: str, model: type[BaseModel], text: str) -> Any:
    try:
        return model.model_validate_json(text)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "value"
        raise ValidationError(f"{key}: {where}: {err['msg']}") from None


def bundle_from_bytes(data: bytes) -> ModelBundle:
    """Parse and verify a bundle; any problem is a `ValidationError` naming the key.

    The bytes come from another party (a download, a file handed over): every check
    below names the key it refuses. Python's own parsing errors that a crafted file
    could still reach (a number or nesting beyond the interpreter's limits) are refused
    as a malformed bundle too, never raised raw."""
    try:
        return _bundle_from_bytes(data)
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise ValidationError(
            f"malformed bundle ({type(exc).__name__} while parsing its metadata)"
        ) from None


def _bundle_from_bytes(data: bytes) -> ModelBundle:
    metadata = header_metadata(data)
    missing = [k for k in _KEYS if k not in metadata]
    if missing:
        raise ValidationError(f"{missing[0]}: missing from the bundle's metadata")
    unknown = sorted(set(metadata) - set(_KEYS))
    if unknown:
        raise ValidationError(f"{unknown[0]}: unknown metadata key")
    if metadata["medfed.format"] != BUNDLE_FORMAT:
        raise ValidationError(f"medfed.format: {metadata['medfed.format']!r} is not supported")
    try:
        study = study_from_bytes(metadata["medfed.study"].encode("utf-8"))
    except ValidationError as exc:
        raise ValidationError(f"medfed.study: {exc}") from None
    if study_bytes(study) != metadata["medfed.study"].encode("utf-8"):
        raise ValidationError("medfed.study: not in canonical form")
    try:
        statistics = statistics_from_bytes(metadata["medfed.statistics"].encode("utf-8"))
    except ValidationError as exc:
        raise ValidationError(f"medfed.statistics: {exc}") from None
    layout = parameters_layout(metadata["medfed.parameters"])
    round_text, final_text = metadata["medfed.round"], metadata["medfed.final"]
    if ROUND_TEXT.fullmatch(round_text) is None:
        raise ValidationError(
            f"medfed.round: must be a non-negative integer of at most {MAX_ROUND_DIGITS} "
            "ASCII digits"
        )
    if final_text not in ("true", "false"):
        raise ValidationError("medfed.final: must be 'true' or 'false'")
    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ValidationError(f"tensors: {exc}") from None
    names = [name for name, _ in layout]
    if len(set(names)) != len(names) or set(tensors) != set(names):
        raise ValidationError("medfed.parameters: names differ from the file's tensors")
    for name, shape in layout:
        if tuple(tensors[name].shape) != shape:
            raise ValidationError(f"medfed.parameters: shape of {name!r} differs from its tensor")
    parameters = {name: tensors[name] for name, _ in layout}
    if metadata_digest(metadata, parameters) != metadata["medfed.sha256"]:
        raise ValidationError("medfed.sha256: the bundle was modified (digest mismatch)")
    bundle = ModelBundle(
        study=study,
        architecture=_section("medfed.architecture", Architecture, metadata["medfed.architecture"]),
        statistics=statistics,
        threshold=_section("medfed.threshold", Threshold, metadata["medfed.threshold"]),
        card=_section("medfed.privacy_card", PrivacyCard, metadata["medfed.privacy_card"]),
        parameters=parameters,
        round=int(round_text),
        final=final_text == "true",
    )
    _check_consistent(bundle)
    return bundle


def read_bundle(path: str | Path) -> ModelBundle:
    """Read and verify a bundle file; problems name the file and the metadata key."""
    return read_parsed(path, what="model bundle", parse=bundle_from_bytes)


def input_description(study: Study) -> str:
    """What the model takes: "image C x H x W" (channels and size from the study) or
    "N encoded features"."""
    data = study.data
    if data.kind == "images" and data.image_size is not None and data.channels is not None:
        height, width = data.image_size
        return f"image {data.channels} x {height} x {width} (channels x height x width)"
    return f"{len(encoded_feature_names(study))} encoded features"


def evaluation_auc_text(threshold: Threshold) -> str:
    """The federated DP AUC as `medfed model show` prints it: with its 95% interval, or
    "too noisy to read" when that is wider than
    `common.releases.evaluation_interval.UNREADABLE_WIDTH`; "undefined" without an AUC."""
    if threshold.auc is None:
        return "undefined"
    if threshold.auc_interval_low is None or threshold.auc_interval_high is None:
        return f"{threshold.auc:.3f}"
    return interval_text(threshold.auc, threshold.auc_interval_low,
                         threshold.auc_interval_high)


def evaluation_noise_text(threshold: Threshold) -> str:
    """The DP noise of the federated evaluation in words: the std per score bucket, and
    that noise as a share of the smaller class's released count while the share is at
    most 100%; beyond it (a count released as ~0 makes the share meaningless, e.g.
    "100000000%") "more than the smaller class's count". Flagged "noise-dominated"
    beyond `NOISE_DOMINATED` or when the evaluation round flagged it."""
    if threshold.noise_std is None:
        return ""
    text = f"DP noise std {threshold.noise_std:.3g} per score bucket"
    share = threshold.relative_noise
    dominated = threshold.noise_dominated or (share is not None and share > NOISE_DOMINATED)
    if share is not None:
        text += (f", {100 * share:.0f}% of the smaller class's count" if share <= 1.0
                 else ", more than the smaller class's count")
    return text + (" (noise-dominated)" if dominated else "")


def bundle_summary(bundle: ModelBundle) -> dict[str, Any]:
    """The model card as one JSON-able object (`medfed model show --json`)."""
    study = bundle.study
    return {
        "study": study.study.name,
        "study_sha256": study_sha256(study),
        "round": bundle.round,
        "final": bundle.final,
        "task": study.study.task,
        "classes": list(study.study.classes),
        "label_column": study.data.label_column,
        "features": [f.model_dump(mode="json") for f in study.features],
        "encoded_features": encoded_feature_names(study),
        "inputs": input_description(study),
        "architecture": bundle.architecture.model_dump(mode="json"),
        "parameters": int(sum(np.size(v) for v in bundle.parameters.values())),
        "threshold": bundle.threshold.model_dump(mode="json"),
        "statistics": bundle.statistics.model_dump(mode="json"),
        "privacy": bundle.card.model_dump(mode="json"),
    }
