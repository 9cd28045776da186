"""`PeerVerifier`: whether a TLS peer certificate is a current, unrevoked member of this
federation (chain, validity, CRL, role, clientAuth), with a per-certificate cache of
the checks that depend only on its bytes.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID

from common.core.errors import (
    CertificateRejected,
    PkiError,
)
from common.protocol.pki.base import CRL_FILE, PublicKey, Role, _utc
from common.protocol.pki.crl import load_crl
from common.protocol.pki.loading import (
    CertificateIdentity,
    _is_ca,
    certificate_identity,
    check_issued_by,
    check_validity_window,
    has_extended_key_usage,
    load_ca,
    parse_certificate,
)

# --------------------------------------------------------------------------- verifying


@dataclass(frozen=True)
class _CrlSnapshot:
    stat_key: tuple[int, int, int]
    revoked: frozenset[int]
    next_update: dt.datetime | None


class PeerVerifier:
    """Decides whether a TLS peer certificate is a current, unrevoked site of this federation.

    gRPC's TLS layer already checks the chain at the handshake; this repeats the checks
    that matter (so the rule holds whatever the transport did) and adds what TLS does
    not do: the CRL, the clientAuth usage and the site id. The CRL file is re-read
    whenever its (inode, size, mtime) changes: one `stat` per call.

    What depends only on the certificate's bytes and the CA (the CA's signature, key
    type, CA flag, clientAuth, the identity) is checked once per certificate and
    remembered by its SHA-256 fingerprint: the coordinator verifies the caller of every
    RPC, and the CA signature check was most of that cost (~0.2 ms a call). What
    changes with time (both validity windows, the CRL) is checked on every call.
    """

    STATIC_CACHE_ENTRIES = 4096  # certificates remembered (least recently used go first)

    def __init__(self, ca_cert: x509.Certificate, crl_path: str | os.PathLike[str]) -> None:
        self._ca = ca_cert
        self._crl_path = Path(crl_path)
        self._lock = threading.Lock()
        self._static: OrderedDict[bytes, tuple[CertificateIdentity, PublicKey]] = OrderedDict()
        self._snapshot: _CrlSnapshot | None = None
        self._crl_error: str | None = None
        # Fail fast at start-up if the CRL is missing or forged.
        self._load_crl(self._stat_key())
        if self._crl_error is not None:
            raise PkiError(self._crl_error)

    @classmethod
    def from_pki_dir(cls, directory: str | os.PathLike[str]) -> PeerVerifier:
        root = Path(directory)
        return cls(load_ca(root), root / CRL_FILE)

    def _stat_key(self) -> tuple[int, int, int] | None:
        try:
            st = self._crl_path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _load_crl(self, key: tuple[int, int, int] | None) -> None:
        if key is None:
            self._snapshot = None
            self._crl_error = f"CRL {self._crl_path} is missing"
            return
        try:
            crl = load_crl(self._crl_path, self._ca)
        except PkiError as exc:
            # Fail closed: an unreadable or forged CRL rejects everyone until it is fixed.
            self._snapshot = None
            self._crl_error = str(exc)
            return
        self._snapshot = _CrlSnapshot(
            stat_key=key,
            revoked=frozenset(entry.serial_number for entry in crl),
            next_update=crl.next_update_utc,
        )
        self._crl_error = None

    def _current_crl(self) -> _CrlSnapshot:
        key = self._stat_key()
        with self._lock:
            if self._snapshot is None or self._snapshot.stat_key != key:
                self._load_crl(key)
            if self._snapshot is None:
                raise CertificateRejected(f"revocation status unknown: {self._crl_error}")
            return self._snapshot

    def verify(self, certificate: bytes | x509.Certificate, *, now: dt.datetime) -> str:
        """Return the site id of a valid peer *site* certificate; CertificateRejected
        otherwise (a valid monitor or coordinator certificate included)."""
        return self._verified_site(certificate, now)[0]

    def verify_identity(
        self, certificate: bytes | x509.Certificate, *, now: dt.datetime
    ) -> CertificateIdentity:
        """Role and name of a valid, unrevoked client certificate of any role."""
        return self._verified(certificate, now)[0]

    def verifying_key_for(
        self, site_id: str, certificate: bytes | x509.Certificate, *, now: dt.datetime
    ) -> PublicKey:
        """The public key of `site_id`'s valid certificate (to check its SecAgg signatures)."""
        named, key = self._verified_site(certificate, now)
        if named != site_id:
            raise CertificateRejected(f"certificate names site {named!r}, not {site_id!r}")
        return key

    def _verified_site(
        self, certificate: bytes | x509.Certificate, now: dt.datetime
    ) -> tuple[str, PublicKey]:
        identity, key = self._verified(certificate, now)
        if identity.role is not Role.SITE:
            raise CertificateRejected(
                f"a {identity.role.value} certificate ({identity.name!r}) is not a site "
                "certificate"
            )
        return identity.name, key

    def _verified(
        self, certificate: bytes | x509.Certificate, now: dt.datetime
    ) -> tuple[CertificateIdentity, PublicKey]:
        cert = (
            certificate
            if isinstance(certificate, x509.Certificate)
            else parse_certificate(certificate)
        )
        moment = _utc(now)
        check_validity_window(self._ca, moment, what="the federation CA certificate")
        identity, key = self._static_checks(cert)
        check_validity_window(cert, moment, what="peer certificate")
        crl = self._current_crl()
        if crl.next_update is not None and moment > crl.next_update:
            raise CertificateRejected(
                f"revocation status unknown: CRL expired at {crl.next_update.isoformat()} "
                "(run `medfed pki crl --dir D`)"
            )
        if cert.serial_number in crl.revoked:
            raise CertificateRejected(
                f"certificate of {identity.role.value} {identity.name!r} has been revoked"
            )
        return identity, key

    def _static_checks(self, cert: x509.Certificate) -> tuple[CertificateIdentity, PublicKey]:
        """The checks that depend only on the certificate's bytes and the CA; a
        certificate that passed once is remembered (a refused one never is)."""
        fingerprint = cert.fingerprint(hashes.SHA256())
        with self._lock:
            known = self._static.get(fingerprint)
            if known is not None:
                self._static.move_to_end(fingerprint)
                return known
        check_issued_by(cert, self._ca, what="peer certificate")
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey):
            raise CertificateRejected("peer certificate key type is not EC or Ed25519")
        if _is_ca(cert):
            raise CertificateRejected("peer certificate is a CA certificate")
        if not has_extended_key_usage(cert, ExtendedKeyUsageOID.CLIENT_AUTH):
            raise CertificateRejected("peer certificate is not for TLS client authentication")
        checked = (certificate_identity(cert), key)
        with self._lock:
            self._static[fingerprint] = checked
            while len(self._static) > self.STATIC_CACHE_ENTRIES:
                self._static.popitem(last=False)
        return checked
