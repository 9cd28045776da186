"""The federation PKI: one CA, a coordinator server certificate, client certificates
for sites and monitors.

Layout of a PKI directory ``D`` (made by ``medfed pki``)::

    D/ca.crt               federation CA certificate (every party gets a copy)
    D/ca.key               CA private key (never leaves the operator)
    D/crl.pem              certificate revocation list, signed by the CA
    D/coordinator.crt/.key coordinator server certificate (serverAuth),
                             SAN URI ``medfed://coordinator/NAME`` plus its host names
    D/sites/SITE_ID.crt    site client certificate (clientAuth), CN = SITE_ID,
                             SAN URI ``medfed://site/SITE_ID``; signed from the
                             hospital's CSR (``pki sign``): the key stays at the hospital
    D/monitors/NAME.crt/.key  monitor client certificate (health probes, status),
                             SAN URI ``medfed://monitor/NAME``
    D/replaced/            old files moved aside by ``issue --force`` / ``sign --replace``

Every leaf names its *role* in exactly one ``medfed://ROLE/NAME`` SAN URI. Only a site
certificate may enrol, appear in a roster or sign SecAgg messages; a monitor may call
Health and read-only status RPCs; a coordinator certificate is a server identity only.

A hospital makes its own key and a CSR (``pki request``), the operator signs the CSR
(``pki sign``) and returns the certificate: the operator never holds a site key.
``pki issue --site`` (the operator generates the key) is for single-host demos only.
Private keys are PKCS#8 PEM, *unencrypted*, written with mode 0600 into a 0700
directory; a key file readable by others is refused (`load_private_key_file`). Files
are never overwritten silently.

Identity rule of DESIGN.md ("Identity and trust"): the coordinator takes a caller's
site id from the verified peer certificate (`PeerVerifier.verify`), never from a
message field.

Checks follow RFC 5280 for the one-level chain we issue (CA -> leaf): issuer name
and signature (s. 6.1.3 (a)(1)), validity (s. 4.1.2.5), revocation by CRL (s. 5 and
6.3, CRL signature and freshness included), extended key usage (s. 4.2.1.12).
"""

from __future__ import annotations

import datetime as dt
import enum
import ipaddress
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.errors import (
    AbortReason,
    CertificateRejected,
    ConfigError,
    PkiError,
    ProtocolAbort,
)
from common.fileio import atomic_write

Algorithm: TypeAlias = Literal["ecdsa-p256", "ed25519"]
ALGORITHMS: tuple[Algorithm, ...] = ("ecdsa-p256", "ed25519")

PrivateKey: TypeAlias = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
PublicKey: TypeAlias = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CRL_FILE = "crl.pem"
COORDINATOR_CERT = "coordinator.crt"
COORDINATOR_KEY = "coordinator.key"
SITES_DIR = "sites"
MONITORS_DIR = "monitors"
REPLACED_DIR = "replaced"
CSR_SUFFIX = ".csr"


class Role(enum.Enum):
    """What a certificate may do; named by its ``medfed://ROLE/NAME`` SAN URI."""

    SITE = "site"
    COORDINATOR = "coordinator"
    MONITOR = "monitor"


ROLE_URI_SCHEME = "medfed://"
SITE_URI_PREFIX = ROLE_URI_SCHEME + Role.SITE.value + "/"
DEFAULT_COORDINATOR_NAME = "coordinator"
# `fullmatch` (not `match` with `$`) so that a trailing newline is not accepted.
SITE_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")

DEFAULT_CA_VALIDITY_DAYS = 3650
# 397 days: the CA/Browser Forum ceiling for leaf certificates, a sane rotation period.
DEFAULT_LEAF_VALIDITY_DAYS = 397
DEFAULT_CRL_VALIDITY_DAYS = 30
EXPIRY_WARNING_DAYS = 30
# Leaf certificates start a little in the past so that a hospital clock running a few
# minutes behind the operator's does not reject a freshly issued certificate.
CLOCK_SKEW_ALLOWANCE = dt.timedelta(minutes=5)


# --------------------------------------------------------------------------- helpers


def _utc(now: dt.datetime | None) -> dt.datetime:
    """`now` as an aware UTC datetime; the wall clock only when the caller passes None."""
    if now is None:
        return dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        return now.replace(tzinfo=dt.UTC)
    return now.astimezone(dt.UTC)


