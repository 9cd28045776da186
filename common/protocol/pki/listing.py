"""Listing a PKI directory: every certificate with its role, expiry and revocation
state, and the current site members.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from common.core.errors import (
    CertificateRejected,
)
from common.protocol.pki.base import (
    CA_CERT,
    COORDINATOR_CERT,
    MONITORS_DIR,
    REPLACED_DIR,
    SITES_DIR,
    _utc,
)
from common.protocol.pki.crl import revoked_serials
from common.protocol.pki.loading import (
    check_issued_by,
    check_validity_window,
    load_ca,
    load_certificate,
    public_key_fingerprint,
    site_id_from_certificate,
)

# --------------------------------------------------------------------------- listing


@dataclass(frozen=True)
class CertificateInfo:
    """One row of ``medfed pki list``."""

    path: Path
    subject: str
    serial: int
    not_after: dt.datetime
    revoked: bool
    replaced: bool = False  # moved into replaced/ by `sign --replace` / `issue --force`


def list_certificates(directory: str | os.PathLike[str]) -> list[CertificateInfo]:
    """CA, coordinator, site and monitor certificates of a PKI directory, with revocation;
    then those moved into replaced/ (a replaced site certificate is revoked, and the
    operator must still see it: its serial is on the CRL until it expires)."""
    root = Path(directory)
    revoked = revoked_serials(root)
    current = [
        root / CA_CERT,
        root / COORDINATOR_CERT,
        *sorted((root / SITES_DIR).glob("*.crt")),
        *sorted((root / MONITORS_DIR).glob("*.crt")),
    ]
    # _move_aside names them NAME.crt.STAMP[.N]; keys (NAME.key.STAMP) are not listed.
    moved = sorted((root / REPLACED_DIR).glob("*.crt.*"))
    rows = []
    for path in [*current, *moved]:
        if not path.is_file():
            continue
        cert = load_certificate(path)
        rows.append(
            CertificateInfo(
                path=path,
                subject=cert.subject.rfc4514_string(),
                serial=cert.serial_number,
                not_after=cert.not_valid_after_utc,
                revoked=cert.serial_number in revoked,
                replaced=path.parent.name == REPLACED_DIR,
            )
        )
    return rows


def site_members(
    directory: str | os.PathLike[str], *, now: dt.datetime | None = None
) -> dict[str, str]:
    """Site id -> hex SHA-256 of its certificate public key, for every current, valid,
    unrevoked site certificate in a PKI directory: what a consortium pins in its sites'
    ``[policy.members]`` so that a CA minting extra "hospitals" cannot join a round."""
    root = Path(directory)
    ca_cert = load_ca(root)
    revoked = revoked_serials(root)
    moment = _utc(now)
    members: dict[str, str] = {}
    for path in sorted((root / SITES_DIR).glob("*.crt")):
        cert = load_certificate(path)
        try:
            check_issued_by(cert, ca_cert, what=str(path))
            check_validity_window(cert, moment, what=str(path))
            site_id = site_id_from_certificate(cert)
        except CertificateRejected:
            continue
        if cert.serial_number not in revoked:
            members[site_id] = public_key_fingerprint(cert)
    return members
