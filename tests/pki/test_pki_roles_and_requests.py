"""Hospital-held keys (CSR flow), certificate roles and key-file permissions: real files
on disk, the real CLI in a subprocess, real crypto."""

from __future__ import annotations

import datetime as dt
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from common.core.errors import (
    AbortReason,
    CertificateRejected,
    ConfigError,
    PkiError,
    ProtocolAbort,
)
from common.protocol import pki, tls
from common.protocol.pki import Role
from tests.pki.credentials import site_credentials

REPO = Path(__file__).resolve().parents[2]


def medfed(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "common.commands.pki", "pki", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def private_keys_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()]


def test_csr_flow_leaves_no_site_key_at_the_operator(tmp_path: Path) -> None:
    operator, hospital = tmp_path / "operator", tmp_path / "hospital"
    assert medfed("init", "--dir", operator).returncode == 0
    assert medfed("issue", "--dir", operator, "--coordinator", "fl.example.org").returncode == 0
    requested = medfed("request", "--site", "st-marys", "--out", hospital)
    assert requested.returncode == 0, requested.stderr
    key, csr = hospital / "st-marys.key", hospital / "st-marys.csr"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(hospital.stat().st_mode) == 0o700
    assert b"PRIVATE KEY" not in csr.read_bytes()

    signed = medfed("sign", "--dir", operator, "--csr", csr)
    assert signed.returncode == 0, signed.stderr
    cert = pki.load_certificate(operator / "sites/st-marys.crt")
    assert pki.certificate_identity(cert) == pki.CertificateIdentity(Role.SITE, "st-marys")
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "st-marys"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "medfed://site/st-marys"
    ]
    assert pki.has_extended_key_usage(cert, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH)
    assert pki.public_key_fingerprint(cert) in signed.stdout
    # The certificate belongs to the hospital's key, which never left the hospital.
    assert pki.load_private_key_file(key).public_key() == cert.public_key()
    # Only the CA and coordinator keys are at the operator.
    assert sorted(p.name for p in private_keys_under(operator)) == ["ca.key", "coordinator.key"]

    # The hospital's three files make working TLS credentials.
    (hospital / "sites").mkdir()
    os.replace(key, hospital / "sites/st-marys.key")
    (hospital / "sites/st-marys.crt").write_bytes((operator / "sites/st-marys.crt").read_bytes())
    (hospital / "ca.crt").write_bytes((operator / "ca.crt").read_bytes())
    tls.load_tls_material(tls.TlsFiles.for_site(hospital, "st-marys"))


def test_sign_refuses_a_second_valid_certificate_unless_replace(
    pki_dir: Path, tmp_path: Path, now: dt.datetime
) -> None:
    files = pki.request_certificate(tmp_path / "h1-again", "h1")
    with pytest.raises(PkiError, match="already has a valid certificate"):
        pki.sign_request(pki_dir, files.csr_path, now=now)
    cli = medfed("sign", "--dir", pki_dir, "--csr", files.csr_path)
    assert cli.returncode == 2 and "--replace" in cli.stderr
    old = pki.load_certificate(pki_dir / "sites/h1.crt")

    replaced = pki.sign_request(pki_dir, files.csr_path, replace=True, now=now)
    assert replaced.revoked_serials == (old.serial_number,)
    assert old.serial_number in pki.revoked_serials(pki_dir)
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    with pytest.raises(CertificateRejected, match="revoked"):
        verifier.verify(old, now=now)
    assert verifier.verify(replaced.certificate, now=now) == "h1"
    # A new id, or an id whose certificate was revoked, needs no --replace.
    pki.revoke_site(pki_dir, "h2", now=now)
    again = pki.request_certificate(tmp_path / "h2-again", "h2")
    assert pki.sign_request(pki_dir, again.csr_path, now=now).identity.name == "h2"


def _csr(
    key: ec.EllipticCurvePrivateKey, *, cn: str, uris: list[str]
) -> x509.CertificateSigningRequest:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    )
    if uris:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
            critical=False,
        )
    return builder.sign(key, hashes.SHA256())


