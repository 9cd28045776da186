"""X25519 Diffie-Hellman (RFC 7748) and HKDF-derived pairwise keys.

Used by SecAgg+ (Bonawitz et al. 2017, section 4; Bell et al. 2020): every pair of
neighbours agrees one key to encrypt Shamir shares and one seed for pairwise masks.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from common.core.errors import CryptoError, ValidationError
from common.crypto.kdf import KdfInfo, hkdf_sha256
from common.crypto.random import RandomSource

KEY_BYTES = 32
_ALL_ZERO = bytes(KEY_BYTES)


@dataclass(frozen=True)
class X25519KeyPair:
    """Raw 32-byte X25519 keys. The private key is kept out of repr (and so out of logs)."""

    private_key: bytes = field(repr=False)
    public_key: bytes

    def __post_init__(self) -> None:
        if len(self.private_key) != KEY_BYTES or len(self.public_key) != KEY_BYTES:
            raise ValidationError("X25519 keys must be 32 bytes each")


def _check_length(name: str, key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise ValidationError(f"{name} must be {KEY_BYTES} bytes")


def generate_keypair(rng: RandomSource) -> X25519KeyPair:
    """A fresh key pair from 32 bytes of `rng` (clamping is done by X25519 itself)."""
    private_bytes = rng(KEY_BYTES)
    _check_length("random private key", private_bytes)
    private = X25519PrivateKey.from_private_bytes(private_bytes)
    return X25519KeyPair(
        private_key=bytes(private_bytes), public_key=private.public_key().public_bytes_raw()
    )


def public_key_of(private_key: bytes) -> bytes:
    """The public key belonging to a raw private key."""
    _check_length("private_key", private_key)
    return X25519PrivateKey.from_private_bytes(bytes(private_key)).public_key().public_bytes_raw()


def agree(private_key: bytes, peer_public_key: bytes) -> bytes:
    """Raw X25519 shared secret.

    Raises CryptoError for an all-zero result (RFC 7748 section 6.1: a low-order peer
    key would let an attacker force a known secret) or any key the library refuses.
    """
    _check_length("private_key", private_key)
    _check_length("peer_public_key", peer_public_key)
    try:
        private = X25519PrivateKey.from_private_bytes(bytes(private_key))
        peer = X25519PublicKey.from_public_bytes(bytes(peer_public_key))
        shared = private.exchange(peer)
    except ValueError:
        raise CryptoError() from None
    if hmac.compare_digest(shared, _ALL_ZERO):
        raise CryptoError()
    return shared


def derive_key(
    private_key: bytes, peer_public_key: bytes, *, session_id: bytes, info: KdfInfo
) -> bytes:
    """A 32-byte key for one purpose and one round: HKDF(agree(...), salt=session_id, info).

    Symmetric by construction: derive_key(a_sk, b_pk) == derive_key(b_sk, a_pk).
    """
    if not isinstance(info, KdfInfo):
        raise ValidationError("info must be a KdfInfo label")
    return hkdf_sha256(
        agree(private_key, peer_public_key), salt=session_id, info=info.value, length=KEY_BYTES
    )
