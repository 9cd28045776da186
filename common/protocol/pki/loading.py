"""Loading and checking certificates and keys: PEM/DER parsing, key-file modes, the
``medfed://ROLE/NAME`` identity, and the RFC 5280 checks (issuer, validity window,
extended key usage) on one certificate.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.core.errors import (
    AbortReason,
    CertificateRejected,
    PkiError,
    ProtocolAbort,
)
from common.protocol.pki.base import (
    CA_CERT,
    CA_KEY,
    ROLE_URI_SCHEME,
    SITE_ID_PATTERN,
    PrivateKey,
    Role,
    _utc,
    load_private_key_file,
)

# --------------------------------------------------------------------------- loading


def load_certificate(path: str | os.PathLike[str]) -> x509.Certificate:
    """Load one PEM (or DER) certificate; PkiError naming the file if that fails."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise PkiError(f"certificate {file} does not exist") from None
    except OSError as exc:
        raise PkiError(f"cannot read certificate {file}: {exc.strerror}") from None
    try:
        return parse_certificate(data)
    except CertificateRejected:
        raise PkiError(f"{file} is not a PEM or DER X.509 certificate") from None


def parse_certificate(data: bytes) -> x509.Certificate:
    """Parse PEM or DER bytes; CertificateRejected if they are not a certificate."""
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError:
        raise CertificateRejected("peer certificate cannot be parsed") from None


def load_ca(directory: str | os.PathLike[str]) -> x509.Certificate:
    """The federation CA certificate ``D/ca.crt``."""
    return load_certificate(Path(directory) / CA_CERT)


def _load_ca_key(directory: Path) -> tuple[x509.Certificate, PrivateKey]:
    cert = load_ca(directory)
    key = load_private_key_file(directory / CA_KEY)
    if key.public_key() != cert.public_key():
        raise PkiError(f"{directory / CA_KEY} does not belong to {directory / CA_CERT}")
    return cert, key


@dataclass(frozen=True)
class CertificateIdentity:
    """Role and name a certificate carries in its ``medfed://ROLE/NAME`` SAN URI."""

    role: Role
    name: str


def _identity_from_names(
    uris: Sequence[str], common_names: Sequence[str], *, what: str
) -> CertificateIdentity:
    """The one ``medfed://ROLE/NAME`` URI among `uris`; CN must equal NAME for a site."""
    ours = [uri for uri in uris if uri.startswith(ROLE_URI_SCHEME)]
    if len(ours) != 1:
        raise CertificateRejected(
            f"{what} must carry exactly one {ROLE_URI_SCHEME}ROLE/NAME URI, found {len(ours)}"
        )
    role_name, _, name = ours[0][len(ROLE_URI_SCHEME) :].partition("/")
    try:
        role = Role(role_name)
    except ValueError:
        raise CertificateRejected(f"{what} names an unknown role {role_name!r}") from None
    if SITE_ID_PATTERN.fullmatch(name) is None:
        label = "site id" if role is Role.SITE else f"{role.value} name"
        raise CertificateRejected(f"{what} names an invalid {label} {name!r}")
    if role is not Role.COORDINATOR and list(common_names) != [name]:
        raise CertificateRejected(
            f"{what} subject CN {list(common_names)!r} does not match its "
            f"{role.value} name {name!r}"
        )
    return CertificateIdentity(role=role, name=name)


def certificate_identity(cert: x509.Certificate) -> CertificateIdentity:
    """Role and name of `cert`; CertificateRejected if it names none, several or a bad one."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertificateRejected("certificate has no subjectAltName naming its role") from None
    common_names = [attr.value for attr in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return _identity_from_names(
        san.get_values_for_type(x509.UniformResourceIdentifier),
        [str(cn) for cn in common_names],
        what="certificate",
    )


def certificate_role(cert: x509.Certificate) -> Role:
    """The role `cert` names (site, coordinator, monitor); CertificateRejected if none."""
    return certificate_identity(cert).role


def site_id_from_certificate(cert: x509.Certificate) -> str:
    """The site id named by `cert`: its one ``medfed://site/ID`` SAN URI, equal to its CN.

    A monitor or coordinator certificate is refused: only sites enrol and sign.
    """
    identity = certificate_identity(cert)
    if identity.role is not Role.SITE:
        raise CertificateRejected(
            f"certificate is a {identity.role.value} certificate ({identity.name!r}), "
            "not a site certificate"
        )
    return identity.name


def check_roster_certificate(
    certificate: bytes | x509.Certificate,
    *,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    site_id: str,
) -> x509.Certificate:
    """The certificate of roster entry `site_id`, checked as a site would check it.

    It must chain to the site's own copy of the CA, be valid at `now`, be a clientAuth
    leaf and name the role *site* with id `site_id`. A certificate of another role
    (a monitor, or the coordinator posing as a hospital) aborts the round with
    ``not_a_site``; other failures raise CertificateRejected.
    """
    cert = (
        certificate
        if isinstance(certificate, x509.Certificate)
        else parse_certificate(certificate)
    )
    what = f"roster certificate of {site_id!r}"
    check_issued_by(cert, ca_cert, what=what)
    check_validity_window(cert, now, what=what)
    identity = certificate_identity(cert)
    if identity.role is not Role.SITE:
        raise ProtocolAbort(
            AbortReason.NOT_A_SITE,
            f"roster entry {site_id!r} carries a {identity.role.value} certificate "
            f"({identity.name!r}); only site certificates may take part in a round",
        )
    if _is_ca(cert) or not has_extended_key_usage(cert, ExtendedKeyUsageOID.CLIENT_AUTH):
        raise ProtocolAbort(
            AbortReason.NOT_A_SITE,
            f"roster entry {site_id!r} carries a certificate that is not a site "
            "(clientAuth leaf) certificate",
        )
    if identity.name != site_id:
        raise CertificateRejected(f"{what} names site {identity.name!r}")
    return cert


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def public_key_fingerprint(cert: x509.Certificate | x509.CertificateSigningRequest) -> str:
    """Hex SHA-256 of the certificate's (or request's) SubjectPublicKeyInfo (DER): what a
    hospital reads to the operator over the phone to confirm the CSR is its own. The
    same for a request and the certificate signed from it (the key is the same)."""
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest = hashes.Hash(hashes.SHA256())
    digest.update(spki)
    return digest.finalize().hex()


def days_until_expiry(cert: x509.Certificate, now: dt.datetime) -> float:
    """Days (fractional, negative once expired) until `cert`'s notAfter."""
    return (cert.not_valid_after_utc - _utc(now)).total_seconds() / 86400.0


def check_validity_window(cert: x509.Certificate, now: dt.datetime, *, what: str) -> None:
    """CertificateRejected if `now` is outside [notBefore, notAfter] (RFC 5280 s. 4.1.2.5)."""
    moment = _utc(now)
    if moment < cert.not_valid_before_utc:
        raise CertificateRejected(
            f"{what} is not valid yet (notBefore {cert.not_valid_before_utc.isoformat()})"
        )
    if moment > cert.not_valid_after_utc:
        raise CertificateRejected(f"{what} expired at {cert.not_valid_after_utc.isoformat()}")


def check_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate, *, what: str) -> None:
    """CertificateRejected unless `ca_cert` issued `cert` (issuer name and signature)."""
    try:
        # Checks issuer == CA subject and the CA's signature (EC, Ed25519, RSA alike).
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise CertificateRejected(f"{what} is not signed by the federation CA") from None


def has_extended_key_usage(cert: x509.Certificate, usage: x509.ObjectIdentifier) -> bool:
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False
    return usage in eku
