"""AEAD: round trip, and every tampering is one CryptoError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.errors import CryptoError, ValidationError
from common.crypto.aead import NONCE_BYTES, TAG_BYTES, open_sealed, seal, share_associated_data
from common.crypto.random import DeterministicRandom

KEY = DeterministicRandom(b"aead-key")(32)
AD = share_associated_data(sender="site-a", recipient="site-b", round_number=3, session_id=b"s")


def test_round_trip_and_layout() -> None:
    rng = DeterministicRandom(b"nonce")
    sealed = seal(KEY, b"share bundle", associated_data=AD, rng=rng)
    assert len(sealed) == NONCE_BYTES + len(b"share bundle") + TAG_BYTES
    assert open_sealed(KEY, sealed, associated_data=AD) == b"share bundle"
    # Fresh nonce per message: the same plaintext encrypts differently.
    assert seal(KEY, b"share bundle", associated_data=AD, rng=rng) != sealed
    empty = seal(KEY, b"", associated_data=b"", rng=rng)
    assert open_sealed(KEY, empty, associated_data=b"") == b""


@settings(max_examples=40, deadline=None)
@given(
    plaintext=st.binary(min_size=0, max_size=80),
    position=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
)
def test_any_flipped_byte_is_rejected(plaintext: bytes, position: int, flip: int) -> None:
    sealed = bytearray(seal(KEY, plaintext, associated_data=AD, rng=DeterministicRandom(b"n")))
    sealed[position % len(sealed)] ^= flip
    with pytest.raises(CryptoError):
        open_sealed(KEY, bytes(sealed), associated_data=AD)


def test_wrong_associated_data_wrong_key_truncation() -> None:
    sealed = seal(KEY, b"secret", associated_data=AD, rng=DeterministicRandom(b"n"))
    other_ad = share_associated_data(
        sender="site-b", recipient="site-a", round_number=3, session_id=b"s"
    )
    for bad_ad in (other_ad, b"", AD + b"x"):
        with pytest.raises(CryptoError):
            open_sealed(KEY, sealed, associated_data=bad_ad)
    with pytest.raises(CryptoError):
        open_sealed(DeterministicRandom(b"other")(32), sealed, associated_data=AD)
    for cut in (0, NONCE_BYTES, NONCE_BYTES + TAG_BYTES - 1, len(sealed) - 1):
        with pytest.raises(CryptoError):
            open_sealed(KEY, sealed[:cut], associated_data=AD)
    with pytest.raises(CryptoError):
        open_sealed(KEY, sealed + b"\x00", associated_data=AD)


def test_key_length_is_validated() -> None:
    with pytest.raises(ValidationError):
        seal(b"short", b"x", associated_data=b"", rng=DeterministicRandom(b"n"))
    with pytest.raises(ValidationError):
        open_sealed(bytes(31), bytes(40), associated_data=b"")


def test_share_associated_data_binds_every_field() -> None:
    base = {"sender": "a", "recipient": "b", "round_number": 1, "session_id": b"s"}
    variants = [
        {**base, "sender": "c"},
        {**base, "recipient": "c"},
        {**base, "round_number": 2},
        {**base, "session_id": b"t"},
        {**base, "sender": "ab", "recipient": ""},
    ]
    reference = share_associated_data(**base)  # type: ignore[arg-type]
    encoded = {share_associated_data(**v) for v in variants}  # type: ignore[arg-type]
    assert reference not in encoded
    assert len(encoded) == len(variants)