@pytest.mark.parametrize(
    ("cn", "uris", "message"),
    [
        ("h9", [], "exactly one"),
        ("h9", ["medfed://site/h8"], "does not match"),
        ("h9", ["medfed://site/h9", "medfed://monitor/h9"], "exactly one"),
        ("H9", ["medfed://site/H9"], "invalid site id"),
        ("coordinator", ["medfed://coordinator/coordinator"], "only site and monitor"),
        ("h9", ["medfed://admin/h9"], "unknown role"),
    ],
)
def test_sign_validates_the_requested_identity(
    pki_dir: Path, tmp_path: Path, cn: str, uris: list[str], message: str
) -> None:
    path = tmp_path / "bad.csr"
    path.write_bytes(
        _csr(ec.generate_private_key(ec.SECP256R1()), cn=cn, uris=uris).public_bytes(
            serialization.Encoding.PEM
        )
    )
    with pytest.raises(PkiError, match=message):
        pki.sign_request(pki_dir, path)
    assert not (pki_dir / "sites/h9.crt").exists()


def test_sign_refuses_a_tampered_request_and_a_private_key(
    pki_dir: Path, tmp_path: Path
) -> None:
    files = pki.request_certificate(tmp_path / "req", "h7")
    der = bytearray(
        x509.load_pem_x509_csr(files.csr_path.read_bytes()).public_bytes(
            serialization.Encoding.DER
        )
    )
    der[-1] ^= 0x01  # flip a bit of the signature
    tampered = tmp_path / "tampered.csr"
    tampered.write_bytes(bytes(der))
    with pytest.raises(PkiError, match="signature does not verify"):
        pki.sign_request(pki_dir, tampered)
    with pytest.raises(PkiError, match="contains a private key"):
        pki.sign_request(pki_dir, files.key_path)


def test_monitor_request_and_issue(pki_dir: Path, tmp_path: Path, now: dt.datetime) -> None:
    files = pki.request_certificate(tmp_path / "mon", "grafana", role=Role.MONITOR)
    signed = pki.sign_request(pki_dir, files.csr_path, now=now)
    assert signed.cert_path == pki_dir / "monitors/grafana.crt"
    assert pki.certificate_role(signed.certificate) is Role.MONITOR
    issued = pki.issue_monitor(pki_dir, "probe", now=now)
    assert pki.certificate_role(issued.certificate) is Role.MONITOR
    assert stat.S_IMODE(issued.key_path.stat().st_mode) == 0o600
    cli = medfed("issue", "--dir", pki_dir, "--monitor", "probe2")
    assert cli.returncode == 0 and (pki_dir / "monitors/probe2.crt").is_file()
    coordinator = pki.load_certificate(pki_dir / pki.COORDINATOR_CERT)
    assert pki.certificate_identity(coordinator) == pki.CertificateIdentity(
        Role.COORDINATOR, "coordinator"
    )
    assert "SINGLE-HOST DEMO ONLY" in medfed("issue", "--dir", pki_dir, "--site", "x1").stdout
    assert "demos only" in medfed("issue", "--help").stdout


def test_site_id_extraction_refuses_other_roles(pki_dir: Path, now: dt.datetime) -> None:
    monitor = pki.issue_monitor(pki_dir, "h1", now=now).certificate  # same name as a site
    coordinator = pki.load_certificate(pki_dir / pki.COORDINATOR_CERT)
    for cert in (monitor, coordinator):
        with pytest.raises(CertificateRejected, match="not a site certificate"):
            pki.site_id_from_certificate(cert)
    verifier = pki.PeerVerifier.from_pki_dir(pki_dir)
    with pytest.raises(CertificateRejected, match="not a site certificate"):
        verifier.verify(monitor, now=now)
    with pytest.raises(CertificateRejected, match="not a site certificate"):
        verifier.verifying_key_for("h1", monitor, now=now)
    assert verifier.verify_identity(monitor, now=now).role is Role.MONITOR


