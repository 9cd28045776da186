"""Creating the CA and issuing certificates: layout, contents, permissions, no overwrite."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.errors import ConfigError, PkiError
from common.protocol import pki


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_layout_and_key_permissions(pki_dir: Path) -> None:
    for name in ["ca.crt", "ca.key", "crl.pem", "coordinator.crt", "coordinator.key"]:
        assert (pki_dir / name).is_file(), name
    assert (pki_dir / "sites" / "h1.crt").is_file()
    for key in [pki_dir / "ca.key", pki_dir / "coordinator.key", pki_dir / "sites/h1.key"]:
        assert _mode(key) == 0o600, key
        assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert _mode(pki_dir) == 0o700


def test_init_writes_empty_signed_crl(pki_dir: Path) -> None:
    crl = pki.load_crl(pki_dir / "crl.pem", pki.load_ca(pki_dir))
    assert len(crl) == 0
    assert crl.next_update_utc is not None


def test_site_certificate_names_site_and_is_client_only(pki_dir: Path) -> None:
    cert = pki.load_certificate(pki_dir / "sites" / "h1.crt")
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "h1"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["medfed://site/h1"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert pki.site_id_from_certificate(cert) == "h1"
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    cert.verify_directly_issued_by(pki.load_ca(pki_dir))


def test_coordinator_sans_are_exactly_the_hosts_given(tmp_path: Path) -> None:
    pki.init_ca(tmp_path)
    issued = pki.issue_coordinator(tmp_path, ["fl.example.org", "10.0.0.7", "::1"])
    san = issued.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    assert san.value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.7"),
        ipaddress.ip_address("::1"),
    ]
    eku = issued.certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]


@pytest.mark.parametrize("hosts", [[], ["bad host"], ["-x.org"], "fl.example.org"])
def test_bad_coordinator_hosts_rejected(tmp_path: Path, hosts: list[str]) -> None:
    pki.init_ca(tmp_path)
    with pytest.raises(ConfigError) as info:
        pki.issue_coordinator(tmp_path, hosts)
    assert info.value.field == "hosts"


def test_never_overwrites(pki_dir: Path) -> None:
    before = (pki_dir / "sites" / "h1.key").read_bytes()
    with pytest.raises(PkiError, match="refusing to overwrite"):
        pki.issue_site(pki_dir, "h1")
    with pytest.raises(PkiError, match="refusing to overwrite"):
        pki.issue_coordinator(pki_dir, ["localhost"])
    with pytest.raises(PkiError, match="refusing to overwrite"):
        pki.init_ca(pki_dir)
    assert (pki_dir / "sites" / "h1.key").read_bytes() == before


def test_force_moves_old_pair_aside(pki_dir: Path) -> None:
    old_cert = (pki_dir / "sites" / "h1.crt").read_bytes()
    old_key = (pki_dir / "sites" / "h1.key").read_bytes()
    pki.issue_site(pki_dir, "h1", force=True)
    assert (pki_dir / "sites" / "h1.crt").read_bytes() != old_cert
    moved = sorted((pki_dir / "replaced").iterdir())
    assert [p.read_bytes() for p in moved] == [old_cert, old_key]
    moved_key = next(p for p in moved if ".key." in p.name)
    assert _mode(moved_key) == 0o600


def test_existing_file_created_concurrently_is_not_clobbered(pki_dir: Path) -> None:
    # Another process created the key file first: O_EXCL makes us fail, not overwrite.
    squatter = pki_dir / "sites" / "h3.key"
    squatter.write_bytes(b"not ours")
    with pytest.raises(PkiError):
        pki.issue_site(pki_dir, "h3")
    assert squatter.read_bytes() == b"not ours"
    assert not (pki_dir / "sites" / "h3.crt").exists()


@settings(max_examples=40, deadline=None)
@given(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,62}", fullmatch=True))
def test_valid_site_ids_accepted(site_id: str) -> None:
    assert pki.validate_site_id(site_id) == site_id


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=70))
def test_site_id_validation_matches_pattern(candidate: str) -> None:
    legal = (
        0 < len(candidate) <= 63
        and candidate[0] in "abcdefghijklmnopqrstuvwxyz0123456789"
        and all(c in "abcdefghijklmnopqrstuvwxyz0123456789._-" for c in candidate)
    )
    if legal:
        assert pki.validate_site_id(candidate) == candidate
    else:
        with pytest.raises(ConfigError) as info:
            pki.validate_site_id(candidate)
        assert info.value.field == "site_id"


@pytest.mark.parametrize("site_id", ["H1", "../ca", "h1\n", "", "-h", "a" * 64, "h/1"])
def test_issue_rejects_bad_site_ids_without_writing(pki_dir: Path, site_id: str) -> None:
    before = sorted(p.name for p in (pki_dir / "sites").iterdir())
    with pytest.raises(ConfigError):
        pki.issue_site(pki_dir, site_id)
    assert sorted(p.name for p in (pki_dir / "sites").iterdir()) == before


def test_ed25519_ca_and_leaves(tmp_path: Path) -> None:
    pki.init_ca(tmp_path, algorithm="ed25519")
    issued = pki.issue_site(tmp_path, "h1", algorithm="ed25519")
    ca = pki.load_ca(tmp_path)
    assert isinstance(ca.public_key(), ed25519.Ed25519PublicKey)
    assert isinstance(issued.certificate.public_key(), ed25519.Ed25519PublicKey)
    issued.certificate.verify_directly_issued_by(ca)
    # The CRL is signed with Ed25519 too and verifies.
    assert len(pki.load_crl(tmp_path / "crl.pem", ca)) == 0


def test_unknown_algorithm_and_bad_validity(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        pki.init_ca(tmp_path, algorithm="rsa-1024")
    with pytest.raises(ConfigError):
        pki.init_ca(tmp_path, validity_days=0)
    assert not (tmp_path / "ca.key").exists()


def test_leaf_never_outlives_ca(tmp_path: Path) -> None:
    start = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    ca = pki.init_ca(tmp_path, validity_days=100, now=start)
    issued = pki.issue_site(tmp_path, "h1", validity_days=397, now=start)
    assert issued.certificate.not_valid_after_utc == ca.not_valid_after_utc


def test_issue_with_expired_ca_refused(tmp_path: Path) -> None:
    pki.init_ca(tmp_path, validity_days=10, now=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
    with pytest.raises(PkiError, match="expired"):
        pki.issue_site(tmp_path, "h1", now=dt.datetime(2021, 1, 1, tzinfo=dt.UTC))


def test_days_until_expiry(tmp_path: Path) -> None:
    start = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    pki.init_ca(tmp_path, now=start)
    cert = pki.issue_site(tmp_path, "h1", validity_days=20, now=start).certificate
    assert pki.days_until_expiry(cert, start) == pytest.approx(20.0)
    assert pki.days_until_expiry(cert, start + dt.timedelta(days=25)) == pytest.approx(-5.0)


def test_load_certificate_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="does not exist"):
        pki.load_certificate(tmp_path / "nope.crt")
    garbage = tmp_path / "garbage.crt"
    garbage.write_bytes(b"\x00\x01garbage")
    with pytest.raises(PkiError, match=r"garbage\.crt"):
        pki.load_certificate(garbage)
