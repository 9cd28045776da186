"""Fixed-point encoding of model updates into Z_{2^32} for secure aggregation.

SecAgg sums vectors in the ring Z_{2^32}, so each site maps its (already clipped and
DP-noised) float update onto integers in [0, (1 << bits) - 1] with unbiased stochastic
rounding (the coordinator only ever dequantizes the sum). `bits` is chosen per
federation so that the sum of all n sites cannot wrap around 2**32: then the ring sum
equals the integer sum, which is the exactness SecAgg+ promises (Bonawitz et al. 2017,
section 3; Bell et al. 2020 discuss the same choice of modulus).

Layout of one masked vector: ``[quantized floats ..., exact integers ...]``; the
integers carry the FedAvg weight (sample count) and evaluation histogram counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from common.core.errors import ValidationError

RING_BITS = 32
RING_SIZE = 1 << RING_BITS
MAX_BITS = 24
"""Cap on quantization bits: float32 updates carry 24 significant bits, and the DP
noise already dwarfs a step of 2**-24 of the clipping range, so more bits would only
reduce the number of sites the ring can hold without adding accuracy."""

QUANTIZE_CHUNK_ELEMENTS = 1 << 16
"""Elements processed per window; the default scratch is 2 windows of float64 (1 MiB)."""


def bits_for_sites(n_sites: int) -> int:
    """Largest bits <= MAX_BITS with n_sites * ((1 << bits) - 1) < 2**32 (a sum cannot wrap)."""
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise ValidationError("n_sites must be a positive integer")
    for bits in range(MAX_BITS, 0, -1):
        if n_sites * ((1 << bits) - 1) < RING_SIZE:
            return bits
    raise ValidationError(f"{n_sites} sites cannot share a 32-bit ring without wrap-around")


def max_integer_for_sites(n_sites: int) -> int:
    """Largest integer element a site may send so the sum over n_sites cannot wrap."""
    if isinstance(n_sites, bool) or not isinstance(n_sites, int) or n_sites < 1:
        raise ValidationError("n_sites must be a positive integer")
    return (RING_SIZE - 1) // n_sites


def _check_range(*, clip: float, bits: int) -> float:
    """Validate and return the scale factor levels / (2 * clip)."""
    if not (math.isfinite(clip) and clip > 0):
        raise ValidationError("clip must be a positive finite number")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValidationError(f"bits must be an integer in [1, {MAX_BITS}]")
    return ((1 << bits) - 1) / (2.0 * clip)


def quantize(
    x: np.ndarray,
    *,
    clip: float,
    bits: int,
    rng: np.random.Generator,
    out: np.ndarray,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """Clip x to [-clip, clip], map onto [0, (1 << bits) - 1], round stochastically into out.

    Rounding is floor(y + u) with u ~ U[0, 1), i.e. floor(y) + 1 with probability
    frac(y): unbiased (E = y) with error below one step 2 * clip / ((1 << bits) - 1).
    Works in windows through `scratch` (float64, any length >= 2; default: allocated
    once at 2 * QUANTIZE_CHUNK_ELEMENTS), so memory does not grow with len(x). NaN in
    x raises ValidationError (out may then be partly written). Returns out.
    """
    scale = _check_range(clip=clip, bits=bits)
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float64):
        raise ValidationError("quantize input must be a float32 or float64 numpy array")
    if not isinstance(out, np.ndarray) or out.dtype != np.uint32 or out.ndim != 1:
        raise ValidationError("quantize output must be a 1-D uint32 numpy array")
    if out.size != x.size:
        raise ValidationError(f"output length {out.size} != input length {x.size}")
    flat_x = x.reshape(-1)
    if scratch is None:
        scratch = np.empty(2 * min(QUANTIZE_CHUNK_ELEMENTS, max(x.size, 1)), np.float64)
    elif scratch.dtype != np.float64 or scratch.ndim != 1 or scratch.size < 2:
        raise ValidationError("scratch must be a 1-D float64 array of length >= 2")
    window = scratch.size // 2
    levels = float((1 << bits) - 1)
    for start in range(0, flat_x.size, window):
        size = min(window, flat_x.size - start)
        values = scratch[:size]
        uniforms = scratch[window : window + size]
        np.clip(flat_x[start : start + size], -clip, clip, out=values)
        if math.isnan(float(values.sum())):
            raise ValidationError("quantize input contains NaN")
        values += clip
        values *= scale
        rng.random(out=uniforms)
        values += uniforms
        np.floor(values, out=values)
        # Float rounding can land one ulp outside [0, levels] (a float32 input clipped to
        # -clip is slightly below -clip in float64); keep the range exact, never wrap.
        np.clip(values, 0.0, levels, out=values)
        np.copyto(out[start : start + size], values, casting="unsafe")
    return out


def _check_sum_range(*, bits: int, count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValidationError("count must be a positive integer")
    if count * ((1 << bits) - 1) >= RING_SIZE:
        raise ValidationError(f"a sum of {count} {bits}-bit values may have wrapped mod 2**32")


def dequantize_sum(
    total: np.ndarray,
    *,
    clip: float,
    bits: int,
    count: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Float64 sum of the `count` original vectors whose quantized values sum to `total`.

    Each quantized q = (x + clip) * scale, so sum(x) = sum(q) / scale - count * clip.
    """
    scale = _check_range(clip=clip, bits=bits)
    _check_sum_range(bits=bits, count=count)
    if not isinstance(total, np.ndarray) or total.dtype != np.uint32:
        raise ValidationError("dequantize_sum input must be a uint32 numpy array")
    if out is None:
        out = np.empty(total.shape, np.float64)
    elif out.dtype != np.float64 or out.shape != total.shape:
        raise ValidationError("dequantize_sum out must be float64 with the input's shape")
    np.multiply(total, 1.0 / scale, out=out)
    out -= count * clip
    return out


