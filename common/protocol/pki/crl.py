"""Revocation: writing, refreshing and reading the CA-signed CRL (RFC 5280 s. 5),
revoking a certificate or every certificate of a site.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from common.core.errors import (
    CertificateRejected,
    PkiError,
)
from common.core.fileio import atomic_write
from common.protocol.pki.base import (
    CRL_FILE,
    DEFAULT_CRL_VALIDITY_DAYS,
    REPLACED_DIR,
    PrivateKey,
    Role,
    _signature_hash,
    _ski,
    _utc,
    _validate_days,
    validate_site_id,
)
from common.protocol.pki.issuing import _validate_name, role_paths
from common.protocol.pki.loading import (
    _load_ca_key,
    certificate_identity,
    load_ca,
    load_certificate,
)

# --------------------------------------------------------------------------- revocation


def _write_crl(
    root: Path,
    ca_cert: x509.Certificate,
    ca_key: PrivateKey,
    *,
    revoked: Sequence[x509.RevokedCertificate],
    number: int,
    now: dt.datetime,
    validity_days: int,
) -> x509.CertificateRevocationList:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=validity_days))
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(_ski(ca_cert)),
            critical=False,
        )
    )
    for entry in revoked:
        builder = builder.add_revoked_certificate(entry)
    crl = builder.sign(ca_key, _signature_hash(ca_key))
    crl_path = root / CRL_FILE
    try:
        atomic_write(crl_path, crl.public_bytes(serialization.Encoding.PEM), mode=0o644)
    except OSError as exc:
        raise PkiError(f"cannot write {crl_path}: {exc.strerror}") from None
    return crl


def load_crl(
    path: str | os.PathLike[str], ca_cert: x509.Certificate
) -> x509.CertificateRevocationList:
    """Load ``crl.pem`` and check it is signed by `ca_cert` (PkiError otherwise)."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError:
        raise PkiError(f"CRL {file} cannot be read; run `medfed pki crl --dir D`") from None
    try:
        crl = x509.load_pem_x509_crl(data)
    except ValueError:
        raise PkiError(f"{file} is not a PEM CRL") from None
    ca_key = ca_cert.public_key()
    if crl.issuer != ca_cert.subject or not isinstance(
        ca_key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
    ):
        raise PkiError(f"CRL {file} was not issued by the federation CA")
    if not crl.is_signature_valid(ca_key):
        raise PkiError(f"CRL {file} does not carry a valid federation CA signature")
    return crl


def _crl_number(crl: x509.CertificateRevocationList) -> int:
    try:
        return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        return 0


def _role_certificates(root: Path, role: Role, name: str) -> list[x509.Certificate]:
    """Every certificate in `root` naming (role, name): current one and those moved aside."""
    current, _ = role_paths(root, role, name)
    candidates = [current, *sorted((root / REPLACED_DIR).glob(f"{current.name}.*"))]
    found = []
    for path in candidates:
        if not path.is_file():
            continue
        cert = load_certificate(path)
        try:
            identity = certificate_identity(cert)
        except CertificateRejected:
            continue
        if identity.role is role and (role is Role.COORDINATOR or identity.name == name):
            found.append(cert)
    return found


def refresh_crl(
    directory: str | os.PathLike[str],
    *,
    crl_validity_days: int = DEFAULT_CRL_VALIDITY_DAYS,
    now: dt.datetime | None = None,
    add_serials: Sequence[int] = (),
) -> x509.CertificateRevocationList:
    """Re-sign ``crl.pem`` (new nextUpdate, incremented CRL number), optionally adding serials.

    Verifiers refuse everyone once the CRL's nextUpdate has passed (fail closed), so an
    operator re-runs this (``medfed pki crl``) before then, e.g. from cron.
    """
    root = Path(directory)
    _validate_days("crl_validity_days", crl_validity_days)
    moment = _utc(now)
    ca_cert, ca_key = _load_ca_key(root)
    old = load_crl(root / CRL_FILE, ca_cert)
    entries = list(old)
    known = {entry.serial_number for entry in entries}
    for serial in add_serials:
        if serial not in known:
            known.add(serial)
            entries.append(
                x509.RevokedCertificateBuilder()
                .serial_number(serial)
                .revocation_date(moment)
                .build()
            )
    return _write_crl(
        root,
        ca_cert,
        ca_key,
        revoked=entries,
        number=_crl_number(old) + 1,
        now=moment,
        validity_days=crl_validity_days,
    )


def revoke(
    directory: str | os.PathLike[str],
    role: Role,
    name: str,
    *,
    crl_validity_days: int = DEFAULT_CRL_VALIDITY_DAYS,
    now: dt.datetime | None = None,
) -> list[int]:
    """Revoke every certificate issued to (role, name), current and replaced; return serials.

    The new CRL replaces ``crl.pem`` atomically; a running `PeerVerifier` notices the
    file change on its next call, so the coordinator needs no restart.
    """
    _validate_name(role.value, name)
    root = Path(directory)
    certs = _role_certificates(root, role, name)
    if not certs:
        raise PkiError(f"no certificate for {role.value} {name!r} in {root}")
    serials = [cert.serial_number for cert in certs]
    refresh_crl(root, crl_validity_days=crl_validity_days, now=now, add_serials=serials)
    return serials


def revoke_site(
    directory: str | os.PathLike[str],
    site_id: str,
    *,
    crl_validity_days: int = DEFAULT_CRL_VALIDITY_DAYS,
    now: dt.datetime | None = None,
) -> list[int]:
    """Revoke every certificate issued to `site_id` (current and replaced); return serials."""
    validate_site_id(site_id)
    return revoke(directory, Role.SITE, site_id, crl_validity_days=crl_validity_days, now=now)


def revoked_serials(directory: str | os.PathLike[str]) -> frozenset[int]:
    """Serial numbers listed in the (signature-checked) CRL of a PKI directory."""
    root = Path(directory)
    crl = load_crl(root / CRL_FILE, load_ca(root))
    return frozenset(entry.serial_number for entry in crl)
