"""Revocation as a site checks it: the CA's CRL, relayed by the coordinator.

The coordinator cannot forge a CRL (the site checks the CA signature against its own
CA copy) but it could withhold a new one or replay an old one. Withholding ends when
the last accepted CRL's nextUpdate passes: the site then refuses every round (fail
closed, with a message naming the cause). Replay is refused by the CRL number, which
never goes down. RFC 5280 sec. 5 (CRL fields), 6.3 (validity).
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from common.core.errors import AbortReason, CertificateRejected, ProtocolAbort, RoundFailed

log = logging.getLogger("medfed.site.revocation")

MAX_CRL_BYTES = 1 << 20  # a CRL of ~20 000 entries; more is not a federation's CRL


@dataclass(frozen=True)
class AcceptedCrl:
    number: int
    next_update: dt.datetime
    revoked: frozenset[int]


def parse_crl(der: bytes, ca_cert: x509.Certificate) -> AcceptedCrl:
    """A CRL signed by `ca_cert`, with its number and nextUpdate; CertificateRejected if
    it is not one (this says nothing yet about freshness)."""
    if len(der) > MAX_CRL_BYTES:
        raise CertificateRejected(f"relayed CRL is larger than {MAX_CRL_BYTES} bytes")
    try:
        crl = x509.load_der_x509_crl(der)
    except ValueError:
        raise CertificateRejected("relayed CRL is not a DER X.509 CRL") from None
    key = ca_cert.public_key()
    if crl.issuer != ca_cert.subject or not isinstance(
        key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey
    ):
        raise CertificateRejected("relayed CRL was not issued by this site's federation CA")
    if not crl.is_signature_valid(key):
        raise CertificateRejected("relayed CRL does not carry a valid federation CA signature")
    next_update = crl.next_update_utc
    if next_update is None:
        raise CertificateRejected("relayed CRL has no nextUpdate (freshness unknown)")
    try:
        number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        raise CertificateRejected("relayed CRL has no CRL number") from None
    return AcceptedCrl(
        number=number,
        next_update=next_update,
        revoked=frozenset(entry.serial_number for entry in crl),
    )


class SiteRevocation:
    """The last CRL this site accepted, and the checks a round needs from it."""

    def __init__(self, ca_cert: x509.Certificate) -> None:
        self._ca = ca_cert
        self.current: AcceptedCrl | None = None
        self._last_problem = "the coordinator has not relayed the federation CRL"

    def offer(self, der: bytes, *, now: dt.datetime) -> None:
        """Consider a CRL relayed by the coordinator; keep the newest valid one.

        A forged, stale or older CRL is logged and ignored: the one we hold (if any)
        stays, and `require_fresh` refuses rounds once that one is stale too.
        """
        if not der:
            if self.current is None:
                self._last_problem = "the coordinator relayed no CRL"
            return
        try:
            crl = parse_crl(der, self._ca)
        except CertificateRejected as exc:
            self._last_problem = str(exc)
            log.error("ignoring the CRL relayed by the coordinator: %s", exc)
            return
        if crl.next_update <= now:
            self._last_problem = (
                f"the CRL relayed by the coordinator expired at {crl.next_update.isoformat()}"
            )
            log.error("ignoring a stale CRL: %s", self._last_problem)
            return
        if self.current is not None and crl.number < self.current.number:
            log.error(
                "ignoring CRL number %d: this site already holds number %d (replay)",
                crl.number, self.current.number,
            )
            return
        self.current = crl

    def require_fresh(self, *, now: dt.datetime) -> AcceptedCrl:
        """The accepted CRL if it is still fresh; RoundFailed naming the cause if not."""
        crl = self.current
        if crl is None:
            raise RoundFailed(
                f"revocation status unknown, refusing the round: {self._last_problem}"
            )
        if crl.next_update <= now:
            raise RoundFailed(
                "revocation status unknown, refusing the round: the last CRL this site "
                f"accepted expired at {crl.next_update.isoformat()} and the coordinator "
                "relayed no newer one (the CA operator runs `medfed pki crl`)"
            )
        return crl

    def check_peer(self, site_id: str, cert: x509.Certificate, *, now: dt.datetime) -> None:
        """ProtocolAbort(REVOKED_PEER) when a roster peer's certificate is revoked."""
        crl = self.require_fresh(now=now)
        if cert.serial_number in crl.revoked:
            raise ProtocolAbort(
                AbortReason.REVOKED_PEER,
                f"roster entry {site_id!r} carries a revoked certificate "
                f"(serial {cert.serial_number:x}, CRL number {crl.number})",
            )
