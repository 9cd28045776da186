"""Issuing leaf certificates: one signing routine (`issue_certificate`) with a profile
per role (coordinator server, site client, monitor client) and the paths each role's
files live at.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.core.errors import (
    ConfigError,
)
from common.protocol.pki.base import (
    _DNS_LABEL,
    CLOCK_SKEW_ALLOWANCE,
    COORDINATOR_CERT,
    COORDINATOR_KEY,
    DEFAULT_COORDINATOR_NAME,
    DEFAULT_LEAF_VALIDITY_DAYS,
    MONITORS_DIR,
    ROLE_URI_SCHEME,
    SITE_ID_PATTERN,
    SITES_DIR,
    PublicKey,
    Role,
    _cert_pem,
    _generate_key,
    _key_pem,
    _move_aside,
    _refuse_existing,
    _signature_hash,
    _ski,
    _utc,
    _validate_algorithm,
    _validate_days,
    _write_new_file,
    validate_site_id,
)
from common.protocol.pki.loading import _load_ca_key, check_validity_window


@dataclass(frozen=True)
class IssuedPair:
    """Where `issue_*` wrote a certificate and its key, and the certificate itself."""

    certificate: x509.Certificate
    cert_path: Path
    key_path: Path


def _role_uri(role: Role, name: str) -> x509.UniformResourceIdentifier:
    return x509.UniformResourceIdentifier(f"{ROLE_URI_SCHEME}{role.value}/{name}")


def _host_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    if isinstance(hosts, str):
        raise ConfigError("hosts", "pass a sequence of host names, not one string")
    names: list[x509.GeneralName] = []
    for raw in hosts:
        host = raw.strip()
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
            continue
        except ValueError:
            pass
        labels = host.rstrip(".").split(".")
        if not host or len(host) > 253 or not all(_DNS_LABEL.fullmatch(x) for x in labels):
            raise ConfigError("hosts", f"{raw!r} is neither an IP address nor a DNS name")
        names.append(x509.DNSName(host.rstrip(".").lower()))
    if not names:
        raise ConfigError("hosts", "the coordinator certificate needs at least one host name")
    return names


def site_paths(directory: str | os.PathLike[str], site_id: str) -> tuple[Path, Path]:
    """(certificate, key) paths of `site_id` inside a PKI directory."""
    validate_site_id(site_id)
    sites = Path(directory) / SITES_DIR
    return sites / f"{site_id}.crt", sites / f"{site_id}.key"


def monitor_paths(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """(certificate, key) paths of monitor `name` inside a PKI directory."""
    _validate_name("monitor", name)
    monitors = Path(directory) / MONITORS_DIR
    return monitors / f"{name}.crt", monitors / f"{name}.key"


def _validate_name(role: str, name: str) -> str:
    if not isinstance(name, str) or SITE_ID_PATTERN.fullmatch(name) is None:
        raise ConfigError(
            role,
            f"{name!r} is not a valid {role} name: use 1-63 characters from a-z, 0-9, "
            "'.', '_', '-', starting with a letter or digit",
        )
    return name


def role_paths(directory: str | os.PathLike[str], role: Role, name: str) -> tuple[Path, Path]:
    """(certificate, key) paths of (role, name) inside a PKI directory; ConfigError for a
    name that is not a legal one. There is one coordinator certificate per directory."""
    if role is Role.SITE:
        return site_paths(directory, name)
    if role is Role.MONITOR:
        return monitor_paths(directory, name)
    if not isinstance(name, str) or SITE_ID_PATTERN.fullmatch(name) is None:
        raise ConfigError("name", f"{name!r} is not a valid coordinator name")
    root = Path(directory)
    return root / COORDINATOR_CERT, root / COORDINATOR_KEY


@dataclass(frozen=True)
class _LeafProfile:
    """What a role's certificate says: subject CN, SANs and extended key usage."""

    subject_cn: str
    san: list[x509.GeneralName]
    usage: x509.ObjectIdentifier


def _leaf_profile(role: Role, name: str, hosts: Sequence[str]) -> _LeafProfile:
    """The coordinator serves TLS (serverAuth, its host names first, then the role URI);
    sites and monitors are clients (clientAuth, CN and role URI name them)."""
    if role is Role.COORDINATOR:
        return _LeafProfile(
            subject_cn="medfed coordinator",
            san=[*_host_names(hosts), _role_uri(role, name)],
            usage=ExtendedKeyUsageOID.SERVER_AUTH,
        )
    if hosts:
        raise ConfigError("hosts", f"a {role.value} certificate names no hosts")
    return _LeafProfile(
        subject_cn=name, san=[_role_uri(role, name)], usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )


