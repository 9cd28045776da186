"""Shamir sharing over GF(2**256 + 297): correctness, threshold, pinned vector, speed."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.errors import CryptoError, ValidationError
from common.crypto.random import DeterministicRandom
from common.crypto.shamir import (
    PRIME,
    SECRET_BYTES,
    SHARE_BYTES,
    lagrange_at_zero,
    reconstruct_secrets,
    split_secrets,
)

VECTORS = Path(__file__).parent.parent / "vectors"

# The first 40 primes as Miller-Rabin bases: a composite passes all of them with
# probability below 4**-40 even for adversarially chosen inputs (and PRIME is not).
_BASES = [p for p in range(2, 174) if all(p % d for d in range(2, p))][:40]


def _is_probable_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def test_prime_is_the_smallest_prime_above_2_256() -> None:
    assert len(_BASES) == 40
    assert _is_probable_prime(PRIME)
    assert not any(_is_probable_prime(n) for n in range(2**256, PRIME))
    # Sanity of the test itself: known composites / primes.
    assert not _is_probable_prime(2**256 + 1)
    assert _is_probable_prime(2**127 - 1)
    assert not _is_probable_prime(3215031751)  # strong pseudoprime to bases 2, 3, 5, 7
    assert SHARE_BYTES == 33
    assert SECRET_BYTES == 32


@settings(max_examples=30, deadline=None)
@given(
    n_holders=st.integers(min_value=2, max_value=9),
    data=st.data(),
    seed=st.binary(min_size=1, max_size=8),
)
def test_threshold_subsets(n_holders: int, data: st.DataObject, seed: bytes) -> None:
    threshold = data.draw(st.integers(min_value=2, max_value=n_holders))
    rng = DeterministicRandom(seed)
    secrets = [rng(32) for _ in range(data.draw(st.integers(1, 3)))]
    xs = data.draw(
        st.lists(
            st.integers(min_value=1, max_value=PRIME - 1),
            min_size=n_holders,
            max_size=n_holders,
            unique=True,
        )
    )
    shares = split_secrets(secrets, threshold=threshold, xs=xs, rng=rng)
    assert len(shares) == n_holders
    assert all(len(row) == len(secrets) for row in shares)
    assert all(len(share) == SHARE_BYTES for row in shares for share in row)

    order = data.draw(st.permutations(range(n_holders)))
    chosen = order[:threshold]
    assert reconstruct_secrets(
        [xs[i] for i in chosen], [shares[i] for i in chosen], threshold=threshold
    ) == secrets

    # t - 1 shares interpolated as if the threshold were t - 1 give something else
    # (either a different 32-byte value or an out-of-range field element).
    fewer = order[: threshold - 1]
    try:
        wrong = reconstruct_secrets(
            [xs[i] for i in fewer], [shares[i] for i in fewer], threshold=threshold - 1
        )
    except CryptoError:
        return
    assert all(guess != secret for guess, secret in zip(wrong, secrets))


def test_only_first_threshold_holders_are_used() -> None:
    rng = DeterministicRandom(b"first")
    secrets = [rng(32)]
    xs = [1, 2, 3, 4]
    shares = split_secrets(secrets, threshold=2, xs=xs, rng=rng)
    garbage_row = [bytes(SHARE_BYTES)]
    assert reconstruct_secrets(xs, [*shares[:2], garbage_row, garbage_row], threshold=2) == secrets
    with pytest.raises(ValidationError):
        reconstruct_secrets(xs[:1], shares[:1], threshold=2)


def test_pinned_vector() -> None:
    vector = json.loads((VECTORS / "pinned_shamir.json").read_text())
    rng = DeterministicRandom(vector["rng_seed"].encode())
    secrets = [rng(32), rng(32)]
    assert [s.hex() for s in secrets] == vector["secrets"]
    shares = split_secrets(secrets, threshold=vector["threshold"], xs=vector["xs"], rng=rng)
    assert [[s.hex() for s in row] for row in shares] == vector["shares"]
    pinned = [[bytes.fromhex(s) for s in row] for row in vector["shares"]]
    assert reconstruct_secrets(vector["xs"][2:], pinned[2:], threshold=3) == secrets


def test_invalid_interpolation_is_crypto_error() -> None:
    # A constant "polynomial" PRIME - 1 is a valid field element but not a 32-byte secret.
    top = (PRIME - 1).to_bytes(SHARE_BYTES, "big")
    with pytest.raises(CryptoError):
        reconstruct_secrets([1, 2], [[top], [top]], threshold=2)


def test_malformed_inputs_are_validation_errors() -> None:
    rng = DeterministicRandom(b"bad")
    good = [rng(32)]
    for bad_xs in ([0, 1], [1, 1], [1, PRIME], [-1, 2]):
        with pytest.raises(ValidationError):
            split_secrets(good, threshold=2, xs=bad_xs, rng=rng)
    for threshold in (0, 3):
        with pytest.raises(ValidationError):
            split_secrets(good, threshold=threshold, xs=[1, 2], rng=rng)
    with pytest.raises(ValidationError):
        split_secrets([b"short"], threshold=2, xs=[1, 2], rng=rng)
    shares = split_secrets(good, threshold=2, xs=[1, 2], rng=rng)
    with pytest.raises(ValidationError):
        reconstruct_secrets([1, 2], [shares[0], [shares[1][0][:-1]]], threshold=2)
    with pytest.raises(ValidationError):
        reconstruct_secrets([1, 2], [shares[0], [PRIME.to_bytes(SHARE_BYTES, "big")]], threshold=2)
    with pytest.raises(ValidationError):
        reconstruct_secrets([1, 2], [shares[0], [*shares[1], shares[1][0]]], threshold=2)
    with pytest.raises(ValidationError):
        reconstruct_secrets([1, 2], shares[:1], threshold=1)


def test_lagrange_coefficients_sum_to_one_and_are_cached() -> None:
    xs = tuple(random.Random(7).sample(range(1, 10_000), 30))
    coefficients = lagrange_at_zero(xs)
    # Interpolating the constant polynomial 1 must give 1.
    assert sum(coefficients) % PRIME == 1
    hits_before = lagrange_at_zero.cache_info().hits
    assert lagrange_at_zero(xs) is coefficients
    assert lagrange_at_zero.cache_info().hits == hits_before + 1


def test_reconstruction_of_two_secrets_from_30_shares_is_fast() -> None:
    rng = DeterministicRandom(b"speed")
    secrets = [rng(32), rng(32)]
    xs = list(range(1, 51))
    shares = split_secrets(secrets, threshold=30, xs=xs, rng=rng)
    reconstruct_secrets(xs[10:], shares[10:], threshold=30)  # warm the Lagrange cache
    timings = []
    for _ in range(200):
        start = time.perf_counter()
        result = reconstruct_secrets(xs[10:], shares[10:], threshold=30)
        timings.append(time.perf_counter() - start)
    assert result == secrets
    # About 50 us on the 2-core test machine; 1 ms leaves room for a loaded CI runner.
    assert statistics.median(timings) < 1e-3
