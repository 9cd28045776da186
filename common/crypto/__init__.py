"""Cryptographic primitives shared by the coordinator and the site agents.

Everything here is a pure function of its inputs: randomness comes in as a
`RandomSource` (see `random.py`), never from the OS directly, so protocol code can be
replayed deterministically in tests.
"""

from common.crypto.aead import open_sealed, seal, share_associated_data
from common.crypto.encoding import encode_fields
from common.crypto.kdf import KdfInfo, hkdf_sha256
from common.crypto.keyagreement import X25519KeyPair, agree, derive_key, generate_keypair
from common.crypto.prg import MASK_CHUNK_ELEMENTS, apply_masks, expand_mask
from common.crypto.quantize import (
    bits_for_sites,
    decode_sum,
    dequantize_sum,
    encode_update,
    max_integer_for_sites,
    quantize,
)
from common.crypto.random import DeterministicRandom, RandomSource, numpy_generator, system_random
from common.crypto.shamir import (
    PRIME,
    SECRET_BYTES,
    SHARE_BYTES,
    lagrange_at_zero,
    reconstruct_secrets,
    split_secrets,
)
from common.crypto.signing import SigningKey, VerifyingKey

__all__ = [
    "MASK_CHUNK_ELEMENTS",
    "PRIME",
    "SECRET_BYTES",
    "SHARE_BYTES",
    "DeterministicRandom",
    "KdfInfo",
    "RandomSource",
    "SigningKey",
    "VerifyingKey",
    "X25519KeyPair",
    "agree",
    "apply_masks",
    "bits_for_sites",
    "decode_sum",
    "dequantize_sum",
    "derive_key",
    "encode_fields",
    "encode_update",
    "expand_mask",
    "generate_keypair",
    "hkdf_sha256",
    "lagrange_at_zero",
    "max_integer_for_sites",
    "numpy_generator",
    "open_sealed",
    "quantize",
    "reconstruct_secrets",
    "seal",
    "share_associated_data",
    "split_secrets",
    "system_random",
]
