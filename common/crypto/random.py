"""Sources of randomness, passed explicitly into protocol and maths code.

Protocol code never calls ``os.urandom`` itself; it takes a `RandomSource` so that
production uses the OS CSPRNG while tests and benchmarks can replay a round exactly.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from common.core.errors import ValidationError

RandomSource = Callable[[int], bytes]
"""``rng(n)`` returns ``n`` uniformly random bytes."""


def system_random(length: int) -> bytes:
    """The production source: the operating system's CSPRNG."""
    if length < 0:
        raise ValidationError("random length must be non-negative")
    return os.urandom(length)


_DRBG_LABEL = b"medfed/v1/deterministic-random"


class DeterministicRandom:
    """A seeded, reproducible byte stream: AES-256-CTR keyed by SHA-256(label || seed).

    FOR TESTS AND BENCHMARKS ONLY. Anyone who knows the seed knows every "random" byte,
    so it must never feed key generation, masks or shares in production.
    """

    def __init__(self, seed: bytes) -> None:
        key = hashlib.sha256(_DRBG_LABEL + bytes(seed)).digest()
        self._encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()

    def __call__(self, length: int) -> bytes:
        if length < 0:
            raise ValidationError("random length must be non-negative")
        # The CTR keystream continues across calls, so successive calls never repeat.
        return self._encryptor.update(bytes(length))

    def __repr__(self) -> str:
        return "DeterministicRandom(<seed hidden>)"


def numpy_generator(rng: RandomSource) -> np.random.Generator:
    """A numpy Generator seeded from 32 bytes of `rng`.

    Only for quantization rounding noise (which needs fast uniform floats, not secrecy);
    never for masks or secrets, which must come from the AES/ChaCha20 PRG in `prg.py`.
    """
    seed = int.from_bytes(rng(32), "big")
    return np.random.Generator(np.random.PCG64(seed))
