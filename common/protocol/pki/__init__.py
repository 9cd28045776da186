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

The identity rule (docs/pki.md, "In code"): the coordinator takes a caller's site id
from the verified peer certificate (`PeerVerifier.verify`), never from a message field.

Checks follow RFC 5280 for the one-level chain we issue (CA -> leaf): issuer name
and signature (s. 6.1.3 (a)(1)), validity (s. 4.1.2.5), revocation by CRL (s. 5 and
6.3, CRL signature and freshness included), extended key usage (s. 4.2.1.12).

The package, by concern: `base` (names, layout, keys, careful file writes), `loading`
(parsing and the per-certificate checks), `ca` (creating the CA), `issuing` (one
signing routine with a profile per role), `csr` (request and sign), `crl`
(revocation), `verifier` (`PeerVerifier`), `listing` (inventory and members).
Import from ``common.protocol.pki``; the names below are its public interface.
"""

from __future__ import annotations

from common.protocol.pki.base import (
    ALGORITHMS,
    CA_CERT,
    CA_KEY,
    CLOCK_SKEW_ALLOWANCE,
    COORDINATOR_CERT,
    COORDINATOR_KEY,
    CRL_FILE,
    CSR_SUFFIX,
    DEFAULT_CA_VALIDITY_DAYS,
    DEFAULT_COORDINATOR_NAME,
    DEFAULT_CRL_VALIDITY_DAYS,
    DEFAULT_LEAF_VALIDITY_DAYS,
    EXPIRY_WARNING_DAYS,
    MONITORS_DIR,
    REPLACED_DIR,
    ROLE_URI_SCHEME,
    SITE_ID_PATTERN,
    SITE_URI_PREFIX,
    SITES_DIR,
    Algorithm,
    PrivateKey,
    PublicKey,
    Role,
    load_private_key_file,
    read_private_key_pem,
    validate_site_id,
)
from common.protocol.pki.ca import init_ca
from common.protocol.pki.crl import load_crl, refresh_crl, revoke, revoke_site, revoked_serials
from common.protocol.pki.csr import (
    RequestFiles,
    SignedCertificate,
    load_request,
    request_certificate,
    sign_request,
)
from common.protocol.pki.issuing import (
    IssuedPair,
    issue_certificate,
    issue_coordinator,
    issue_monitor,
    issue_site,
    monitor_paths,
    role_paths,
    site_paths,
)
from common.protocol.pki.listing import CertificateInfo, list_certificates, site_members
from common.protocol.pki.loading import (
    CertificateIdentity,
    certificate_identity,
    certificate_role,
    check_issued_by,
    check_roster_certificate,
    check_validity_window,
    days_until_expiry,
    has_extended_key_usage,
    load_ca,
    load_certificate,
    parse_certificate,
    public_key_fingerprint,
    site_id_from_certificate,
)
from common.protocol.pki.verifier import PeerVerifier

__all__ = [
    "ALGORITHMS",
    "CA_CERT",
    "CA_KEY",
    "CLOCK_SKEW_ALLOWANCE",
    "COORDINATOR_CERT",
    "COORDINATOR_KEY",
    "CRL_FILE",
    "CSR_SUFFIX",
    "DEFAULT_CA_VALIDITY_DAYS",
    "DEFAULT_COORDINATOR_NAME",
    "DEFAULT_CRL_VALIDITY_DAYS",
    "DEFAULT_LEAF_VALIDITY_DAYS",
    "EXPIRY_WARNING_DAYS",
    "MONITORS_DIR",
    "REPLACED_DIR",
    "ROLE_URI_SCHEME",
    "SITES_DIR",
    "SITE_ID_PATTERN",
    "SITE_URI_PREFIX",
    "Algorithm",
    "CertificateIdentity",
    "CertificateInfo",
    "IssuedPair",
    "PeerVerifier",
    "PrivateKey",
    "PublicKey",
    "RequestFiles",
    "Role",
    "SignedCertificate",
    "certificate_identity",
    "certificate_role",
    "check_issued_by",
    "check_roster_certificate",
    "check_validity_window",
    "days_until_expiry",
    "has_extended_key_usage",
    "init_ca",
    "issue_certificate",
    "issue_coordinator",
    "issue_monitor",
    "issue_site",
    "list_certificates",
    "load_ca",
    "load_certificate",
    "load_crl",
    "load_private_key_file",
    "load_request",
    "monitor_paths",
    "parse_certificate",
    "public_key_fingerprint",
    "read_private_key_pem",
    "refresh_crl",
    "request_certificate",
    "revoke",
    "revoke_site",
    "revoked_serials",
    "role_paths",
    "sign_request",
    "site_id_from_certificate",
    "site_members",
    "site_paths",
    "validate_site_id",
]
