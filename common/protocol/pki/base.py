"""The PKI's names and primitives: roles, directory layout, defaults, key generation,
PEM encoding and the careful file writes every other PKI module uses.
"""

from __future__ import annotations

import datetime as dt
import enum
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypeAlias

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from common.core.errors import (
    ConfigError,
    PkiError,
)

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
