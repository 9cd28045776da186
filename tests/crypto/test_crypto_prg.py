"""Mask PRG: pinned keystream, streaming == one-shot, add/subtract cancel exactly."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.errors import ValidationError
from common.crypto.prg import MASK_CHUNK_ELEMENTS, apply_masks, expand_mask
from common.crypto.random import DeterministicRandom

VECTORS = Path(__file__).parent.parent / "vectors"
seeds = st.lists(st.binary(min_size=32, max_size=32), max_size=4)


def _seeds(label: bytes, count: int) -> list[bytes]:
    rng = DeterministicRandom(label)
    return [rng(32) for _ in range(count)]


def test_pinned_vectors() -> None:
    for case in json.loads((VECTORS / "pinned_prg.json").read_text())["cases"]:
        mask = expand_mask(bytes.fromhex(case["seed"]), case["length"])
        assert mask.dtype == np.uint32
        assert mask.shape == (case["length"],)
        assert mask[:4].tolist() == case["first_words"]
        assert mask[-4:].tolist() == case["last_words"]
        assert hashlib.sha256(mask.astype("<u4").tobytes()).hexdigest() == case["sha256_le"]


def test_expand_mask_is_the_chacha20_keystream() -> None:
    # Independent of prg.py: RFC 8439 ChaCha20 with an all-zero 16-byte counter||nonce.
    seed = _seeds(b"chacha", 1)[0]
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), None).encryptor().update(bytes(400))
    assert expand_mask(seed, 100).tolist() == np.frombuffer(stream, "<u4").tolist()
    assert expand_mask(seed, 0).size == 0


@pytest.mark.parametrize(
    "length",
    [0, 1, 5, MASK_CHUNK_ELEMENTS - 1, MASK_CHUNK_ELEMENTS, MASK_CHUNK_ELEMENTS + 1,
     2 * MASK_CHUNK_ELEMENTS + 77],
)
def test_apply_masks_equals_expand_mask(length: int) -> None:
    add, subtract = _seeds(b"add", 3), _seeds(b"sub", 2)
    start = np.arange(length, dtype=np.uint32) * np.uint32(2654435761)
    expected = start.copy()
    for seed in add:
        expected += expand_mask(seed, length)
    for seed in subtract:
        expected -= expand_mask(seed, length)
    target = start.copy()
    apply_masks(target, add=add, subtract=subtract)
    assert np.array_equal(target, expected)
    if length > 0:
        assert not np.array_equal(target, start)


@settings(max_examples=30, deadline=None)
@given(add=seeds, length=st.integers(min_value=0, max_value=3000), value_seed=st.integers(0))
def test_add_then_subtract_is_identity(add: list[bytes], length: int, value_seed: int) -> None:
    values = np.random.default_rng(value_seed).integers(0, 2**32, size=length, dtype=np.uint64)
    original = values.astype(np.uint32)
    target = original.copy()
    apply_masks(target, add=add)
    if add and length >= 4:
        assert not np.array_equal(target, original)
    apply_masks(target, subtract=list(reversed(add)))
    assert np.array_equal(target, original)


def test_pairwise_masks_cancel_in_the_sum() -> None:
    # SecAgg: u adds PRG(s_uv), v subtracts it; the sum of masked inputs is the plain sum.
    s_uv = _seeds(b"pair", 1)[0]
    x_u = np.full(1000, 7, np.uint32)
    x_v = np.full(1000, 2**32 - 3, np.uint32)
    y_u, y_v = x_u.copy(), x_v.copy()
    apply_masks(y_u, add=[s_uv])
    apply_masks(y_v, subtract=[s_uv])
    assert np.array_equal(y_u + y_v, x_u + x_v)


def test_multidimensional_target_is_treated_as_flat() -> None:
    seed = _seeds(b"2d", 1)[0]
    target = np.zeros((3, 5), np.uint32)
    apply_masks(target, add=[seed])
    assert np.array_equal(target.reshape(-1), expand_mask(seed, 15))


def test_distinct_seeds_give_distinct_masks() -> None:
    a, b = _seeds(b"distinct", 2)
    assert not np.array_equal(expand_mask(a, 64), expand_mask(b, 64))


def test_invalid_targets_and_seeds() -> None:
    seed = _seeds(b"bad", 1)[0]
    with pytest.raises(ValidationError):
        apply_masks(np.zeros(4, np.int32), add=[seed])
    with pytest.raises(ValidationError):
        apply_masks(np.zeros(8, np.uint32)[::2], add=[seed])
    read_only = np.zeros(4, np.uint32)
    read_only.flags.writeable = False
    with pytest.raises(ValidationError):
        apply_masks(read_only, add=[seed])
    with pytest.raises(ValidationError):
        apply_masks(np.zeros(4, np.uint32), add=[seed[:16]])
    with pytest.raises(ValidationError):
        expand_mask(seed, -1)
    with pytest.raises(ValidationError):
        expand_mask(b"short", 4)