def validate_site_id(site_id: str) -> str:
    """Return `site_id` if it is a legal site id (also a safe file name), else ConfigError."""
    if not isinstance(site_id, str) or SITE_ID_PATTERN.fullmatch(site_id) is None:
        raise ConfigError(
            "site_id",
            f"{site_id!r} is not a valid site id: use 1-63 characters from a-z, 0-9, "
            "'.', '_', '-', starting with a letter or digit",
        )
    return site_id


def _validate_algorithm(algorithm: str) -> Algorithm:
    for known in ALGORITHMS:
        if algorithm == known:
            return known
    raise ConfigError("algorithm", f"{algorithm!r} is not one of {', '.join(ALGORITHMS)}")


def _validate_days(field: str, days: int) -> int:
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ConfigError(field, f"must be a positive number of days, got {days!r}")
    return days


def _generate_key(algorithm: Algorithm) -> PrivateKey:
    if algorithm == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    return ec.generate_private_key(ec.SECP256R1())


def _signature_hash(key: PrivateKey) -> hashes.SHA256 | None:
    # Ed25519 hashes internally (RFC 8410 s. 6: no separate digest algorithm).
    return None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()


def _key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_new_file(path: Path, data: bytes, *, mode: int) -> None:
    """Create `path` with `mode`; refuse if it exists (O_EXCL: no race, no silent overwrite)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise PkiError(
            f"{path} already exists; refusing to overwrite it (use `issue --force` to move "
            "the old files aside, or choose another directory)"
        ) from None
    except OSError as exc:
        raise PkiError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _refuse_existing(paths: Sequence[Path]) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise PkiError(
            f"{', '.join(existing)} already exist(s); refusing to overwrite (pass --force "
            "to move the old files aside into replaced/)"
        )


def _move_aside(directory: Path, paths: Sequence[Path], now: dt.datetime) -> None:
    replaced = directory / REPLACED_DIR
    replaced.mkdir(mode=0o700, exist_ok=True)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    for path in paths:
        if not path.exists():
            continue
        target = replaced / f"{path.name}.{stamp}"
        counter = 1
        while target.exists():
            target = replaced / f"{path.name}.{stamp}.{counter}"
            counter += 1
        os.replace(path, target)


def _check_key_file_mode(path: Path, st: os.stat_result) -> None:
    """PkiError unless only the owner can read `path`.

    The rule of PostgreSQL's ``ssl_key_file`` check: 0600 (or stricter) for a file the
    service owns; a root-owned file may also be readable by its group (0640), which is
    how a Kubernetes Secret mounted with ``fsGroup`` reaches a non-root service.
    """
    mode = stat.S_IMODE(st.st_mode)
    allowed = 0o037 if st.st_uid == 0 else 0o077
    if mode & allowed:
        raise PkiError(
            f"private key {path} is readable by {'others' if mode & 0o007 else 'its group'} "
            f"(mode {mode:04o}); only its owner may read it: run `chmod 600 {path}`"
        )


def read_private_key_pem(path: str | os.PathLike[str]) -> bytes:
    """The PEM bytes of a private key file, after checking that only its owner can read it.

    Call this (or `load_private_key_file`) wherever a service loads a key at start-up,
    so a key left world-readable stops the service with one clear error.
    """
    file = Path(path)
    try:
        with open(file, "rb") as handle:
            _check_key_file_mode(file, os.fstat(handle.fileno()))
            return handle.read()
    except FileNotFoundError:
        raise PkiError(f"private key {file} does not exist") from None
    except IsADirectoryError:
        raise PkiError(f"private key {file} is a directory, not a key file") from None
    except PermissionError:
        raise PkiError(f"private key {file} cannot be read by this user") from None
    except OSError as exc:
        raise PkiError(f"cannot read private key {file}: {exc.strerror}") from None


def load_private_key_file(path: str | os.PathLike[str]) -> PrivateKey:
    """Load an unencrypted PEM EC or Ed25519 key; PkiError if it is readable by others."""
    file = Path(path)
    data = read_private_key_pem(file)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{file} is not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey):
        raise PkiError(f"{file}: unsupported key type {type(key).__name__}")
    return key


def _ski(cert: x509.Certificate) -> x509.SubjectKeyIdentifier:
    return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value


# --------------------------------------------------------------------------- loading


def load_certificate(path: str | os.PathLike[str]) -> x509.Certificate:
    """Load one PEM (or DER) certificate; PkiError naming the file if that fails."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise PkiError(f"certificate {file} does not exist") from None
    except OSError as exc:
        raise PkiError(f"cannot read certificate {file}: {exc.strerror}") from None
    try:
        return parse_certificate(data)
    except CertificateRejected:
        raise PkiError(f"{file} is not a PEM or DER X.509 certificate") from None