def test_roster_entry_with_another_role_aborts_not_a_site(
    pki_dir: Path, now: dt.datetime
) -> None:
    ca = pki.load_ca(pki_dir)
    site = pki.load_certificate(pki_dir / "sites/h1.crt")
    der = site.public_bytes(serialization.Encoding.DER)
    assert pki.check_roster_certificate(der, ca_cert=ca, now=now, site_id="h1") == site
    with pytest.raises(CertificateRejected, match="names site 'h1'"):
        pki.check_roster_certificate(site, ca_cert=ca, now=now, site_id="h2")
    monitor = pki.issue_monitor(pki_dir, "h3", now=now).certificate
    coordinator = pki.load_certificate(pki_dir / pki.COORDINATOR_CERT)
    for cert in (monitor, coordinator):
        with pytest.raises(ProtocolAbort) as caught:
            pki.check_roster_certificate(cert, ca_cert=ca, now=now, site_id="h3")
        assert caught.value.reason is AbortReason.NOT_A_SITE


def _owned_by_a_service_user(path: Path) -> None:
    """Tests run as root in some containers: hand the file to an ordinary uid so that
    the rule for a service-owned key applies (root-owned keys may be 0640)."""
    if os.geteuid() == 0:
        os.chown(path, 10001, -1)


@pytest.mark.parametrize("mode", [0o640, 0o644, 0o604, 0o660])
def test_key_readable_by_group_or_others_is_refused_at_start_up(
    pki_dir: Path, mode: int
) -> None:
    key = pki_dir / "sites/h1.key"
    coordinator_key = pki_dir / pki.COORDINATOR_KEY
    for path in (key, coordinator_key, pki_dir / pki.CA_KEY):
        _owned_by_a_service_user(path)
        path.chmod(mode)
    with pytest.raises(PkiError) as caught:
        site_credentials(pki_dir, "h1")
    assert str(key) in str(caught.value) and f"chmod 600 {key}" in str(caught.value)
    with pytest.raises(PkiError, match="chmod 600"):
        pki.load_private_key_file(key)
    with pytest.raises(PkiError, match=str(coordinator_key)):
        tls.server_credentials(pki_dir)
    # The operator's own tools refuse a loose CA key as well.
    with pytest.raises(PkiError, match="chmod 600"):
        pki.issue_monitor(pki_dir, "late")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a root-owned file")
def test_root_owned_key_may_be_group_readable_but_never_world_readable(pki_dir: Path) -> None:
    """A Kubernetes Secret mounted with fsGroup: root-owned, mode 0440 (PostgreSQL's rule)."""
    key = pki_dir / "sites/h1.key"
    os.chown(key, 0, 10001)
    key.chmod(0o440)
    site_credentials(pki_dir, "h1")
    key.chmod(0o444)
    with pytest.raises(PkiError, match="readable by others"):
        site_credentials(pki_dir, "h1")


def test_owner_only_keys_are_accepted(pki_dir: Path) -> None:
    key = pki_dir / "sites/h1.key"
    key.chmod(0o400)
    site_credentials(pki_dir, "h1")
    assert pki.read_private_key_pem(key).startswith(b"-----BEGIN PRIVATE KEY-----")


def test_tls_material_checks_the_role(pki_dir: Path, now: dt.datetime) -> None:
    pki.issue_monitor(pki_dir, "probe", now=now)
    # A monitor pair presented as a site's (e.g. a mis-mounted probe certificate).
    files = tls.TlsFiles(
        role=Role.SITE,
        ca=pki_dir / pki.CA_CERT,
        cert=pki_dir / "monitors/probe.crt",
        key=pki_dir / "monitors/probe.key",
    )
    with pytest.raises(PkiError, match="is a monitor certificate"):
        tls.load_tls_material(files)
    tls.load_tls_material(tls.TlsFiles.for_monitor(pki_dir, "probe"))


def _fingerprint_in(text: str) -> str:
    (found,) = re.findall(r"public key SHA-256 ([0-9a-f]{64})", text)
    return found


