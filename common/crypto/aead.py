"""ChaCha20-Poly1305 authenticated encryption (RFC 8439) of Shamir share bundles.

ChaCha20-Poly1305 rather than AES-GCM: constant-time without AES-NI and the same
speed where it exists; the shares are tiny, so throughput does not matter here.
Random 96-bit nonces are safe because every key encrypts only a handful of messages
(one per neighbour per round, keys are fresh each round).
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from common.core.errors import CryptoError, ValidationError
from common.crypto.encoding import encode_fields
from common.crypto.random import RandomSource

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_SHARE_AD_LABEL = "medfed/v1/secagg/share-ciphertext"


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise ValidationError(f"AEAD key must be {KEY_BYTES} bytes")


def seal(key: bytes, plaintext: bytes, *, associated_data: bytes, rng: RandomSource) -> bytes:
    """Encrypt and authenticate; returns ``nonce (12 bytes) || ciphertext || tag``."""
    _check_key(key)
    nonce = rng(NONCE_BYTES)
    if len(nonce) != NONCE_BYTES:
        raise ValidationError("random source returned a short nonce")
    return nonce + ChaCha20Poly1305(bytes(key)).encrypt(
        nonce, bytes(plaintext), bytes(associated_data)
    )


def open_sealed(key: bytes, sealed: bytes, *, associated_data: bytes) -> bytes:
    """Inverse of `seal`. Every failure (short input, tampering, wrong key/AD): CryptoError."""
    _check_key(key)
    if len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise CryptoError()
    sealed = bytes(sealed)
    try:
        return ChaCha20Poly1305(bytes(key)).decrypt(
            sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], bytes(associated_data)
        )
    except (InvalidTag, ValueError):
        raise CryptoError() from None


def share_associated_data(
    *, sender: str, recipient: str, round_number: int, session_id: bytes
) -> bytes:
    """AD binding a share ciphertext to its sender, recipient, round and session.

    Without it a malicious coordinator could replay a ciphertext to another recipient
    or into another round (Bonawitz et al. 2017, section 4, ShareKeys).
    """
    return encode_fields(_SHARE_AD_LABEL, sender, recipient, round_number, session_id)