def parse_certificate(data: bytes) -> x509.Certificate:
    """Parse PEM or DER bytes; CertificateRejected if they are not a certificate."""
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError:
        raise CertificateRejected("peer certificate cannot be parsed") from None


def load_ca(directory: str | os.PathLike[str]) -> x509.Certificate:
    """The federation CA certificate ``D/ca.crt``."""
    return load_certificate(Path(directory) / CA_CERT)


def _load_ca_key(directory: Path) -> tuple[x509.Certificate, PrivateKey]:
    cert = load_ca(directory)
    key = load_private_key_file(directory / CA_KEY)
    if key.public_key() != cert.public_key():
        raise PkiError(f"{directory / CA_KEY} does not belong to {directory / CA_CERT}")
    return cert, key


@dataclass(frozen=True)
class CertificateIdentity:
    """Role and name a certificate carries in its ``medfed://ROLE/NAME`` SAN URI."""

    role: Role
    name: str


def _identity_from_names(
    uris: Sequence[str], common_names: Sequence[str], *, what: str
) -> CertificateIdentity:
    """The one ``medfed://ROLE/NAME`` URI among `uris`; CN must equal NAME for a site."""
    ours = [uri for uri in uris if uri.startswith(ROLE_URI_SCHEME)]
    if len(ours) != 1:
        raise CertificateRejected(
            f"{what} must carry exactly one {ROLE_URI_SCHEME}ROLE/NAME URI, found {len(ours)}"
        )
    role_name, _, name = ours[0][len(ROLE_URI_SCHEME) :].partition("/")
    try:
        role = Role(role_name)
    except ValueError:
        raise CertificateRejected(f"{what} names an unknown role {role_name!r}") from None
    if SITE_ID_PATTERN.fullmatch(name) is None:
        label = "site id" if role is Role.SITE else f"{role.value} name"
        raise CertificateRejected(f"{what} names an invalid {label} {name!r}")
    if role is not Role.COORDINATOR and list(common_names) != [name]:
        raise CertificateRejected(
            f"{what} subject CN {list(common_names)!r} does not match its "
            f"{role.value} name {name!r}"
        )
    return CertificateIdentity(role=role, name=name)


def certificate_identity(cert: x509.Certificate) -> CertificateIdentity:
    """Role and name of `cert`; CertificateRejected if it names none, several or a bad one."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertificateRejected("certificate has no subjectAltName naming its role") from None
    common_names = [attr.value for attr in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return _identity_from_names(
        san.get_values_for_type(x509.UniformResourceIdentifier),
        [str(cn) for cn in common_names],
        what="certificate",
    )


def certificate_role(cert: x509.Certificate) -> Role:
    """The role `cert` names (site, coordinator, monitor); CertificateRejected if none."""
    return certificate_identity(cert).role


def site_id_from_certificate(cert: x509.Certificate) -> str:
    """The site id named by `cert`: its one ``medfed://site/ID`` SAN URI, equal to its CN.

    A monitor or coordinator certificate is refused: only sites enrol and sign.
    """
    identity = certificate_identity(cert)
    if identity.role is not Role.SITE:
        raise CertificateRejected(
            f"certificate is a {identity.role.value} certificate ({identity.name!r}), "
            "not a site certificate"
        )
    return identity.name


def check_roster_certificate(
    certificate: bytes | x509.Certificate,
    *,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    site_id: str,
) -> x509.Certificate:
    """The certificate of roster entry `site_id`, checked as a site would check it.

    It must chain to the site's own copy of the CA, be valid at `now`, be a clientAuth
    leaf and name the role *site* with id `site_id`. A certificate of another role
    (a monitor, or the coordinator posing as a hospital) aborts the round with
    ``not_a_site``; other failures raise CertificateRejected.
    """
    cert = (
        certificate
        if isinstance(certificate, x509.Certificate)
        else parse_certificate(certificate)
    )
    what = f"roster certificate of {site_id!r}"
    check_issued_by(cert, ca_cert, what=what)
    check_validity_window(cert, now, what=what)
    identity = certificate_identity(cert)
    if identity.role is not Role.SITE:
        raise ProtocolAbort(
            AbortReason.NOT_A_SITE,
            f"roster entry {site_id!r} carries a {identity.role.value} certificate "
            f"({identity.name!r}); only site certificates may take part in a round",
        )
    if _is_ca(cert) or not has_extended_key_usage(cert, ExtendedKeyUsageOID.CLIENT_AUTH):
        raise ProtocolAbort(
            AbortReason.NOT_A_SITE,
            f"roster entry {site_id!r} carries a certificate that is not a site "
            "(clientAuth leaf) certificate",
        )
    if identity.name != site_id:
        raise CertificateRejected(f"{what} names site {identity.name!r}")
    return cert


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def public_key_fingerprint(cert: x509.Certificate | x509.CertificateSigningRequest) -> str:
    """Hex SHA-256 of the certificate's (or request's) SubjectPublicKeyInfo (DER): what a
    hospital reads to the operator over the phone to confirm the CSR is its own. The
    same for a request and the certificate signed from it (the key is the same)."""
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest = hashes.Hash(hashes.SHA256())
    digest.update(spki)
    return digest.finalize().hex()


def days_until_expiry(cert: x509.Certificate, now: dt.datetime) -> float:
    """Days (fractional, negative once expired) until `cert`'s notAfter."""
    return (cert.not_valid_after_utc - _utc(now)).total_seconds() / 86400.0


