"""HKDF-SHA256 (RFC 5869) and the `info` labels of every key medfed derives.

Each derived key has its own label (domain separation) and the round's session id as
salt, so a key agreed for one purpose or round is useless for any other.
"""

from __future__ import annotations

import enum

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from common.core.errors import ValidationError

# RFC 5869 section 2.3: L <= 255 * HashLen.
_MAX_OUTPUT_LENGTH = 255 * 32


class KdfInfo(bytes, enum.Enum):
    """HKDF `info` labels; one per derived-key purpose (versioned)."""

    PAIRWISE_MASK_SEED = b"medfed/v1/secagg/pairwise-mask-seed"
    SHARE_ENCRYPTION_KEY = b"medfed/v1/secagg/share-encryption-key"
    SELF_MASK_SEED = b"medfed/v1/secagg/self-mask-seed"
    NEIGHBOUR_GRAPH = b"medfed/v1/secagg/neighbour-graph"


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF with SHA-256 (extract then expand)."""
    if not 1 <= length <= _MAX_OUTPUT_LENGTH:
        raise ValidationError(f"HKDF output length must be in [1, {_MAX_OUTPUT_LENGTH}]")
    return HKDF(
        algorithm=hashes.SHA256(), length=length, salt=bytes(salt), info=bytes(info)
    ).derive(bytes(ikm))
