"""Signatures made with a site's certificate key (its mTLS identity).

SecAgg+ needs signed public keys and signed survivor sets (Bonawitz et al. 2017,
section 4, the actively secure variant) so that the coordinator cannot substitute
keys or tell sites different stories. Signing with the certificate key binds each
statement to the identity the federation CA vouched for. Two algorithms are
accepted, matching what `medfed pki` issues: Ed25519 and ECDSA P-256 with SHA-256.
"""

from __future__ import annotations

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from common.core.errors import CryptoError, PkiError

ED25519 = "ed25519"
ECDSA_P256_SHA256 = "ecdsa-p256-sha256"
ALGORITHMS = (ED25519, ECDSA_P256_SHA256)

_PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
_PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey


def _algorithm_of(key: object) -> str:
    """Name the algorithm of a key, refusing anything but Ed25519 and ECDSA P-256."""
    if isinstance(key, ed25519.Ed25519PrivateKey | ed25519.Ed25519PublicKey):
        return ED25519
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        if isinstance(key.curve, ec.SECP256R1):
            return ECDSA_P256_SHA256
        raise PkiError(f"unsupported elliptic curve {key.curve.name}; only P-256 is accepted")
    raise PkiError(f"unsupported key type {type(key).__name__}; use Ed25519 or ECDSA P-256")


class VerifyingKey:
    """A public key that checks signatures; CryptoError on any failure."""

    def __init__(self, key: _PublicKey) -> None:
        self._algorithm = _algorithm_of(key)
        self._key = key

    @classmethod
    def from_public_key(cls, key: object) -> VerifyingKey:
        """Wrap a `cryptography` public key object (PkiError if not Ed25519/P-256)."""
        _algorithm_of(key)
        return cls(key)  # type: ignore[arg-type]

    @classmethod
    def from_certificate(cls, cert: x509.Certificate) -> VerifyingKey:
        """The subject key of an X.509 certificate."""
        return cls.from_public_key(cert.public_key())

    @property
    def algorithm(self) -> str:
        """"ed25519" or "ecdsa-p256-sha256"."""
        return self._algorithm

    def verify(self, message: bytes, signature: bytes) -> None:
        """Return if `signature` is valid for `message`, else raise CryptoError."""
        try:
            if isinstance(self._key, ed25519.Ed25519PublicKey):
                self._key.verify(bytes(signature), bytes(message))
            else:
                self._key.verify(bytes(signature), bytes(message), ec.ECDSA(hashes.SHA256()))
        except (InvalidSignature, ValueError):
            raise CryptoError() from None

    def spki_der(self) -> bytes:
        """DER SubjectPublicKeyInfo: a canonical byte form to compare or transmit."""
        return self._key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerifyingKey) and self.spki_der() == other.spki_der()

    def __hash__(self) -> int:
        return hash(self.spki_der())

    def __repr__(self) -> str:
        return f"VerifyingKey({self._algorithm}, spki={self.spki_der().hex()[-16:]}...)"


class SigningKey:
    """A private signing key (Ed25519 or ECDSA P-256); never printed."""

    def __init__(self, key: _PrivateKey) -> None:
        self._algorithm = _algorithm_of(key)
        self._key = key

    @classmethod
    def from_private_key(cls, key: object) -> SigningKey:
        """Wrap a `cryptography` private key object (PkiError if not Ed25519/P-256)."""
        _algorithm_of(key)
        return cls(key)  # type: ignore[arg-type]

    @classmethod
    def from_pem(cls, data: bytes, password: bytes | None = None) -> SigningKey:
        """Load a PEM private key (PKCS#8 or SEC1), optionally encrypted."""
        try:
            key = serialization.load_pem_private_key(bytes(data), password=password)
        except (ValueError, TypeError, UnsupportedAlgorithm) as error:
            raise PkiError("cannot load PEM private key (bad format or password)") from error
        return cls.from_private_key(key)

    @classmethod
    def generate(cls, algorithm: str = ECDSA_P256_SHA256) -> SigningKey:
        """A fresh key, uses OS randomness: for tests and `medfed pki` only."""
        if algorithm == ED25519:
            return cls(ed25519.Ed25519PrivateKey.generate())
        if algorithm == ECDSA_P256_SHA256:
            return cls(ec.generate_private_key(ec.SECP256R1()))
        raise PkiError(f"unsupported signature algorithm {algorithm!r}")

    @property
    def algorithm(self) -> str:
        """"ed25519" or "ecdsa-p256-sha256"."""
        return self._algorithm

    @property
    def verifying_key(self) -> VerifyingKey:
        """The matching public key."""
        return VerifyingKey(self._key.public_key())

    def sign(self, message: bytes) -> bytes:
        """Ed25519 signature (64 bytes) or DER-encoded ECDSA-SHA256 signature."""
        if isinstance(self._key, ed25519.Ed25519PrivateKey):
            return self._key.sign(bytes(message))
        return self._key.sign(bytes(message), ec.ECDSA(hashes.SHA256()))

    def __repr__(self) -> str:
        return f"SigningKey({self._algorithm}, <private>)"
