"""Generate our own pinned vectors (PRG, Shamir, quantization) once; they are checked in.

Run from the repository root: ``.venv/bin/python tests/vectors/make_pinned.py``.
Re-running must reproduce the files byte for byte; a difference means the wire-level
behaviour of common.crypto changed, which breaks interoperability between versions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from common.crypto.prg import MASK_CHUNK_ELEMENTS, expand_mask
from common.crypto.quantize import quantize
from common.crypto.random import DeterministicRandom, numpy_generator
from common.crypto.shamir import split_secrets

HERE = Path(__file__).parent


def prg_vectors() -> dict[str, object]:
    cases = []
    lengths = [1, 7, MASK_CHUNK_ELEMENTS - 1, MASK_CHUNK_ELEMENTS + 3, 600_001]
    for index, length in enumerate(lengths):
        seed = DeterministicRandom(f"prg-vector-{index}".encode())(32)
        mask = expand_mask(seed, length)
        cases.append(
            {
                "seed": seed.hex(),
                "length": length,
                "first_words": [int(v) for v in mask[:4]],
                "last_words": [int(v) for v in mask[-4:]],
                "sha256_le": hashlib.sha256(mask.astype("<u4").tobytes()).hexdigest(),
            }
        )
    return {
        "description": "ChaCha20 keystream (zero nonce) as little-endian uint32",
        "cases": cases,
    }


def shamir_vectors() -> dict[str, object]:
    rng = DeterministicRandom(b"shamir-vector")
    secrets = [rng(32), rng(32)]
    xs = [1, 2, 3, 4, 5]
    shares = split_secrets(secrets, threshold=3, xs=xs, rng=rng)
    return {
        "description": "split_secrets with DeterministicRandom(b'shamir-vector'); secrets "
        "are its first 64 bytes, coefficients follow",
        "rng_seed": "shamir-vector",
        "threshold": 3,
        "xs": xs,
        "secrets": [s.hex() for s in secrets],
        "shares": [[share.hex() for share in row] for row in shares],
    }


def quantize_vectors() -> dict[str, object]:
    x = np.array([-2.0, -1.0, -0.5, -1e-3, 0.0, 1e-3, 0.25, 0.5, 0.999, 1.0, 3.0], np.float64)
    cases = []
    for bits in (8, 16, 24):
        rng = numpy_generator(DeterministicRandom(f"quantize-vector-{bits}".encode()))
        out = np.empty(x.size, np.uint32)
        quantize(x, clip=1.0, bits=bits, rng=rng, out=out)
        cases.append(
            {
                "rng_seed": f"quantize-vector-{bits}",
                "clip": 1.0,
                "bits": bits,
                "quantized": [int(v) for v in out],
            }
        )
    return {"input": x.tolist(), "cases": cases}


def main() -> None:
    for name, data in [
        ("pinned_prg.json", prg_vectors()),
        ("pinned_shamir.json", shamir_vectors()),
        ("pinned_quantize.json", quantize_vectors()),
    ]:
        (HERE / name).write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
