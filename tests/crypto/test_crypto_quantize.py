"""Fixed-point quantization into Z_{2^32}: range, error bound, unbiasedness, no wrap."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.errors import ValidationError
from common.crypto.prg import apply_masks
from common.crypto.quantize import (
    MAX_BITS,
    bits_for_sites,
    decode_sum,
    dequantize_sum,
    encode_update,
    max_integer_for_sites,
    quantize,
)
from common.crypto.random import DeterministicRandom, numpy_generator

VECTORS = Path(__file__).parent.parent / "vectors"


@settings(max_examples=60, deadline=None)
@given(n_sites=st.integers(min_value=1, max_value=2**31))
def test_bits_for_sites_is_the_largest_safe_choice(n_sites: int) -> None:
    bits = bits_for_sites(n_sites)
    assert 1 <= bits <= MAX_BITS
    assert n_sites * (2**bits - 1) < 2**32
    assert bits == MAX_BITS or n_sites * (2 ** (bits + 1) - 1) >= 2**32
    limit = max_integer_for_sites(n_sites)
    assert n_sites * limit < 2**32 <= n_sites * (limit + 1)


def test_bits_for_sites_edges() -> None:
    assert bits_for_sites(1) == MAX_BITS == 24
    assert bits_for_sites(256) == 24  # 256 * (2**24 - 1) = 2**32 - 256
    assert bits_for_sites(257) == 23
    assert bits_for_sites(2**31) == 1
    for bad in (0, -1, 2**32):
        with pytest.raises(ValidationError):
            bits_for_sites(bad)
    with pytest.raises(ValidationError):
        max_integer_for_sites(0)


finite = st.floats(min_value=-10, max_value=10, allow_nan=False, width=32)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(finite, min_size=1, max_size=300),
    clip=st.floats(min_value=1e-3, max_value=5),
    bits=st.integers(min_value=2, max_value=MAX_BITS),
    seed=st.binary(min_size=1, max_size=4),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_round_trip_error_is_below_one_step(
    values: list[float], clip: float, bits: int, seed: bytes, dtype: type
) -> None:
    x: np.ndarray = np.array(values, dtype=dtype)
    out = np.empty(x.size, np.uint32)
    quantize(x, clip=clip, bits=bits, rng=numpy_generator(DeterministicRandom(seed)), out=out)
    assert int(out.max()) <= 2**bits - 1
    restored = dequantize_sum(out, clip=clip, bits=bits, count=1)
    step = 2 * clip / (2**bits - 1)
    clipped = np.clip(x.astype(np.float64), -clip, clip)
    assert np.all(np.abs(restored - clipped) <= step * (1 + 1e-9))


def test_sum_of_sites_dequantizes_to_the_sum() -> None:
    n_sites, clip, length = 50, 0.5, 2000
    bits = bits_for_sites(n_sites)
    rng = numpy_generator(DeterministicRandom(b"sum"))
    updates = rng.uniform(-0.6, 0.6, size=(n_sites, length))
    total = np.zeros(length, np.uint32)
    quantized = np.empty(length, np.uint32)
    for update in updates:
        quantize(update, clip=clip, bits=bits, rng=rng, out=quantized)
        total += quantized
    restored = dequantize_sum(total, clip=clip, bits=bits, count=n_sites)
    expected = np.clip(updates, -clip, clip).sum(axis=0)
    step = 2 * clip / (2**bits - 1)
    assert np.all(np.abs(restored - expected) <= n_sites * step)
    # Errors of independent unbiased roundings mostly cancel: far below the worst case.
    assert np.abs(restored - expected).mean() < 0.2 * n_sites * step


def test_stochastic_rounding_is_unbiased() -> None:
    bits, clip, trials = 4, 1.0, 20_000
    step = 2 * clip / (2**bits - 1)
    x_value = 0.3 + step * 0.37  # deliberately between grid points
    x = np.full(trials, x_value)
    out = np.empty(trials, np.uint32)
    quantize(x, clip=clip, bits=bits, rng=numpy_generator(DeterministicRandom(b"bias")), out=out)
    restored = dequantize_sum(out, clip=clip, bits=bits, count=1)
    assert set(np.unique(restored).round(9)) <= {
        round(float(v), 9) for v in (restored.min(), restored.min() + step)
    }
    standard_error = restored.std() / np.sqrt(trials)
    assert standard_error > 0
    assert abs(restored.mean() - x_value) < 4 * standard_error


def test_result_does_not_depend_on_scratch_size() -> None:
    x = numpy_generator(DeterministicRandom(b"x")).normal(size=5_001)
    reference = np.empty(x.size, np.uint32)
    quantize(x, clip=2.0, bits=16, rng=numpy_generator(DeterministicRandom(b"r")), out=reference)
    for scratch_length in (2, 7, 1000, 20_000):
        out = np.empty(x.size, np.uint32)
        scratch = np.empty(scratch_length, np.float64)
        rng = numpy_generator(DeterministicRandom(b"r"))
        quantize(x, clip=2.0, bits=16, rng=rng, out=out, scratch=scratch)
        assert np.array_equal(out, reference)


def test_pinned_vectors() -> None:
    vectors = json.loads((VECTORS / "pinned_quantize.json").read_text())
    x = np.array(vectors["input"], np.float64)
    for case in vectors["cases"]:
        out = np.empty(x.size, np.uint32)
        rng = numpy_generator(DeterministicRandom(case["rng_seed"].encode()))
        quantize(x, clip=case["clip"], bits=case["bits"], rng=rng, out=out)
        assert out.tolist() == case["quantized"]
        assert out[0] == out[1] == 0  # clipped at -clip
        assert out[-1] == out[-2] == 2 ** case["bits"] - 1  # clipped at +clip


def test_encode_update_and_decode_sum_with_masks() -> None:
    """A miniature SecAgg round: masked encodings sum to the exact integers and floats."""
    n_sites, clip, length = 5, 1.0, 333
    bits = bits_for_sites(n_sites)
    rng = numpy_generator(DeterministicRandom(b"encode"))
    updates = [rng.uniform(-1, 1, size=length).astype(np.float32) for _ in range(n_sites)]
    integers = [[100 + i, 3 * i, max_integer_for_sites(n_sites)] for i in range(n_sites)]
    pair_seeds = [DeterministicRandom(f"pair{i}".encode())(32) for i in range(n_sites)]
    total = np.zeros(length + 3, np.uint32)
    for i in range(n_sites):
        out = np.empty(length + 3, np.uint32)
        encode_update(
            updates[i], integers=integers[i], clip=clip, bits=bits, n_sites=n_sites,
            rng=rng, out=out,
        )
        # Ring masks: site i adds seed i and subtracts seed i-1, so they cancel in the sum.
        apply_masks(out, add=[pair_seeds[i]], subtract=[pair_seeds[i - 1]])
        total += out
    floats, sums = decode_sum(total, float_length=length, clip=clip, bits=bits, count=n_sites)
    assert sums == [sum(column) for column in zip(*integers)]
    assert sums[2] < 2**32
    step = 2 * clip / (2**bits - 1)
    assert np.all(np.abs(floats - np.sum(updates, axis=0)) <= n_sites * step)


def test_validation() -> None:
    rng = numpy_generator(DeterministicRandom(b"v"))
    x = np.zeros(4)
    out = np.empty(4, np.uint32)
    bad_calls: list[Callable[[], object]] = [
        lambda: quantize(x, clip=0.0, bits=8, rng=rng, out=out),
        lambda: quantize(x, clip=float("inf"), bits=8, rng=rng, out=out),
        lambda: quantize(x, clip=1.0, bits=0, rng=rng, out=out),
        lambda: quantize(x, clip=1.0, bits=MAX_BITS + 1, rng=rng, out=out),
        lambda: quantize(x, clip=1.0, bits=8, rng=rng, out=np.empty(3, np.uint32)),
        lambda: quantize(x, clip=1.0, bits=8, rng=rng, out=np.empty(4, np.int64)),
        lambda: quantize(x.astype(np.int32), clip=1.0, bits=8, rng=rng, out=out),
        lambda: quantize(np.array([0.0, np.nan, 0, 0]), clip=1.0, bits=8, rng=rng, out=out),
        lambda: quantize(x, clip=1.0, bits=8, rng=rng, out=out, scratch=np.empty(1)),
        lambda: dequantize_sum(out, clip=1.0, bits=24, count=257),
        lambda: dequantize_sum(out, clip=1.0, bits=8, count=0),
        lambda: dequantize_sum(out.astype(np.int64), clip=1.0, bits=8, count=1),
        lambda: encode_update(
            x, integers=[max_integer_for_sites(3) + 1], clip=1.0, bits=8, n_sites=3,
            rng=rng, out=np.empty(5, np.uint32),
        ),
        lambda: encode_update(
            x, integers=[-1], clip=1.0, bits=8, n_sites=3, rng=rng, out=np.empty(5, np.uint32)
        ),
        lambda: encode_update(
            x, integers=[1], clip=1.0, bits=8, n_sites=3, rng=rng, out=np.empty(4, np.uint32)
        ),
        lambda: encode_update(
            x, integers=[], clip=1.0, bits=24, n_sites=257, rng=rng, out=np.empty(4, np.uint32)
        ),
        lambda: decode_sum(out, float_length=5, clip=1.0, bits=8, count=1),
    ]
    for call in bad_calls:
        with pytest.raises(ValidationError):
            call()