def test_request_prints_the_fingerprint_that_sign_and_members_show(tmp_path: Path) -> None:
    """The hospital reads out the fingerprint `pki request` printed; the operator's
    `pki sign` and `pki members` show the same one for the certificate signed from it."""
    operator, hospital = tmp_path / "operator", tmp_path / "hospital"
    assert medfed("init", "--dir", operator).returncode == 0
    requested = medfed("request", "--site", "st-marys", "--out", hospital)
    assert requested.returncode == 0, requested.stderr
    own = _fingerprint_in(requested.stdout)
    assert own == pki.public_key_fingerprint(
        x509.load_pem_x509_csr((hospital / "st-marys.csr").read_bytes()))

    signed = medfed("sign", "--dir", operator, "--csr", hospital / "st-marys.csr")
    assert signed.returncode == 0, signed.stderr
    assert _fingerprint_in(signed.stdout) == own
    assert pki.public_key_fingerprint(pki.load_certificate(operator / "sites/st-marys.crt")) == own
    members = medfed("members", "--dir", operator)
    assert members.returncode == 0, members.stderr
    assert f'"st-marys" = "{own}"' in members.stdout.splitlines()


def test_list_keeps_certificates_moved_aside_by_sign_replace(tmp_path: Path) -> None:
    """`sign --replace` revokes the old certificate and moves it into replaced/: `pki
    list` still shows it, marked replaced and revoked, beside the current one."""
    operator = tmp_path / "operator"
    assert medfed("init", "--dir", operator).returncode == 0
    first = medfed("request", "--site", "h1", "--out", tmp_path / "first")
    assert first.returncode == 0, first.stderr
    assert medfed("sign", "--dir", operator, "--csr", tmp_path / "first/h1.csr").returncode == 0
    old = pki.load_certificate(operator / "sites/h1.crt")
    second = medfed("request", "--site", "h1", "--out", tmp_path / "second")
    assert second.returncode == 0, second.stderr
    replaced = medfed("sign", "--dir", operator, "--csr", tmp_path / "second/h1.csr",
                      "--replace")
    assert replaced.returncode == 0, replaced.stderr
    new = pki.load_certificate(operator / "sites/h1.crt")

    listed = medfed("list", "--dir", operator)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[1]: line.split()[-2:] for line in listed.stdout.splitlines()
            if line.startswith("CN=h1")}
    assert rows == {f"{old.serial_number:x}": ["replaced", "yes"],
                    f"{new.serial_number:x}": ["current", "no"]}
    assert "file" in listed.stdout.splitlines()[0].split()


def _profile(cert: x509.Certificate) -> list[tuple[str, bool, object]]:
    """Extensions as (oid, critical, value), key identifiers left out (they differ per key)."""
    ids = x509.oid.ExtensionOID
    skip = {ids.SUBJECT_KEY_IDENTIFIER, ids.AUTHORITY_KEY_IDENTIFIER}
    return [
        (e.oid.dotted_string, e.critical, None if e.oid in skip else e.value)
        for e in cert.extensions
    ]


@pytest.mark.parametrize("role", [Role.SITE, Role.MONITOR])
def test_a_signed_request_and_an_issued_pair_are_the_same_certificate(
    pki_dir: Path, tmp_path: Path, now: dt.datetime, role: Role
) -> None:
    """One issuing routine: the operator-generated pair and the hospital's signed CSR
    carry the same subject, extensions and validity for the same role and name."""
    issued = pki.issue_certificate(pki_dir, role, "ward-7", now=now).certificate
    request = pki.request_certificate(tmp_path / "hospital", "ward-7", role=role)
    signed = pki.sign_request(pki_dir, request.csr_path, replace=True, now=now).certificate
    assert signed.subject == issued.subject
    assert _profile(signed) == _profile(issued)
    assert (signed.not_valid_before_utc, signed.not_valid_after_utc) == (
        issued.not_valid_before_utc,
        issued.not_valid_after_utc,
    )
    assert pki.certificate_role(signed) is role


def test_only_the_coordinator_certificate_names_hosts(pki_dir: Path, now: dt.datetime) -> None:
    with pytest.raises(ConfigError, match="names no hosts"):
        pki.issue_certificate(pki_dir, Role.SITE, "h9", hosts=["localhost"], now=now)
    assert not (pki_dir / pki.SITES_DIR / "h9.crt").exists()
