"""PeerVerifier: chain, validity window, revocation (with live CRL reload), usage, site id."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.core.errors import CertificateRejected, PkiError
from common.protocol import pki


def _site_cert(directory: Path, site_id: str) -> x509.Certificate:
    return pki.load_certificate(directory / "sites" / f"{site_id}.crt")


def _crl_number(directory: Path) -> int:
    crl = pki.load_crl(directory / "crl.pem", pki.load_ca(directory))
    return crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number


def test_valid_site_returns_its_id_from_pem_der_or_object(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    cert = _site_cert(pki_dir, "h2")
    pem = cert.public_bytes(serialization.Encoding.PEM)
    der = cert.public_bytes(serialization.Encoding.DER)
    assert verifier.verify(pem, now=now) == "h2"
    assert verifier.verify(der, now=now) == "h2"
    assert verifier.verify(cert, now=now) == "h2"


def test_foreign_ca_with_same_name_rejected(
    pki_dir: Path, foreign_dir: Path, now: dt.datetime
) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    impostor = _site_cert(foreign_dir, "h1")
    assert impostor.issuer == pki.load_ca(pki_dir).subject  # same name, different key
    with pytest.raises(CertificateRejected, match="not signed by the federation CA"):
        verifier.verify(impostor, now=now)


def test_expired_and_not_yet_valid(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    old = pki.issue_site(
        pki_dir, "old", validity_days=1, now=now - dt.timedelta(days=3)
    ).certificate
    future = pki.issue_site(pki_dir, "future", now=now + dt.timedelta(days=2)).certificate
    with pytest.raises(CertificateRejected, match="expired"):
        verifier.verify(old, now=now)
    with pytest.raises(CertificateRejected, match="not valid yet"):
        verifier.verify(future, now=now)
    # The same certificates are fine inside their windows (the check really is the clock).
    assert verifier.verify(old, now=now - dt.timedelta(days=2.5)) == "old"
    assert verifier.verify(future, now=now + dt.timedelta(days=3)) == "future"


def test_remembered_certificate_is_still_checked_against_clock_and_crl(
    pki_dir: Path, foreign_dir: Path, now: dt.datetime
) -> None:
    """The verifier remembers a certificate's signature and usage checks by fingerprint
    (one CA signature check per certificate, not per RPC); what changes with time is
    not remembered: a certificate that passed is refused once it expires or is revoked,
    and a same-named certificate from another CA is a different certificate."""
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    short = pki.issue_site(pki_dir, "short", validity_days=1, now=now).certificate
    assert verifier.verify(short, now=now) == "short"
    assert verifier.verify(short, now=now) == "short"  # now from memory
    with pytest.raises(CertificateRejected, match="expired"):
        verifier.verify(short, now=now + dt.timedelta(days=2))
    genuine = _site_cert(pki_dir, "h1")
    assert verifier.verify(genuine, now=now) == "h1"
    impostor = _site_cert(foreign_dir, "h1")
    assert impostor.subject == genuine.subject
    with pytest.raises(CertificateRejected, match="not signed by the federation CA"):
        verifier.verify(impostor, now=now)
    with pytest.raises(CertificateRejected, match="not signed by the federation CA"):
        verifier.verify(impostor, now=now)  # a refusal is never remembered as a pass
    pki.revoke_site(pki_dir, "short", now=now)
    with pytest.raises(CertificateRejected, match="revoked"):
        verifier.verify(short, now=now)


def test_revocation_picked_up_without_new_verifier(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    h1, h2 = _site_cert(pki_dir, "h1"), _site_cert(pki_dir, "h2")
    first_number = _crl_number(pki_dir)
    assert verifier.verify(h1, now=now) == "h1"
    serials = pki.revoke_site(pki_dir, "h1", now=now)
    assert serials == [h1.serial_number]
    with pytest.raises(CertificateRejected, match="revoked"):
        verifier.verify(h1, now=now)
    assert verifier.verify(h2, now=now) == "h2"  # others unaffected
    # Revoking is idempotent and the CRL number increases.
    pki.revoke_site(pki_dir, "h1", now=now)
    crl = pki.load_crl(pki_dir / "crl.pem", pki.load_ca(pki_dir))
    assert [e.serial_number for e in crl] == [h1.serial_number]
    assert _crl_number(pki_dir) == first_number + 2


def test_revoke_covers_replaced_certificates(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    first = _site_cert(pki_dir, "h1")
    second = pki.issue_site(pki_dir, "h1", force=True, now=now).certificate
    assert verifier.verify(first, now=now) == "h1"  # renewal leaves the old one valid
    pki.revoke_site(pki_dir, "h1", now=now)
    for cert in (first, second):
        with pytest.raises(CertificateRejected, match="revoked"):
            verifier.verify(cert, now=now)


def test_revoke_unknown_site(pki_dir: Path) -> None:
    with pytest.raises(PkiError, match="no certificate"):
        pki.revoke_site(pki_dir, "nobody")


def test_forged_crl_fails_closed(pki_dir: Path, foreign_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    h1 = _site_cert(pki_dir, "h1")
    # An attacker who can write crl.pem but lacks the CA key swaps in another CA's CRL
    # (for example one that "un-revokes" a site): the verifier refuses everyone.
    os.replace(foreign_dir / "crl.pem", pki_dir / "crl.pem")
    with pytest.raises(CertificateRejected, match="revocation status unknown"):
        verifier.verify(h1, now=now)
    with pytest.raises(PkiError):
        pki.PeerVerifier.from_pki_dir(pki_dir)


def test_missing_or_garbage_crl_fails_closed(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    h1 = _site_cert(pki_dir, "h1")
    (pki_dir / "crl.pem").write_bytes(b"-----BEGIN X509 CRL-----\ngarbage\n")
    with pytest.raises(CertificateRejected, match="revocation status unknown"):
        verifier.verify(h1, now=now)
    (pki_dir / "crl.pem").unlink()
    with pytest.raises(CertificateRejected, match="missing"):
        verifier.verify(h1, now=now)
    pki_ca = pki.load_ca(pki_dir)
    with pytest.raises(PkiError, match="missing"):
        pki.PeerVerifier(pki_ca, pki_dir / "crl.pem")


def test_stale_crl_rejects_until_refreshed(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    h1 = _site_cert(pki_dir, "h1")
    later = now + dt.timedelta(days=pki.DEFAULT_CRL_VALIDITY_DAYS + 1)
    with pytest.raises(CertificateRejected, match="CRL expired"):
        verifier.verify(h1, now=later)
    pki.refresh_crl(pki_dir, now=later)
    assert verifier.verify(h1, now=later) == "h1"


def test_server_certificate_is_not_a_client(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    coordinator = pki.load_certificate(pki_dir / "coordinator.crt")
    with pytest.raises(CertificateRejected, match="client authentication"):
        verifier.verify(coordinator, now=now)


def _ca_signed(
    pki_dir: Path,
    now: dt.datetime,
    *,
    cn: str,
    uris: list[str],
) -> x509.Certificate:
    """A clientAuth certificate genuinely signed by our CA but with chosen names."""
    ca_cert = pki.load_ca(pki_dir)
    ca_key = serialization.load_pem_private_key((pki_dir / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)
    )
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
            False,
        )
    return builder.sign(ca_key, hashes.SHA256())


@pytest.mark.parametrize(
    ("cn", "uris", "message"),
    [
        ("h1", [], "no subjectAltName"),
        ("h1", ["medfed://site/h2"], "does not match"),
        ("h1", ["medfed://site/h1", "medfed://site/h2"], "exactly one"),
        ("H1", ["medfed://site/H1"], "invalid site id"),
    ],
)
def test_site_id_must_be_unambiguous(
    pki_dir: Path, now: dt.datetime, cn: str, uris: list[str], message: str
) -> None:
    cert = _ca_signed(pki_dir, now, cn=cn, uris=uris)
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    with pytest.raises(CertificateRejected, match=message):
        verifier.verify(cert, now=now)


def test_verifying_key_for(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    h1 = _site_cert(pki_dir, "h1")
    der = h1.public_bytes(serialization.Encoding.DER)
    key = verifier.verifying_key_for("h1", der, now=now)
    # The returned key really is h1's: it verifies a signature made with h1's key file.
    private = serialization.load_pem_private_key((pki_dir / "sites/h1.key").read_bytes(), None)
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert isinstance(key, ec.EllipticCurvePublicKey)
    key.verify(
        private.sign(b"roster", ec.ECDSA(hashes.SHA256())), b"roster", ec.ECDSA(hashes.SHA256())
    )
    with pytest.raises(CertificateRejected, match="not 'h2'"):
        verifier.verifying_key_for("h2", der, now=now)


def test_ed25519_federation_verifies_and_revokes(tmp_path: Path, now: dt.datetime) -> None:
    pki.init_ca(tmp_path, algorithm="ed25519", now=now)
    cert = pki.issue_site(tmp_path, "h1", algorithm="ed25519", now=now).certificate
    verifier = pki.PeerVerifier.from_pki_dir(tmp_path)
    assert verifier.verify(cert, now=now) == "h1"
    pki.revoke_site(tmp_path, "h1", now=now)
    with pytest.raises(CertificateRejected, match="revoked"):
        verifier.verify(cert, now=now)


def test_garbage_bytes_rejected(pki_dir: Path, now: dt.datetime) -> None:
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    for junk in (b"", b"\x30\x03\x02\x01\x01", b"-----BEGIN CERTIFICATE-----\nxx\n"):
        with pytest.raises(CertificateRejected):
            verifier.verify(junk, now=now)