def encode_update(
    update: np.ndarray,
    *,
    integers: Sequence[int],
    clip: float,
    bits: int,
    n_sites: int,
    rng: np.random.Generator,
    out: np.ndarray,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """Write ``[quantize(update), *integers]`` into out (uint32, len(update) + len(integers)).

    Refuses bits or integers for which the sum over n_sites could wrap around 2**32.
    """
    _check_range(clip=clip, bits=bits)
    limit = max_integer_for_sites(n_sites)
    if n_sites * ((1 << bits) - 1) >= RING_SIZE:
        raise ValidationError(f"{bits} bits are too many for {n_sites} sites")
    if not isinstance(update, np.ndarray):
        raise ValidationError("update must be a numpy array")
    for value in integers:
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise ValidationError("update integers must be ints")
        if not 0 <= int(value) <= limit:
            raise ValidationError(f"update integer {value} outside [0, {limit}]")
    if not isinstance(out, np.ndarray) or out.dtype != np.uint32 or out.ndim != 1:
        raise ValidationError("encode_update output must be a 1-D uint32 numpy array")
    float_length = update.size
    if out.size != float_length + len(integers):
        raise ValidationError("encode_update output length must be len(update) + len(integers)")
    quantize(update, clip=clip, bits=bits, rng=rng, out=out[:float_length], scratch=scratch)
    out[float_length:] = np.asarray([int(v) for v in integers], dtype=np.uint32)
    return out


def decode_sum(
    total: np.ndarray, *, float_length: int, clip: float, bits: int, count: int
) -> tuple[np.ndarray, list[int]]:
    """Split an aggregated vector into the float64 sum of updates and the integer sums."""
    if not isinstance(total, np.ndarray) or total.dtype != np.uint32 or total.ndim != 1:
        raise ValidationError("decode_sum input must be a 1-D uint32 numpy array")
    if not 0 <= float_length <= total.size:
        raise ValidationError("float_length outside the aggregated vector")
    floats = dequantize_sum(total[:float_length], clip=clip, bits=bits, count=count)
    return floats, [int(v) for v in total[float_length:]]
