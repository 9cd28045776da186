"""The CSR flow: a hospital makes its own key and request (`request_certificate`), the
operator checks (`load_request`) and signs it (`sign_request`); the site key never
leaves the hospital.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from common.core.errors import (
    CertificateRejected,
    ConfigError,
    PkiError,
)
from common.protocol.pki.base import (
    CSR_SUFFIX,
    DEFAULT_CRL_VALIDITY_DAYS,
    DEFAULT_LEAF_VALIDITY_DAYS,
    Role,
    _cert_pem,
    _key_pem,
    _move_aside,
    _refuse_existing,
    _utc,
    _validate_days,
    _write_new_file,
)
from common.protocol.pki.crl import _role_certificates, refresh_crl, revoked_serials
from common.protocol.pki.issuing import (
    _leaf_profile,
    _role_uri,
    _sign_leaf,
    _validate_name,
    role_paths,
)
from common.protocol.pki.loading import (
    CertificateIdentity,
    _identity_from_names,
    check_issued_by,
    load_ca,
)

# --------------------------------------------------------------------------- CSR flow

_REQUESTABLE = (Role.SITE, Role.MONITOR)


@dataclass(frozen=True)
class RequestFiles:
    """What `request_certificate` wrote: the key (stays here) and the CSR (sent out)."""

    key_path: Path
    csr_path: Path


@dataclass(frozen=True)
class SignedCertificate:
    """What `sign_request` wrote, and the serials of certificates it revoked (--replace)."""

    certificate: x509.Certificate
    cert_path: Path
    identity: CertificateIdentity
    revoked_serials: tuple[int, ...]


def request_certificate(
    out_dir: str | os.PathLike[str], name: str, *, role: Role = Role.SITE
) -> RequestFiles:
    """At the hospital: a fresh P-256 key ``OUT/NAME.key`` (0600) and ``OUT/NAME.csr``.

    The key never leaves the hospital; only the CSR (public key, site id in CN and SAN
    URI ``medfed://site/NAME``, self-signed with the key, RFC 2986) goes to the operator.
    """
    if role not in _REQUESTABLE:
        raise ConfigError("role", f"certificate requests are for sites and monitors, not {role}")
    _validate_name(role.value, name)
    out = Path(out_dir)
    key_path, csr_path = out / f"{name}.key", out / f"{name}{CSR_SUFFIX}"
    _refuse_existing([key_path, csr_path])
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    # P-256: gRPC's TLS cannot use Ed25519 leaf keys (see common/protocol/tls.py).
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .add_extension(x509.SubjectAlternativeName([_role_uri(role, name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_new_file(key_path, _key_pem(key), mode=0o600)
    _write_new_file(csr_path, csr.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return RequestFiles(key_path=key_path, csr_path=csr_path)


def load_request(
    path: str | os.PathLike[str],
) -> tuple[x509.CertificateSigningRequest, CertificateIdentity]:
    """Load a CSR, check its self-signature and the role and name it asks for."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise PkiError(f"cannot read certificate request {file}: {exc.strerror}") from None
    if b"PRIVATE KEY" in data:
        raise PkiError(
            f"{file} contains a private key: send only the .csr; the key stays at the hospital"
        )
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            csr = x509.load_pem_x509_csr(data)
        else:
            csr = x509.load_der_x509_csr(data)
    except ValueError:
        raise PkiError(f"{file} is not a PEM or DER certificate request") from None
    if not csr.is_signature_valid:
        raise PkiError(f"{file}: the request's signature does not verify (altered in transit?)")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(
        key.curve, ec.SECP256R1
    ):
        raise PkiError(f"{file}: the request's key is not EC P-256 (run `medfed pki request`)")
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    common_names = [str(a.value) for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    try:
        identity = _identity_from_names(uris, common_names, what=f"request {file}")
    except CertificateRejected as exc:
        raise PkiError(str(exc)) from None
    if identity.role not in _REQUESTABLE:
        raise PkiError(
            f"{file} asks for a {identity.role.value} certificate; only site and monitor "
            "requests are signed (the coordinator's comes from `pki issue --coordinator`)"
        )
    return csr, identity


def sign_request(
    directory: str | os.PathLike[str],
    csr_path: str | os.PathLike[str],
    *,
    replace: bool = False,
    validity_days: int = DEFAULT_LEAF_VALIDITY_DAYS,
    crl_validity_days: int = DEFAULT_CRL_VALIDITY_DAYS,
    now: dt.datetime | None = None,
) -> SignedCertificate:
    """At the operator: sign a hospital's (or monitor's) CSR into ``sites/ID.crt``.

    Refuses an id that already holds a valid (unexpired, unrevoked) certificate unless
    `replace`; then the old certificates are moved aside *and revoked*, so at most one
    key speaks for a site id at any time. Writes no private key.
    """
    root = Path(directory)
    _validate_days("validity_days", validity_days)
    moment = _utc(now)
    csr, identity = load_request(csr_path)
    cert_path, _ = role_paths(root, identity.role, identity.name)
    ca_cert = load_ca(root)
    revoked = revoked_serials(root)
    live = [
        cert
        for cert in _role_certificates(root, identity.role, identity.name)
        if cert.serial_number not in revoked
        and cert.not_valid_after_utc > moment
        and _is_issued_by(cert, ca_cert)
    ]
    if live and not replace:
        raise PkiError(
            f"{identity.role.value} {identity.name!r} already has a valid certificate "
            f"(serial {live[0].serial_number:x}, until "
            f"{live[0].not_valid_after_utc.date().isoformat()}); pass --replace to revoke "
            "it and sign this request instead"
        )
    cert = _sign_leaf(
        root,
        _leaf_profile(identity.role, identity.name, ()),
        public_key=csr.public_key(),  # type: ignore[arg-type]  # checked P-256 above
        validity_days=validity_days,
        moment=moment,
    )
    serials = tuple(c.serial_number for c in live)
    if serials:
        refresh_crl(root, crl_validity_days=crl_validity_days, now=moment, add_serials=serials)
    _move_aside(root, [cert_path], moment)
    cert_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_new_file(cert_path, _cert_pem(cert), mode=0o644)
    return SignedCertificate(
        certificate=cert, cert_path=cert_path, identity=identity, revoked_serials=serials
    )


def _is_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> bool:
    try:
        check_issued_by(cert, ca_cert, what="certificate")
    except CertificateRejected:
        return False
    return True