def check_validity_window(cert: x509.Certificate, now: dt.datetime, *, what: str) -> None:
    """CertificateRejected if `now` is outside [notBefore, notAfter] (RFC 5280 s. 4.1.2.5)."""
    moment = _utc(now)
    if moment < cert.not_valid_before_utc:
        raise CertificateRejected(
            f"{what} is not valid yet (notBefore {cert.not_valid_before_utc.isoformat()})"
        )
    if moment > cert.not_valid_after_utc:
        raise CertificateRejected(f"{what} expired at {cert.not_valid_after_utc.isoformat()}")


def check_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate, *, what: str) -> None:
    """CertificateRejected unless `ca_cert` issued `cert` (issuer name and signature)."""
    try:
        # Checks issuer == CA subject and the CA's signature (EC, Ed25519, RSA alike).
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise CertificateRejected(f"{what} is not signed by the federation CA") from None


def has_extended_key_usage(cert: x509.Certificate, usage: x509.ObjectIdentifier) -> bool:
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False
    return usage in eku


# --------------------------------------------------------------------------- issuing


def init_ca(
    directory: str | os.PathLike[str],
    *,
    algorithm: str = "ecdsa-p256",
    validity_days: int = DEFAULT_CA_VALIDITY_DAYS,
    name: str = "medfed federation CA",
    crl_validity_days: int = DEFAULT_CRL_VALIDITY_DAYS,
    now: dt.datetime | None = None,
) -> x509.Certificate:
    """Create the federation CA in `directory` (0700) plus an empty, signed CRL.

    Refuses if a CA is already there: replacing a CA silently would lock every site out.
    """
    root = Path(directory)
    chosen = _validate_algorithm(algorithm)
    _validate_days("validity_days", validity_days)
    _validate_days("crl_validity_days", crl_validity_days)
    moment = _utc(now)
    _refuse_existing([root / CA_CERT, root / CA_KEY, root / CRL_FILE])
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    (root / SITES_DIR).mkdir(mode=0o700, exist_ok=True)

    key = _generate_key(chosen)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    public_key = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(moment - CLOCK_SKEW_ALLOWANCE)
        .not_valid_after(moment + dt.timedelta(days=validity_days))
        # path_length=0: this CA signs leaves only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(key, _signature_hash(key))
    )
    _write_new_file(root / CA_KEY, _key_pem(key), mode=0o600)
    _write_new_file(root / CA_CERT, _cert_pem(cert), mode=0o644)
    _write_crl(root, cert, key, revoked=[], number=1, now=moment, validity_days=crl_validity_days)
    return cert


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
    # P-256: gRPC's TLS cannot use Ed25519 leaf keys (see common/tls.py).
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