def _sign_leaf(
    root: Path,
    profile: _LeafProfile,
    *,
    public_key: PublicKey,
    validity_days: int,
    moment: dt.datetime,
) -> x509.Certificate:
    """The one place an end-entity certificate is made: CA-signed, for `public_key`
    (never sees a private key), saying what `profile` says."""
    ca_cert, ca_key = _load_ca_key(root)
    check_validity_window(ca_cert, moment, what="the federation CA certificate")
    # A leaf never outlives its CA: clients would reject the chain anyway.
    not_after = min(moment + dt.timedelta(days=validity_days), ca_cert.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, profile.subject_cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(moment - CLOCK_SKEW_ALLOWANCE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([profile.usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(profile.san), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(_ski(ca_cert)),
            critical=False,
        )
        .sign(ca_key, _signature_hash(ca_key))
    )


def issue_certificate(
    directory: str | os.PathLike[str],
    role: Role,
    name: str,
    *,
    hosts: Sequence[str] = (),
    validity_days: int = DEFAULT_LEAF_VALIDITY_DAYS,
    algorithm: str = "ecdsa-p256",
    force: bool = False,
    now: dt.datetime | None = None,
) -> IssuedPair:
    """Generate a key here and issue the (role, name) certificate for it, writing the
    pair at `role_paths` (key 0600, certificate 0644).

    Refuses to overwrite an existing pair unless `force`, which moves the old files
    aside into ``replaced/``. `hosts` (DNS names / IPs) is for the coordinator only.
    """
    root = Path(directory)
    cert_path, key_path = role_paths(root, role, name)
    profile = _leaf_profile(role, name, hosts)
    chosen = _validate_algorithm(algorithm)
    _validate_days("validity_days", validity_days)
    moment = _utc(now)
    _load_ca_key(root)  # fail before moving anything aside
    if force:
        _move_aside(root, [cert_path, key_path], moment)
    _refuse_existing([cert_path, key_path])
    key = _generate_key(chosen)
    cert = _sign_leaf(
        root, profile, public_key=key.public_key(), validity_days=validity_days, moment=moment
    )
    cert_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_new_file(key_path, _key_pem(key), mode=0o600)
    _write_new_file(cert_path, _cert_pem(cert), mode=0o644)
    return IssuedPair(certificate=cert, cert_path=cert_path, key_path=key_path)


def issue_coordinator(
    directory: str | os.PathLike[str],
    hosts: Sequence[str],
    *,
    validity_days: int = DEFAULT_LEAF_VALIDITY_DAYS,
    algorithm: str = "ecdsa-p256",
    force: bool = False,
    now: dt.datetime | None = None,
    name: str = DEFAULT_COORDINATOR_NAME,
) -> IssuedPair:
    """Issue ``coordinator.crt/.key``: serverAuth, SANs the given DNS names / IPs plus
    the role URI ``medfed://coordinator/NAME``.

    Loopback names are included only if listed: a production certificate should not be
    valid for ``localhost``.
    """
    return issue_certificate(
        directory, Role.COORDINATOR, name, hosts=hosts, validity_days=validity_days,
        algorithm=algorithm, force=force, now=now,
    )


def issue_site(
    directory: str | os.PathLike[str],
    site_id: str,
    *,
    validity_days: int = DEFAULT_LEAF_VALIDITY_DAYS,
    algorithm: str = "ecdsa-p256",
    force: bool = False,
    now: dt.datetime | None = None,
) -> IssuedPair:
    """Issue ``sites/SITE_ID.crt/.key``: clientAuth, CN and SAN URI name the site.

    SINGLE-HOST DEMOS AND TESTS ONLY: the operator generates the hospital's private key
    here. A real hospital runs `request_certificate` and the operator `sign_request`.
    """
    return issue_certificate(
        directory, Role.SITE, site_id, validity_days=validity_days, algorithm=algorithm,
        force=force, now=now,
    )


def issue_monitor(
    directory: str | os.PathLike[str],
    name: str,
    *,
    validity_days: int = DEFAULT_LEAF_VALIDITY_DAYS,
    algorithm: str = "ecdsa-p256",
    force: bool = False,
    now: dt.datetime | None = None,
) -> IssuedPair:
    """Issue ``monitors/NAME.crt/.key``: clientAuth, SAN URI ``medfed://monitor/NAME``.

    A monitor (health probe, status dashboard) may call Health, reflection and the
    read-only status RPCs and nothing else; it can never enrol or sign as a site.
    """
    return issue_certificate(
        directory, Role.MONITOR, name, validity_days=validity_days, algorithm=algorithm,
        force=force, now=now,
    )


