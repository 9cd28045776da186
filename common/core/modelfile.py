"""The medfed model file: a JSON header and raw tensor bytes, never a pickle.

Layout: ``MAGIC`` (8 bytes) | header length (4 bytes, big-endian) | UTF-8 JSON header |
tensor bytes. The header holds the tensor layout, the SHA-256 of the tensor bytes and
free-form metadata (round number, optimizer name). Checkpoints are written to a
temporary file, fsynced and renamed, so a crash leaves the previous one intact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.core.codec import TensorSpec, bytes_to_flat, digest, layout_bytes
from common.core.errors import StateError, ValidationError
from common.core.fileio import atomic_open
from common.core.parsing import parse_json

MAGIC = b"MEDFEDM1"
MAX_HEADER_BYTES = 1 << 20
MAX_DIMENSION = 1 << 31


@dataclass(frozen=True)
class ModelFile:
    layout: tuple[TensorSpec, ...]
    flat: np.ndarray
    metadata: Mapping[str, Any] = field(default_factory=dict)
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)


def _layout_json(layout: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    return [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in layout]


def _layout_from_json(items: Any) -> tuple[TensorSpec, ...]:
    if not isinstance(items, list):
        raise ValidationError("model file: layout must be a list")
    specs = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValidationError(f"model file: layout entry {index} is not an object")
        shape = item.get("shape")
        if not isinstance(shape, list) or len(shape) > 8 or not all(
            type(d) is int and 0 <= d <= MAX_DIMENSION for d in shape
        ):
            raise ValidationError(
                f"model file: layout entry {index}: shape must be at most 8 integers in "
                f"0..{MAX_DIMENSION}"
            )
        specs.append(TensorSpec(str(item.get("name")), str(item.get("dtype")), tuple(shape)))
    return tuple(specs)


def _extras_from_json(items: Any) -> list[tuple[str, int]]:
    """``extras``: ``[{"name": str, "elements": int}, ...]``, counts as JSON integers."""
    if not isinstance(items, list):
        raise ValidationError("model file: extras must be a list")
    extras = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValidationError(f"model file: extras entry {index} is not an object")
        name, count = item.get("name"), item.get("elements")
        if not isinstance(name, str) or type(count) is not int or not 0 <= count <= (
            MAX_DIMENSION
        ):
            raise ValidationError(
                f"model file: extras entry {index}: needs a name and elements in "
                f"0..{MAX_DIMENSION}"
            )
        extras.append((name, count))
    return extras


def _tensor_views(flat: np.ndarray, layout: Sequence[TensorSpec]) -> list[memoryview]:
    """Each tensor's bytes as a view into `flat` (a copy only when the dtype differs), so
    writing a checkpoint of a large model does not hold a second copy of it."""
    if flat.ndim != 1 or flat.size != sum(spec.elements for spec in layout):
        raise ValidationError("flat vector does not match the model layout")
    views = []
    start = 0
    for spec in layout:
        part = np.ascontiguousarray(
            flat[start : start + spec.elements].astype(np.dtype(spec.dtype), copy=False)
        )
        views.append(part.data.cast("B"))
        start += spec.elements
    return views


def write_model_file(path: Path, model: ModelFile) -> None:
    """Atomically write `model` (and named extra float32 vectors) to `path`."""
    views = _tensor_views(model.flat, model.layout)
    hasher = hashlib.sha256()
    for view in views:
        hasher.update(view)
    extras = {name: np.ascontiguousarray(v, dtype="<f4") for name, v in model.extras.items()}
    header = {
        "format": 1,
        "layout": _layout_json(model.layout),
        "sha256": hasher.hexdigest(),
        "metadata": dict(model.metadata),
        "extras": [{"name": k, "elements": int(v.size)} for k, v in extras.items()],
    }
    raw_header = json.dumps(header, sort_keys=True).encode()
    with atomic_open(path) as fh:
        fh.write(MAGIC + len(raw_header).to_bytes(4, "big") + raw_header)
        for view in views:
            fh.write(view)
        for v in extras.values():
            fh.write(v.data.cast("B"))


def read_model_file(path: Path) -> ModelFile:
    """Read and verify a model file; any inconsistency is a `StateError`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise StateError(f"cannot read model file {path}: {exc.strerror}") from None
    try:
        return _parse(data)
    except ValidationError as exc:
        raise StateError(f"model file {path} is invalid: {exc}") from None


def _parse(data: bytes) -> ModelFile:
    if len(data) < 12 or data[:8] != MAGIC:
        raise ValidationError("not a medfed model file")
    header_len = int.from_bytes(data[8:12], "big")
    if header_len > MAX_HEADER_BYTES or 12 + header_len > len(data):
        raise ValidationError("header length out of range")
    try:
        header = parse_json(data[12 : 12 + header_len])
    except ValidationError as exc:
        raise ValidationError(f"header is not JSON within limits ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != 1:
        raise ValidationError("unsupported model file format")
    layout = _layout_from_json(header.get("layout"))
    start = 12 + header_len
    end = start + layout_bytes(layout)
    body = data[start:end]
    if digest(body).hex() != header.get("sha256"):
        raise ValidationError("tensor bytes do not match their SHA-256")
    flat = bytes_to_flat(body, layout)
    extras: dict[str, np.ndarray] = {}
    offset = end
    for name, count in _extras_from_json(header.get("extras", [])):
        chunk = data[offset : offset + 4 * count]
        if len(chunk) != 4 * count:
            raise ValidationError("extras truncated")
        extras[name] = np.frombuffer(chunk, dtype="<f4").astype(np.float32)
        offset += 4 * count
    if offset != len(data):
        raise ValidationError("trailing bytes after the model")
    metadata = header.get("metadata", {})
    return ModelFile(layout, flat, metadata if isinstance(metadata, dict) else {}, extras)


def flat_layout(elements: int, name: str = "flat") -> tuple[TensorSpec, ...]:
    """A one-tensor layout for a plain float32 vector (tests, benchmarks)."""
    return (TensorSpec(name, "<f4", (elements,)),)
