"""The randomized Hadamard rotation of the distributed discrete Gaussian mechanism.

Kairouz, Liu, Steinke (ICML 2021, "The Distributed Discrete Gaussian Mechanism for
Federated Learning with Secure Aggregation", section 4.2) flatten each client vector
with U = H D / sqrt(D) before rounding: D a diagonal of random signs drawn from a seed
all sites share, H the D x D Walsh-Hadamard matrix (D a power of two). U is orthogonal,
so norms and the Gaussian noise are unchanged, while every coordinate of U x becomes a
Rademacher sum with variance ||x||^2 / D: no single coordinate carries a large value,
so the ring needs few bits and rounding error spreads evenly.

The transform runs in place in O(D log D) (the butterfly of the fast Walsh-Hadamard
transform), with the stages below CACHE_BLOCK done block by block so that they stay in
cache; the only scratch is one half-length buffer.
"""

from __future__ import annotations

import math

import numpy as np

from common.core.errors import ValidationError
from common.crypto.prg import SEED_BYTES, expand_mask

CACHE_BLOCK = 1 << 14
"""Elements per cache-resident block (128 KiB of float64) for the short butterfly stages."""


def padded_length(dim: int) -> int:
    """The smallest power of two >= dim (the Hadamard transform needs one)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise ValidationError("dimension must be a positive integer")
    return 1 << (dim - 1).bit_length()


def _butterflies(x: np.ndarray, scratch: np.ndarray, *, start: int, stop: int) -> None:
    """Stages with half-width h in [start, stop) on x (length a multiple of 2*stop)."""
    h = start
    while h < stop:
        pairs = x.reshape(-1, 2, h)
        low, high = pairs[:, 0, :], pairs[:, 1, :]
        saved = scratch[: x.size // 2].reshape(-1, h)
        np.copyto(saved, low)
        low += high
        np.subtract(saved, high, out=high)
        h *= 2


def fwht(x: np.ndarray) -> np.ndarray:
    """In place: x <- H x, the unnormalized Walsh-Hadamard transform (H H = D * I).

    x must be a 1-D C-contiguous float64 array whose length is a power of two.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.float64 or x.ndim != 1:
        raise ValidationError("fwht input must be a 1-D float64 numpy array")
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise ValidationError("fwht input must be C-contiguous and writeable")
    n = x.size
    if n == 0 or n & (n - 1):
        raise ValidationError("fwht length must be a power of two")
    block = min(n, CACHE_BLOCK)
    scratch = np.empty(max(n // 2, 1), np.float64)
    if block > 1:
        for offset in range(0, n, block):
            _butterflies(x[offset : offset + block], scratch, start=1, stop=block // 2 + 1)
    if n > block:
        _butterflies(x, scratch, start=block, stop=n)
    return x


def _sign_mask(seed: bytes, length: int) -> np.ndarray:
    """Bool mask (True = flip the sign) of `length` Rademacher signs from PRG(seed)."""
    if not isinstance(seed, bytes | bytearray) or len(seed) != SEED_BYTES:
        raise ValidationError(f"rotation seeds must be {SEED_BYTES} bytes")
    words = expand_mask(bytes(seed), (length + 31) // 32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return bits[:length].astype(bool)


def rotate(x: np.ndarray, *, seed: bytes) -> np.ndarray:
    """In place: x <- H D x / sqrt(len(x)), with the signs D expanded from `seed`."""
    flips = _sign_mask(seed, x.size)
    np.negative(x, out=x, where=flips)
    fwht(x)
    x *= 1.0 / math.sqrt(x.size)
    return x


def unrotate(y: np.ndarray, *, seed: bytes) -> np.ndarray:
    """In place: y <- D H y / sqrt(len(y)), the inverse (= transpose) of `rotate`."""
    fwht(y)
    y *= 1.0 / math.sqrt(y.size)
    flips = _sign_mask(seed, y.size)
    np.negative(y, out=y, where=flips)
    return y
