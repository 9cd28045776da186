"""Batched Shamir secret sharing (Shamir 1979) of 32-byte secrets over GF(PRIME).

SecAgg+ shares each site's self-mask seed and mask-agreement secret key among its
neighbours (Bonawitz et al. 2017, section 4; Bell et al. 2020, section 3). We share the
raw 32-byte values directly in a field just larger than 2**256, so one secret is one
field element: no chunking of PEM encodings into many small polynomials.

Holders are identified by x-coordinates ``1 <= x < PRIME`` (1-based holder indices);
x = 0 is the secret itself and must never be handed out.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from common.core.errors import CryptoError, ValidationError
from common.crypto.random import RandomSource

PRIME = 2**256 + 297
"""The smallest prime above 2**256 (checked by Miller-Rabin in tests/crypto)."""

SECRET_BYTES = 32
SHARE_BYTES = (PRIME.bit_length() + 7) // 8  # 33: one y-value, big-endian, fixed width
_SECRET_LIMIT = 2**256
_COEFFICIENT_MASK = (1 << PRIME.bit_length()) - 1


def _random_field_element(rng: RandomSource) -> int:
    """Uniform in [0, PRIME) by rejection sampling 257-bit candidates (about 2 tries)."""
    while True:
        candidate = int.from_bytes(rng(SHARE_BYTES), "big") & _COEFFICIENT_MASK
        if candidate < PRIME:
            return candidate


def _check_xs(xs: Sequence[int]) -> None:
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x < PRIME:
            raise ValidationError("Shamir x-coordinates must be integers in [1, PRIME)")
    if len(set(xs)) != len(xs):
        raise ValidationError("Shamir x-coordinates must be distinct")


def _check_threshold(threshold: int, holders: int) -> None:
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ValidationError("Shamir threshold must be a positive integer")
    if threshold > holders:
        raise ValidationError(f"threshold {threshold} exceeds the {holders} holders given")


def split_secrets(
    secrets: Sequence[bytes], *, threshold: int, xs: Sequence[int], rng: RandomSource
) -> list[list[bytes]]:
    """Split each 32-byte secret with its own random polynomial of degree threshold - 1.

    Returns ``shares[holder_index][secret_index]``, each a SHARE_BYTES big-endian
    y-value for holder ``xs[holder_index]``. Any `threshold` holders can reconstruct;
    fewer learn nothing (each coefficient is uniform in the field).
    """
    _check_xs(xs)
    _check_threshold(threshold, len(xs))
    values = []
    for secret in secrets:
        if not isinstance(secret, bytes | bytearray) or len(secret) != SECRET_BYTES:
            raise ValidationError(f"Shamir secrets must be {SECRET_BYTES} bytes")
        values.append(int.from_bytes(secret, "big"))
    polynomials = [
        [value] + [_random_field_element(rng) for _ in range(threshold - 1)] for value in values
    ]
    shares: list[list[bytes]] = []
    for x in xs:
        row = []
        for coefficients in polynomials:
            y = 0
            for coefficient in reversed(coefficients):  # Horner's rule
                y = (y * x + coefficient) % PRIME
            row.append(y.to_bytes(SHARE_BYTES, "big"))
        shares.append(row)
    return shares


@functools.lru_cache(maxsize=1024)
def lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Lagrange basis values at 0: l_i(0) = prod_{j != i} x_j / (x_j - x_i) mod PRIME.

    Cached per x-tuple: in a round the same survivors reconstruct many secrets.
    """
    _check_xs(xs)
    coefficients = []
    for i, x_i in enumerate(xs):
        numerator = 1
        denominator = 1
        for j, x_j in enumerate(xs):
            if j != i:
                numerator = numerator * x_j % PRIME
                denominator = denominator * (x_j - x_i) % PRIME
        coefficients.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return tuple(coefficients)


def reconstruct_secrets(
    xs: Sequence[int], ys: Sequence[Sequence[bytes]], *, threshold: int
) -> list[bytes]:
    """Interpolate at 0 from exactly the first `threshold` holders given.

    ``ys[holder_index][secret_index]`` as returned by `split_secrets`. Raises
    ValidationError for malformed input and CryptoError when the result is not a
    32-byte secret (wrong or tampered shares: a random field element is >= 2**256 with
    probability about 297 / 2**256 only, so this is a sanity check, not authentication).
    """
    if len(xs) != len(ys):
        raise ValidationError("xs and ys must have one entry per holder")
    _check_threshold(threshold, len(xs))
    chosen_xs = tuple(xs[:threshold])
    chosen_ys = ys[:threshold]
    secret_count = len(chosen_ys[0])
    if any(len(row) != secret_count for row in chosen_ys):
        raise ValidationError("every holder must give the same number of shares")
    basis = lagrange_at_zero(chosen_xs)
    totals = [0] * secret_count
    for weight, row in zip(basis, chosen_ys):
        for index, share in enumerate(row):
            if not isinstance(share, bytes | bytearray) or len(share) != SHARE_BYTES:
                raise ValidationError(f"Shamir shares must be {SHARE_BYTES} bytes")
            y = int.from_bytes(share, "big")
            if y >= PRIME:
                raise ValidationError("Shamir share is not a field element")
            totals[index] += weight * y
    secrets = []
    for total in totals:
        value = total % PRIME
        if value >= _SECRET_LIMIT:
            raise CryptoError()
        secrets.append(value.to_bytes(SECRET_BYTES, "big"))
    return secrets
