"""HKDF (RFC 5869) and X25519 (RFC 7748) against the published vectors, plus our use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common.core.errors import CryptoError, ValidationError
from common.crypto.kdf import KdfInfo, hkdf_sha256
from common.crypto.keyagreement import (
    X25519KeyPair,
    agree,
    derive_key,
    generate_keypair,
    public_key_of,
)
from common.crypto.random import DeterministicRandom

VECTORS = Path(__file__).parent.parent / "vectors"


def _load(name: str) -> Any:
    return json.loads((VECTORS / name).read_text())


@pytest.mark.parametrize(
    "case", _load("rfc5869_hkdf_sha256.json")["cases"], ids=lambda c: c["name"]
)
def test_hkdf_rfc5869(case: dict[str, Any]) -> None:
    okm = hkdf_sha256(
        bytes.fromhex(case["ikm"]),
        salt=bytes.fromhex(case["salt"]),
        info=bytes.fromhex(case["info"]),
        length=case["length"],
    )
    assert okm.hex() == case["okm"]


def test_hkdf_length_bounds() -> None:
    with pytest.raises(ValidationError):
        hkdf_sha256(b"k", salt=b"", info=b"", length=0)
    with pytest.raises(ValidationError):
        hkdf_sha256(b"k", salt=b"", info=b"", length=255 * 32 + 1)


def test_kdf_labels_are_distinct_and_versioned() -> None:
    values = [label.value for label in KdfInfo]
    assert len(set(values)) == len(values) == 4
    assert all(v.startswith(b"medfed/v1/secagg/") for v in values)
    assert KdfInfo.PAIRWISE_MASK_SEED.value == b"medfed/v1/secagg/pairwise-mask-seed"


def test_x25519_rfc7748_scalar_multiplication() -> None:
    vectors = _load("rfc7748_x25519.json")
    for case in vectors["scalar_multiplication"]:
        out = agree(bytes.fromhex(case["scalar"]), bytes.fromhex(case["u_coordinate"]))
        assert out.hex() == case["output"]
    iterated = vectors["iterated"]
    k = u = bytes.fromhex(iterated["start"])
    for step in range(1, 1001):
        k, u = agree(k, u), k
        if step == 1:
            assert k.hex() == iterated["after_1"]
    assert k.hex() == iterated["after_1000"]


def test_x25519_rfc7748_diffie_hellman() -> None:
    dh = _load("rfc7748_x25519.json")["diffie_hellman"]
    alice, bob = bytes.fromhex(dh["alice_private"]), bytes.fromhex(dh["bob_private"])
    assert public_key_of(alice).hex() == dh["alice_public"]
    assert public_key_of(bob).hex() == dh["bob_public"]
    assert agree(alice, bytes.fromhex(dh["bob_public"])).hex() == dh["shared_secret"]
    assert agree(bob, bytes.fromhex(dh["alice_public"])).hex() == dh["shared_secret"]


def test_derive_key_is_symmetric_and_domain_separated() -> None:
    rng = DeterministicRandom(b"kx")
    a, b = generate_keypair(rng), generate_keypair(rng)
    session = b"session-1"
    keys = {
        info: derive_key(a.private_key, b.public_key, session_id=session, info=info)
        for info in KdfInfo
    }
    for info, key in keys.items():
        assert len(key) == 32
        assert derive_key(b.private_key, a.public_key, session_id=session, info=info) == key
    assert len(set(keys.values())) == len(keys)
    other_session = derive_key(
        a.private_key, b.public_key, session_id=b"session-2", info=KdfInfo.PAIRWISE_MASK_SEED
    )
    assert other_session != keys[KdfInfo.PAIRWISE_MASK_SEED]
    with pytest.raises(ValidationError):
        derive_key(a.private_key, b.public_key, session_id=session, info=b"raw")  # type: ignore[arg-type]


def test_keypair_repr_hides_private_key() -> None:
    pair = generate_keypair(DeterministicRandom(b"repr"))
    assert pair.private_key.hex() not in repr(pair)
    assert repr(pair.private_key) not in repr(pair)
    assert "private" not in repr(pair)
    assert public_key_of(pair.private_key) == pair.public_key
    with pytest.raises(ValidationError):
        X25519KeyPair(private_key=b"short", public_key=bytes(32))


@pytest.mark.parametrize(
    "low_order_point",
    [
        bytes(32),  # u = 0
        (1).to_bytes(32, "little"),  # u = 1
        # u = p - 1 (order 2) and p (= 0 after reduction): RFC 7748 section 6.1 all-zero output
        (2**255 - 20).to_bytes(32, "little"),
        (2**255 - 19).to_bytes(32, "little"),
    ],
)
def test_agree_rejects_low_order_points(low_order_point: bytes) -> None:
    pair = generate_keypair(DeterministicRandom(b"low"))
    with pytest.raises(CryptoError):
        agree(pair.private_key, low_order_point)


def test_agree_length_checks() -> None:
    pair = generate_keypair(DeterministicRandom(b"len"))
    with pytest.raises(ValidationError):
        agree(pair.private_key, bytes(31))
    with pytest.raises(ValidationError):
        agree(pair.private_key[:31], pair.public_key)
