"""A study's untrained network as a file: what a coordinator without torch serves round 1
from (`coordinator serve --study S --initial-model F`).

The coordinator's control plane (rounds, SecAgg+, decoding, the server optimizer, the
bundles) works on flat float32 vectors and needs no network code; only building the
untrained network does. `medfed model init` (an install with torch: the site image, an
operator's workstation) builds it exactly as a coordinator with torch would (the public
seed `INITIAL_MODEL_SEED`, `common.models.build.initial_model`) and writes it here, so
the coordinator image carries no torch, Opacus or MONAI.

The file is safetensors (a JSON header and raw float32 bytes: reading it never runs
code), one tensor per ``named_parameters()`` name, with string metadata:

=========================  ====================================================
``medfed.format``          ``medfed-initial-model/1``
``medfed.study_sha256``    SHA-256 of the study's canonical bytes it was built for
``medfed.seed``            the torch seed it was built with
``medfed.parameters``      names and shapes in flat-vector order
``medfed.sha256``          SHA-256 over the other metadata and the tensor bytes
=========================  ====================================================

The coordinator refuses a file built for another study (a changed study, even by its
member list, needs a new file) and any edited one. The initial weights are public, and
a coordinator chooses every round's model anyway: the file adds nothing a deviating
coordinator could not already do, so it is checked for integrity, not signed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from common.core.codec import TensorSpec
from common.core.errors import StateError, ValidationError
from common.core.fileio import atomic_write, read_parsed
from common.core.tensor_file import header_metadata, metadata_digest, parameters_layout
from common.study import Study, study_sha256
from common.study.policy import largest_weight

INITIAL_MODEL_FORMAT = "medfed-initial-model/1"
INITIAL_MODEL_SEED = 0
"""The initial weights are public: every coordinator and `medfed model init` build the
same ones for a study (for one torch version)."""

_KEYS = ("medfed.format", "medfed.study_sha256", "medfed.seed", "medfed.parameters",
         "medfed.sha256")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SEED = re.compile(r"[0-9]{1,19}")


def _encoded(
    study: Study, layout: Sequence[TensorSpec], flat: np.ndarray, *, seed: int
) -> tuple[bytes, str]:
    """The bytes and their content digest (``medfed.sha256``)."""
    vector = np.ascontiguousarray(flat, dtype="<f4").reshape(-1)
    if vector.size != sum(spec.elements for spec in layout):
        raise ValidationError(f"flat vector has {vector.size} values, the layout needs "
                              f"{sum(spec.elements for spec in layout)}")
    if not np.all(np.isfinite(vector)):
        raise ValidationError("the initial model contains NaN or infinity")
    tensors: dict[str, np.ndarray] = {}
    start = 0
    for spec in layout:
        tensors[spec.name] = vector[start : start + spec.elements].reshape(spec.shape)
        start += spec.elements
    metadata = {
        "medfed.format": INITIAL_MODEL_FORMAT,
        "medfed.study_sha256": study_sha256(study),
        "medfed.seed": str(int(seed)),
        "medfed.parameters": _layout_json(layout),
    }
    digest = metadata_digest(metadata, tensors)
    metadata["medfed.sha256"] = digest
    data: bytes = save(tensors, metadata=metadata)
    return data, digest


def write_initial_model(
    path: str | Path, study: Study, layout: Sequence[TensorSpec], flat: np.ndarray, *,
    seed: int,
) -> str:
    """Atomically write the file; returns its content digest (``medfed.sha256``: the
    same on every run for one study and torch version, unlike the file's own SHA-256,
    since safetensors writes the header's keys in no fixed order)."""
    path = Path(path)
    data, digest = _encoded(study, layout, flat, seed=seed)
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise StateError(f"cannot write initial model {path}: {exc.strerror}") from None
    return digest


def read_initial_model(
    path: str | Path, study: Study
) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
    """The layout and flat float32 vector in `path`, verified against `study`; every
    problem is a `ValidationError` naming the file and the metadata key."""
    return read_parsed(path, what="initial model",
                       parse=lambda data: initial_model_from_bytes(data, study))


def initial_model_from_bytes(
    data: bytes, study: Study
) -> tuple[tuple[TensorSpec, ...], np.ndarray]:
    """Parse and verify the file's bytes (see `read_initial_model`)."""
    try:
        metadata = header_metadata(data)
    except ValidationError as exc:
        raise ValidationError(f"{exc}; make one with `medfed model init`") from None
    missing = [k for k in _KEYS if k not in metadata]
    if missing:
        raise ValidationError(f"{missing[0]}: missing from the file's metadata (is this a "
                              "file `medfed model init` wrote?)")
    unknown = sorted(set(metadata) - set(_KEYS))
    if unknown:
        raise ValidationError(f"{unknown[0]}: unknown metadata key")
    if metadata["medfed.format"] != INITIAL_MODEL_FORMAT:
        raise ValidationError(f"medfed.format: {metadata['medfed.format']!r} is not "
                              f"{INITIAL_MODEL_FORMAT!r}")
    built_for = metadata["medfed.study_sha256"]
    if _SHA256.fullmatch(built_for) is None:
        raise ValidationError("medfed.study_sha256: not a SHA-256 in lower-case hex")
    if built_for != study_sha256(study):
        raise ValidationError(
            f"medfed.study_sha256: built for study {built_for[:12]}..., this coordinator "
            f"serves {study_sha256(study)[:12]}... (the study changed since: run `medfed "
            "model init` on the study the coordinator serves)")
    if _SEED.fullmatch(metadata["medfed.seed"]) is None:
        raise ValidationError("medfed.seed: must be a non-negative integer")
    try:
        layout = parameters_layout(metadata["medfed.parameters"])
    except ValidationError as exc:
        raise ValidationError(str(exc)) from None
    try:
        tensors = load(data)
    except SafetensorError as exc:
        raise ValidationError(f"tensors: {exc}") from None
    names = [name for name, _ in layout]
    if not names or len(set(names)) != len(names) or set(tensors) != set(names):
        raise ValidationError("medfed.parameters: names differ from the file's tensors")
    for name, shape in layout:
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise ValidationError(f"medfed.parameters: shape of {name!r} differs from its "
                                  "tensor")
        if tensor.dtype != np.float32:
            raise ValidationError(f"tensor {name!r}: dtype {tensor.dtype}, expected float32")
    ordered = {name: tensors[name] for name in names}
    if metadata_digest(metadata, ordered) != metadata["medfed.sha256"]:
        raise ValidationError("medfed.sha256: the file was modified (digest mismatch)")
    specs = tuple(TensorSpec(name, "<f4", shape) for name, shape in layout)
    flat = np.empty(sum(math.prod(shape) for _, shape in layout), dtype=np.float32)
    start = 0
    for name, shape in layout:
        size = math.prod(shape)
        flat[start : start + size] = ordered[name].reshape(-1)
        start += size
    if not np.all(np.isfinite(flat)):
        raise ValidationError("tensors: contain NaN or infinity")
    largest = largest_weight(flat)
    if largest > study.model.max_abs_weight:
        raise ValidationError(
            f"tensors: a weight of magnitude {largest:.4g} is beyond the study's "
            f"model.max_abs_weight = {study.model.max_abs_weight:g} (every site would "
            "refuse to train on it)")
    return specs, flat


def _layout_json(layout: Sequence[TensorSpec]) -> str:
    return json.dumps([{"name": spec.name, "shape": list(spec.shape)} for spec in layout],
                      sort_keys=True, separators=(",", ":"))
