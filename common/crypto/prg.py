"""The mask PRG of secure aggregation: ChaCha20 keystream read as uint32 words.

SecAgg+ masks (Bonawitz et al. 2017, section 4) are PRG(seed) vectors in Z_{2^32}:
the self mask PRG(b_u) and pairwise masks +/-PRG(s_uv). The PRG is the ChaCha20
keystream (RFC 8439 block function, as exposed by OpenSSL: 16-byte "nonce" = 32-bit
little-endian block counter || 96-bit nonce, all zero here) keyed by the 32-byte seed,
read as little-endian uint32. A zero nonce is safe because every seed is a fresh
HKDF/random key used for exactly one mask.

ChaCha20 and AES-256-CTR measured the same on the 2-core test machine (about 0.83 G
uint32/s/core each through `update_into`); ChaCha20 is chosen because it stays fast
and constant-time on hosts without AES-NI.

This is the hot path of a round (n_neighbours + 1 seeds times the model size per
site, the same again at the coordinator for dropped sites), so `apply_masks` streams
the keystream through one preallocated scratch window that stays cache-resident and
adds it into the target in place: no allocation proportional to the model size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms

from common.core.errors import ValidationError

SEED_BYTES = 32
MASK_CHUNK_ELEMENTS = 1 << 16
"""256 KiB of uint32 per window: the window and the keystream scratch (512 KiB) stay in
a core's L2 cache while every seed is added; 1 MiB windows spill to L3 and cost ~30%
more per seed (1.4 vs 1.07 ms per 10^6 words per seed, measured on the 2-core VM)."""
_WORD_BYTES = 4
_ZERO_NONCE = bytes(16)
_LITTLE_ENDIAN_UINT32 = np.dtype("<u4")
_UPDATE_INTO_SLACK = 15


def _keystream(seed: bytes) -> CipherContext:
    if not isinstance(seed, bytes | bytearray) or len(seed) != SEED_BYTES:
        raise ValidationError(f"mask seeds must be {SEED_BYTES} bytes")
    return Cipher(algorithms.ChaCha20(bytes(seed), _ZERO_NONCE), mode=None).encryptor()


def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """PRG(seed) as a fresh uint32 vector of `length` words (allocates; for small use)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValidationError("mask length must be a non-negative integer")
    stream = _keystream(seed).update(bytes(length * _WORD_BYTES))
    return np.frombuffer(stream, dtype=_LITTLE_ENDIAN_UINT32).astype(np.uint32)


def apply_masks(
    target: np.ndarray, *, add: Sequence[bytes] = (), subtract: Sequence[bytes] = ()
) -> None:
    """In place, modulo 2**32: target += PRG(s) for s in add; target -= PRG(s) for s in subtract.

    `target` must be a C-contiguous uint32 array (any shape; treated as flat). Equal to
    using `expand_mask` for every seed, but streams in MASK_CHUNK_ELEMENTS windows: for
    each window, every seed's cipher context (one per seed, kept across windows so the
    keystream continues) writes into the same scratch buffer, which is then added into
    the window while both are still in cache.
    """
    if not isinstance(target, np.ndarray) or target.dtype != np.uint32:
        raise ValidationError("mask target must be a numpy uint32 array")
    if not target.flags.c_contiguous or not target.flags.writeable:
        raise ValidationError("mask target must be C-contiguous and writeable")
    flat = target.reshape(-1)  # a view, never a copy, for a C-contiguous array
    operations = [(_keystream(seed), np.add) for seed in add] + [
        (_keystream(seed), np.subtract) for seed in subtract
    ]
    total = flat.size
    if not operations or total == 0:
        return
    window = min(MASK_CHUNK_ELEMENTS, total)
    # cryptography's update_into requires len(buf) >= len(data) + block_size - 1. ChaCha20
    # has block size 1, so len(data) suffices today; 15 spare bytes keep this correct for
    # a 128-bit block cipher (AES-CTR) too, at no cost.
    zeros = memoryview(bytes(window * _WORD_BYTES))
    scratch = bytearray(window * _WORD_BYTES + _UPDATE_INTO_SLACK)
    scratch_words = np.frombuffer(scratch, dtype=_LITTLE_ENDIAN_UINT32, count=window)
    # On a big-endian host the keystream words would need a byte swap; refuse rather
    # than silently computing different masks from the other parties.
    if not scratch_words.dtype.isnative:
        raise ValidationError("apply_masks requires a little-endian host")
    for start in range(0, total, window):
        size = min(window, total - start)
        target_window = flat[start : start + size]
        keystream_words = scratch_words[:size]
        zero_bytes = zeros[: size * _WORD_BYTES]
        for context, operation in operations:
            context.update_into(zero_bytes, scratch)
            operation(target_window, keystream_words, out=target_window)
