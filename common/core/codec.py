"""Tensor and ring-vector wire codec: dtype + shape + raw little-endian bytes.

Nothing read from the network is ever unpickled. A model travels as the concatenation
of its tensors' raw bytes (layout given separately as `TensorSpec`s), in chunks of
`CHUNK_BYTES`; a receiver writes each chunk into a preallocated buffer at its offset
and rejects anything that does not tile the declared length exactly.
"""

from __future__ import annotations

import hashlib
import math
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from common.core.errors import ValidationError

CHUNK_BYTES = 1 << 20  # 1 MiB: inside the 1-4 MiB band, well under gRPC's 4 MiB default
MAX_TENSOR_ELEMENTS = 1 << 31
# Only these dtypes may cross the wire; always little-endian, never object arrays.
ALLOWED_DTYPES = frozenset({"<f4", "<f8", "<u4", "<i8", "<i4", "<f2"})


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of a flat parameter vector."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 256:
            raise ValidationError("tensor name must be 1-256 characters")
        if self.dtype not in ALLOWED_DTYPES:
            raise ValidationError(f"tensor {self.name!r}: dtype {self.dtype!r} not allowed")
        if any(d < 0 for d in self.shape) or len(self.shape) > 8:
            raise ValidationError(f"tensor {self.name!r}: invalid shape {self.shape}")
        if self.elements > MAX_TENSOR_ELEMENTS:
            raise ValidationError(f"tensor {self.name!r}: too many elements")

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.elements * np.dtype(self.dtype).itemsize


def _byte_view(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    view = memoryview(np.ascontiguousarray(data).data) if isinstance(data, np.ndarray) else (
        memoryview(data)
    )
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def layout_bytes(layout: Sequence[TensorSpec]) -> int:
    """Total bytes of a model with this layout."""
    return sum(spec.nbytes for spec in layout)


def layout_elements(layout: Sequence[TensorSpec]) -> int:
    return sum(spec.elements for spec in layout)


def digest(data: bytes | bytearray | memoryview | np.ndarray) -> bytes:
    """SHA-256 of the raw bytes (models are checked end to end after download)."""
    return hashlib.sha256(_byte_view(data)).digest()


def iter_chunks(
    data: bytes | bytearray | memoryview | np.ndarray, *, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[tuple[int, bytes]]:
    """Yield (byte offset, bytes) chunks of at most `chunk_bytes`."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    view = _byte_view(data)
    for offset in range(0, len(view), chunk_bytes):
        yield offset, bytes(view[offset : offset + chunk_bytes])


class ChunkAssembler:
    """Reassemble an in-order stream of chunks into a preallocated buffer.

    Chunks must arrive in order with no gap or overlap, each at most `max_chunk_bytes`,
    and must end exactly at `total_bytes`; anything else is a `ValidationError` and the
    buffer's content must be discarded by the caller.
    """

    def __init__(
        self, buffer: np.ndarray | bytearray | None, *, total_bytes: int, max_chunk_bytes: int
    ) -> None:
        if buffer is not None:
            view = _byte_view(buffer)
            if len(view) < total_bytes:
                raise ValueError("buffer smaller than the declared length")
            self._view = view
        self.total_bytes = total_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.received = 0

    def _write(self, offset: int, data: bytes) -> None:
        self._view[offset : offset + len(data)] = data

    def add(self, offset: int, data: bytes) -> None:
        if offset != self.received:
            raise ValidationError(
                f"chunk at byte offset {offset}, expected {self.received} (gap, overlap or reorder)"
            )
        if not data:
            raise ValidationError("empty chunk")
        if len(data) > self.max_chunk_bytes:
            raise ValidationError(
                f"chunk of {len(data)} bytes exceeds the limit of {self.max_chunk_bytes}"
            )
        end = offset + len(data)
        if end > self.total_bytes:
            raise ValidationError(
                f"chunk runs past the declared length of {self.total_bytes} bytes"
            )
        self._write(offset, data)
        self.received = end

    @property
    def complete(self) -> bool:
        return self.received == self.total_bytes

    def finish(self) -> None:
        if not self.complete:
            raise ValidationError(
                f"stream truncated: {self.received} of {self.total_bytes} bytes received"
            )


class SpoolAssembler(ChunkAssembler):
    """The same checks, but the bytes go to an anonymous temporary file (unlinked at
    creation, gone when closed): a very large upload is staged on disk, not in memory,
    until it is complete and can be added to the accumulator window by window."""

    def __init__(self, directory: str | None, *, total_bytes: int, max_chunk_bytes: int) -> None:
        super().__init__(None, total_bytes=total_bytes, max_chunk_bytes=max_chunk_bytes)
        self._file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 - closed in close()

    def _write(self, offset: int, data: bytes) -> None:
        self._file.write(data)  # in order, no gaps: checked by `add`

    def windows(self, elements: int) -> Iterator[np.ndarray]:
        """The staged vector as consecutive little-endian uint32 windows."""
        self.finish()
        self._file.flush()
        self._file.seek(0)
        remaining = self.total_bytes // 4
        while remaining:
            count = min(elements, remaining)
            window = np.frombuffer(self._file.read(count * 4), dtype="<u4")
            if window.size != count:
                raise ValidationError("staged upload shorter than expected")
            yield window.astype(np.uint32, copy=False)
            remaining -= count

    def close(self) -> None:
        self._file.close()


FINITE_CHECK_ELEMENTS = 1 << 18
"""Window of `all_finite`: its boolean temporary stays at 256 KiB, not d bytes."""


def all_finite(values: np.ndarray) -> bool:
    """True when no element is NaN or infinite, checked window by window."""
    flat = values.reshape(-1)
    for start in range(0, flat.size, FINITE_CHECK_ELEMENTS):
        if not np.isfinite(flat[start : start + FINITE_CHECK_ELEMENTS]).all():
            return False
    return True


def check_finite(flat: np.ndarray, layout: Sequence[TensorSpec]) -> None:
    """Refuse a float vector with NaN or infinity, naming the first tensor that has one."""
    start = 0
    for spec in layout:
        if not all_finite(flat[start : start + spec.elements]):
            raise ValidationError(f"tensor {spec.name!r} holds non-finite values")
        start += spec.elements


def flat_to_bytes(flat: np.ndarray, layout: Sequence[TensorSpec]) -> bytes:
    """Serialize a float32 flat vector to the concatenated bytes of `layout`."""
    if flat.ndim != 1 or flat.size != layout_elements(layout):
        raise ValidationError("flat vector does not match the model layout")
    parts = []
    start = 0
    for spec in layout:
        part = flat[start : start + spec.elements].astype(np.dtype(spec.dtype), copy=False)
        parts.append(part.tobytes())
        start += spec.elements
    return b"".join(parts)


def bytes_to_flat(data: bytes | bytearray | memoryview, layout: Sequence[TensorSpec]) -> np.ndarray:
    """Parse concatenated tensor bytes into one float32 flat vector (copying)."""
    if len(data) != layout_bytes(layout):
        raise ValidationError(
            f"model bytes: got {len(data)}, layout needs {layout_bytes(layout)}"
        )
    out = np.empty(layout_elements(layout), dtype=np.float32)
    offset = 0
    start = 0
    for spec in layout:
        arr = np.frombuffer(data, dtype=np.dtype(spec.dtype), count=spec.elements, offset=offset)
        if not np.all(np.isfinite(arr)):
            raise ValidationError(f"tensor {spec.name!r} holds non-finite values")
        out[start : start + spec.elements] = arr
        offset += spec.nbytes
        start += spec.elements
    return out
