"""The safetensors container medfed writes (model bundles, initial models): the JSON
metadata in its header, the parameters' names and shapes in flat-vector order, and the
content digest over both. Reading a header never runs code (no pickle); every check
names the key it refuses."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from common.core.errors import ValidationError
from common.core.parsing import parse_json

MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 100_000
MAX_RANK = 8
MAX_DIMENSION = 1 << 31


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no spaces: the metadata's values and the digest's input."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def metadata_digest(metadata: Mapping[str, str], tensors: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over the metadata (but ``medfed.sha256``) and each tensor's bytes."""
    hasher = hashlib.sha256()
    described = {k: v for k, v in metadata.items() if k != "medfed.sha256"}
    hasher.update(canonical_json(described).encode())
    for name, value in tensors.items():
        hasher.update(b"\0" + name.encode() + b"\0")
        hasher.update(np.ascontiguousarray(value, dtype="<f4").tobytes())
    return hasher.hexdigest()


def header_metadata(data: bytes) -> dict[str, str]:
    """The header's ``__metadata__`` (string keys and values) of safetensors bytes."""
    if len(data) < 8:
        raise ValidationError("not a safetensors file (too short)")
    length = int.from_bytes(data[:8], "little")
    if length > MAX_HEADER_BYTES or 8 + length > len(data):
        raise ValidationError("not a safetensors file (header length out of range)")
    try:
        header = parse_json(data[8 : 8 + length])
    except ValidationError:
        raise ValidationError("not a safetensors file (header is not JSON)") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValidationError("no medfed metadata (is this a medfed model bundle?)")
    return metadata


def parameters_layout(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """``medfed.parameters``: ``[{"name": str, "shape": [int, ...]}, ...]``, each dimension a
    JSON integer in 0..MAX_DIMENSION (no strings, floats or 5,000-digit numbers)."""
    expected = "medfed.parameters: expected [{name, shape}, ...]"
    try:
        items = parse_json(text)
    except ValidationError:
        raise ValidationError(f"{expected} (not JSON)") from None
    if not isinstance(items, list) or len(items) > MAX_TENSORS:
        raise ValidationError(f"{expected} (a list of at most {MAX_TENSORS} entries)")
    layout = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or set(item) != {"name", "shape"}:
            raise ValidationError(f"{expected} (entry {index})")
        name, shape = item["name"], item["shape"]
        if not isinstance(name, str) or not 1 <= len(name) <= 256:
            raise ValidationError(f"medfed.parameters: entry {index}: name must be 1-256 "
                                  "characters")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(
            type(d) is int and 0 <= d <= MAX_DIMENSION for d in shape
        ):
            raise ValidationError(
                f"medfed.parameters: shape of {name!r}: at most {MAX_RANK} integers in "
                f"0..{MAX_DIMENSION}"
            )
        layout.append((name, tuple(shape)))
    return layout
