"""Creating the federation CA (``medfed pki init``): its key, self-signed certificate
and first, empty CRL.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

from common.protocol.pki.base import (
    CA_CERT,
    CA_KEY,
    CLOCK_SKEW_ALLOWANCE,
    CRL_FILE,
    DEFAULT_CA_VALIDITY_DAYS,
    DEFAULT_CRL_VALIDITY_DAYS,
    SITES_DIR,
    _cert_pem,
    _generate_key,
    _key_pem,
    _refuse_existing,
    _signature_hash,
    _utc,
    _validate_algorithm,
    _validate_days,
    _write_new_file,
)
from common.protocol.pki.crl import _write_crl

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
