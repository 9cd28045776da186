"""Signatures with certificate keys: both algorithms, loading paths, refusals."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, x25519
from cryptography.x509.oid import NameOID

from common.core.errors import CryptoError, PkiError
from common.crypto.signing import ALGORITHMS, SigningKey, VerifyingKey


def _private_key(algorithm: str) -> ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey:
    if algorithm == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    return ec.generate_private_key(ec.SECP256R1())


def _pem(
    private: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey, password: bytes | None = None
) -> bytes:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password) if password
        else serialization.NoEncryption()
    )
    return private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def _self_signed(
    private: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey, algorithm: str
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "site-a")])
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    digest = None if algorithm == "ed25519" else hashes.SHA256()
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(1)
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=30))
        .sign(private, digest)
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sign_verify_and_rejections(algorithm: str) -> None:
    key = SigningKey.generate(algorithm)
    assert key.algorithm == algorithm
    signature = key.sign(b"roster")
    key.verifying_key.verify(b"roster", signature)
    with pytest.raises(CryptoError):
        key.verifying_key.verify(b"roster!", signature)
    with pytest.raises(CryptoError):
        SigningKey.generate(algorithm).verifying_key.verify(b"roster", signature)
    with pytest.raises(CryptoError):
        key.verifying_key.verify(b"roster", signature[:-1] + bytes([signature[-1] ^ 1]))
    with pytest.raises(CryptoError):
        key.verifying_key.verify(b"roster", b"")


def test_algorithms_do_not_cross_verify() -> None:
    ed, ecdsa = SigningKey.generate("ed25519"), SigningKey.generate("ecdsa-p256-sha256")
    with pytest.raises(CryptoError):
        ecdsa.verifying_key.verify(b"m", ed.sign(b"m"))
    with pytest.raises(CryptoError):
        ed.verifying_key.verify(b"m", ecdsa.sign(b"m"))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_loading_paths_agree(algorithm: str) -> None:
    private = _private_key(algorithm)
    key = SigningKey.from_private_key(private)
    signature = key.sign(b"survivors")
    cert = _self_signed(private, algorithm)
    loaded = [
        VerifyingKey.from_certificate(cert),
        VerifyingKey.from_public_key(cert.public_key()),
    ]
    for verifying in loaded:
        assert verifying == key.verifying_key
        assert verifying.algorithm == algorithm
        verifying.verify(b"survivors", signature)
    reloaded = SigningKey.from_pem(_pem(private, b"pw"), b"pw")
    key.verifying_key.verify(b"x", reloaded.sign(b"x"))
    assert SigningKey.from_pem(_pem(private)).verifying_key == key.verifying_key
    with pytest.raises(PkiError):
        SigningKey.from_pem(_pem(private, b"pw"), b"wrong")
    assert "PRIVATE" not in repr(key)


def test_unsupported_keys_are_refused_at_load_time() -> None:
    p384 = ec.generate_private_key(ec.SECP384R1())
    for private in (p384, ed448.Ed448PrivateKey.generate(), x25519.X25519PrivateKey.generate()):
        with pytest.raises(PkiError):
            SigningKey.from_private_key(private)
        with pytest.raises(PkiError):
            VerifyingKey.from_public_key(private.public_key())
    pem = p384.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    with pytest.raises(PkiError):
        SigningKey.from_pem(pem)
    with pytest.raises(PkiError):
        SigningKey.from_pem(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    with pytest.raises(PkiError):
        SigningKey.generate("rsa")
