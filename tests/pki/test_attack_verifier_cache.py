"""Attack probes (s5 review) on PeerVerifier's fingerprint cache: what a cached pass can
and cannot be reused for. These assert the secure behaviour and PASS on main (the cache
held up): a pass is per certificate bytes and per verifier (its CA), the coordinator
certificate (no clientAuth) is never cached as a pass, a certificate re-issued under
the same name is verified afresh, and the cache stays bounded."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509

from common.core.errors import CertificateRejected
from common.protocol import pki


def _site_cert(directory: Path, site_id: str) -> x509.Certificate:
    cert_path, _ = pki.site_paths(directory, site_id)
    return x509.load_pem_x509_certificate(cert_path.read_bytes())


def test_a_pass_cached_by_one_federation_is_not_a_pass_in_another(
    pki_dir: Path, foreign_dir: Path, now: dt.datetime
) -> None:
    ours = pki.PeerVerifier.from_pki_dir(pki_dir)
    theirs = pki.PeerVerifier.from_pki_dir(foreign_dir)
    foreign_h1 = _site_cert(foreign_dir, "h1")
    assert theirs.verify(foreign_h1, now=now) == "h1"  # cached as a pass over there
    with pytest.raises(CertificateRejected, match="not signed by the federation CA"):
        ours.verify(foreign_h1, now=now)


def test_reissued_certificate_of_a_revoked_name_is_checked_afresh(
    pki_dir: Path, now: dt.datetime
) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    old = _site_cert(pki_dir, "h1")
    assert verifier.verify(old, now=now) == "h1"
    pki.revoke_site(pki_dir, "h1", now=now)
    with pytest.raises(CertificateRejected, match="revoked"):
        verifier.verify(old, now=now)  # the cached pass does not outlive the CRL
    new = pki.issue_site(pki_dir, "h1", now=now, force=True).certificate
    assert verifier.verify(new, now=now) == "h1"
    with pytest.raises(CertificateRejected, match="revoked"):
        verifier.verify(old, now=now)


def test_server_certificate_is_never_a_cached_client(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    coordinator = x509.load_pem_x509_certificate(
        (pki_dir / pki.COORDINATOR_CERT).read_bytes())
    for _ in range(2):
        with pytest.raises(CertificateRejected):
            verifier.verify_identity(coordinator, now=now)


def test_cache_is_bounded(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    verifier.STATIC_CACHE_ENTRIES = 2  # instance override of the class bound
    certs = [pki.issue_site(pki_dir, f"s{i}", now=now).certificate for i in range(4)]
    for cert in certs:
        verifier.verify(cert, now=now)
    assert len(verifier._static) == 2
