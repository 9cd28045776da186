"""Signed ledger entries and signed histories: what a site's ledger holds, what it
exports, what the coordinator's replica keeps and what `medfed ledger restore` reads.

Each entry is signed with the site's certificate key (the mTLS identity; the same key
signs TLS handshakes and SecAgg messages), so the signed bytes are
``encode_fields("medfed/v1/ledger-entry", canonical JSON of the entry body)``: the label
is the first, length-prefixed field, which no TLS 1.3 CertificateVerify (64 spaces
first) and no SecAgg statement (other labels) can start with. The body holds the site
id, seq, round, purpose, mechanisms, epsilon after the entry, accountant, time, previous
entry hash and the SHA-256 of the signing certificate (DER); the certificates themselves
are kept beside the entries, so a history still verifies after a certificate is replaced.

Chaining: seq 1's ``prev_hash`` is the header (terms) hash; each later one is the
previous entry's hash = SHA-256(body). Recomputing hashes after an edit no longer helps a
forger: the signatures over the bodies fail, unless they hold the site's key.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from common.core.errors import (
    ConfigError,
    CryptoError,
    LedgerIntegrityError,
    PkiError,
    ValidationError,
)
from common.core.parsing import parse_json
from common.crypto.encoding import encode_fields
from common.crypto.signing import SigningKey, VerifyingKey
from common.privacy.mechanisms import (
    Mechanism,
    Segment,
    canonical_json,
    mechanism_from_json_dict,
    mechanism_to_json_dict,
)
from common.privacy.purpose import PURPOSES
from common.protocol.pki import check_issued_by, site_id_from_certificate

LEDGER_FORMAT: Final = "medfed-privacy-ledger/2"
EXPORT_FORMAT: Final = "medfed-ledger-export/1"
ENTRY_SIGNATURE_LABEL: Final = "medfed/v1/ledger-entry"
PRIVACY_UNITS: Final = ("record", "patient", "hospital")
CHARGE_UNIT: Final = "unit"
"""A ledger's budget charge: the whole history composed, each hospital-level round at its
add/remove-one-unit sensitivity S (the default; a header without a `charge` field)."""
CHARGE_RECORD_LEVEL: Final = "record_level"
"""A hospital-unit ledger's budget charge: the per-record/per-patient figure, each
hospital-level round at the replace relation 2S (`common.privacy.layered.charged`)."""
CHARGES: Final = (CHARGE_UNIT, CHARGE_RECORD_LEVEL)
_HEX64 = re.compile(r"[0-9a-f]{64}")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def certificate_sha256(der: bytes) -> str:
    """The fingerprint entries use to name their signing certificate."""
    return sha256_hex(bytes(der))


@dataclass(frozen=True)
class LedgerTerms:
    """A ledger's fixed terms (its header); their hash is the chain's genesis."""

    site_id: str
    budget_epsilon: float
    delta: float
    accountant: str
    privacy_unit: str
    # What the budget is charged with (CHARGES). The default is left out of the header's
    # JSON, so a ledger written before this field existed keeps its header hash.
    charge: str = CHARGE_UNIT

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": LEDGER_FORMAT,
            "site_id": self.site_id,
            "budget_epsilon": float(self.budget_epsilon),
            "delta": float(self.delta),
            "accountant": self.accountant,
            "privacy_unit": self.privacy_unit,
        }
        if self.charge != CHARGE_UNIT:
            out["charge"] = self.charge
        return out

    @property
    def header_hash(self) -> str:
        return sha256_hex(canonical_json(self.to_json_dict()))

    @classmethod
    def from_json_dict(cls, raw: object) -> LedgerTerms:
        if not isinstance(raw, dict):
            raise ConfigError("header", "must be a JSON object")
        expected = {"format", "site_id", "budget_epsilon", "delta", "accountant", "privacy_unit"}
        if set(raw) - {"header_hash", "charge"} != expected:
            raise ConfigError("header", f"needs the fields {sorted(expected)} (and may "
                              "hold `charge`)")
        charge = _text("charge", raw.get("charge", CHARGE_UNIT))
        if charge not in CHARGES or ("charge" in raw and charge == CHARGE_UNIT):
            # The default is never written: a header naming it is not one this code made.
            raise ConfigError("charge", f"must be {CHARGE_RECORD_LEVEL!r} when present, "
                              f"got {charge!r}")
        if raw["format"] != LEDGER_FORMAT:
            raise ConfigError("header", f"unknown ledger format {raw['format']!r}")
        terms = cls(
            site_id=_text("site_id", raw["site_id"]),
            budget_epsilon=_finite("budget_epsilon", raw["budget_epsilon"]),
            delta=_finite("delta", raw["delta"]),
            accountant=_text("accountant", raw["accountant"]),
            privacy_unit=_text("privacy_unit", raw["privacy_unit"]),
            charge=charge,
        )
        if "header_hash" in raw and raw["header_hash"] != terms.header_hash:
            raise ConfigError("header_hash", "does not match the header's fields")
        return terms


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(name, f"must be a string, got {value!r}")
    return value


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(name, f"must be a finite number, got {value!r}")
    return float(value)


def _integer(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")
    return value


def _hex64(name: str, value: object) -> str:
    text = _text(name, value)
    if _HEX64.fullmatch(text) is None:
        raise ConfigError(name, "must be a lower-case hex SHA-256")
    return text


MAX_QUERY_NAME: Final = 64
_QUERY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class QueryRef:
    """The approved query a "query" ledger entry answered: its name and the SHA-256 of
    its canonical bytes (what the site approved, `medfed site approve`)."""

    name: str
    sha256: str

    def __post_init__(self) -> None:
        if _QUERY_NAME.fullmatch(self.name) is None:
            raise ConfigError("query.name", "must be 1-64 letters, digits, '.', '_' or '-', "
                              f"got {self.name[:80]!r}")
        if _HEX64.fullmatch(self.sha256) is None:
            raise ConfigError("query.sha256", "must be a lower-case hex SHA-256")

    def to_json_dict(self) -> dict[str, str]:
        return {"name": self.name, "sha256": self.sha256}

    @classmethod
    def from_json_dict(cls, raw: object) -> QueryRef:
        if not isinstance(raw, dict) or set(raw) != {"name", "sha256"}:
            raise ConfigError("query", "must be an object with exactly name and sha256")
        return cls(name=_text("query.name", raw["name"]),
                   sha256=_text("query.sha256", raw["sha256"]))


@dataclass(frozen=True)
class SignedEntry:
    """One ledger entry: the mechanisms released for `round` and `purpose`, signed."""

    site_id: str
    seq: int
    round: int
    purpose: str
    mechanisms: tuple[Mechanism, ...]
    epsilon_after: float
    accountant_used: str
    created_at: str
    prev_hash: str
    cert_sha256: str
    signature: bytes = b""
    # A "query" entry names the approved query it answered (`QueryRef`); None for
    # every other purpose, whose body is then exactly as it always was.
    query: QueryRef | None = None

    def body(self) -> dict[str, Any]:
        """Everything the signature covers (all fields but the signature)."""
        body: dict[str, Any] = {
            "site_id": self.site_id,
            "seq": self.seq,
            "round": self.round,
            "purpose": self.purpose,
            "mechanisms": [mechanism_to_json_dict(m) for m in self.mechanisms],
            "epsilon_after": float(self.epsilon_after),
            "accountant_used": self.accountant_used,
            "created_at": self.created_at,
            "prev_hash": self.prev_hash,
            "cert_sha256": self.cert_sha256,
        }
        if self.query is not None:
            body["query"] = self.query.to_json_dict()
        return body

    def body_bytes(self) -> bytes:
        return canonical_json(self.body())

    @property
    def entry_hash(self) -> str:
        return sha256_hex(self.body_bytes())

    def signed_message(self) -> bytes:
        return signed_message(self.body_bytes())

    # `medfed ledger show --json` reports each entry's DP-SGD segments, steps and status.
    @property
    def segments(self) -> tuple[Segment, ...]:
        """The DP-SGD (sampled Gaussian) mechanisms of this entry."""
        return tuple(m for m in self.mechanisms if isinstance(m, Segment))

    @property
    def status(self) -> str:
        return "committed"

    def to_json_dict(self) -> dict[str, Any]:
        return {
            **self.body(),
            "entry_hash": self.entry_hash,
            "signature": self.signature.hex(),
        }

    @classmethod
    def from_json_dict(cls, raw: object) -> SignedEntry:
        """Strict parse (ConfigError names the bad field); checks `entry_hash`."""
        if not isinstance(raw, dict):
            raise ConfigError("entry", "must be a JSON object")
        expected = {
            "site_id", "seq", "round", "purpose", "mechanisms", "epsilon_after",
            "accountant_used", "created_at", "prev_hash", "cert_sha256", "entry_hash",
            "signature",
        }
        if set(raw) - {"query"} != expected:
            raise ConfigError("entry", f"needs exactly the fields {sorted(expected)} "
                              "(and, for a query entry, query)")
        mechanisms_raw = raw["mechanisms"]
        if not isinstance(mechanisms_raw, list) or not mechanisms_raw:
            raise ConfigError("mechanisms", "must be a non-empty list")
        purpose = _text("purpose", raw["purpose"])
        if purpose not in PURPOSES:
            raise ConfigError("purpose", f"must be one of {PURPOSES}, got {purpose!r}")
        try:
            signature = bytes.fromhex(_text("signature", raw["signature"]))
        except ValueError:
            raise ConfigError("signature", "must be hex") from None
        entry = cls(
            site_id=_text("site_id", raw["site_id"]),
            seq=_integer("seq", raw["seq"], minimum=1),
            round=_integer("round", raw["round"], minimum=0),
            purpose=purpose,
            mechanisms=tuple(mechanism_from_json_dict(m) for m in mechanisms_raw),
            epsilon_after=_finite("epsilon_after", raw["epsilon_after"]),
            accountant_used=_text("accountant_used", raw["accountant_used"]),
            created_at=_text("created_at", raw["created_at"]),
            prev_hash=_hex64("prev_hash", raw["prev_hash"]),
            cert_sha256=_hex64("cert_sha256", raw["cert_sha256"]),
            signature=signature,
            query=QueryRef.from_json_dict(raw["query"]) if "query" in raw else None,
        )
        if (entry.query is not None) != (purpose == "query"):
            raise ConfigError("query", f"entry seq={entry.seq}: a query entry, and only one, "
                              "names its query")
        if raw["entry_hash"] != entry.entry_hash:
            raise ConfigError("entry_hash", f"entry seq={entry.seq}: does not match its fields")
        return entry


def signed_message(body: bytes) -> bytes:
    """The exact bytes a ledger entry's signature covers (domain-separated)."""
    return encode_fields(ENTRY_SIGNATURE_LABEL, body)


class LedgerSigner:
    """The site's certificate key and its certificate (DER), checked to belong together.

    Build it from the site's mTLS files (`from_files`) or from loaded objects."""

    def __init__(self, signing_key: SigningKey, certificate_der: bytes) -> None:
        self.signing_key = signing_key
        self.certificate_der = bytes(certificate_der)
        certificate = _parse_certificate(self.certificate_der)
        if VerifyingKey.from_certificate(certificate) != signing_key.verifying_key:
            raise ConfigError("signer", "the signing key does not match the certificate")
        self.site_id = certified_site_id(certificate)
        self.cert_sha256 = certificate_sha256(self.certificate_der)

    @classmethod
    def from_files(cls, certificate_path: Any, key_path: Any) -> LedgerSigner:
        """From a site's PEM certificate and PEM private key (as `medfed pki` writes)."""
        try:
            pem = Path(certificate_path).read_bytes()
            key_pem = Path(key_path).read_bytes()
        except OSError as exc:
            raise ConfigError("signer", f"cannot read {exc.filename}: {exc.strerror}") from None
        try:
            certificate = x509.load_pem_x509_certificate(pem)
        except ValueError:
            raise ConfigError("signer", f"{certificate_path} is not a PEM certificate") from None
        return cls(SigningKey.from_pem(key_pem), certificate.public_bytes(Encoding.DER))

    def sign(self, entry: SignedEntry) -> SignedEntry:
        if entry.cert_sha256 != self.cert_sha256:
            raise ConfigError("signer", "entry names another certificate")
        return replace(entry, signature=self.signing_key.sign(entry.signed_message()))


def _parse_certificate(der: bytes) -> x509.Certificate:
    try:
        return x509.load_der_x509_certificate(bytes(der))
    except ValueError:
        raise ConfigError("certificate", "not a DER X.509 certificate") from None


def certified_site_id(certificate: x509.Certificate) -> str:
    """The site id a certificate names (its medfed://site/ID SAN, equal to its CN)."""
    return site_id_from_certificate(certificate)


@dataclass(frozen=True)
class HistoryProblem:
    """One integrity failure; `seq` is the entry concerned (None: the header)."""

    seq: int | None
    message: str

    def __str__(self) -> str:
        where = "header" if self.seq is None else f"entry seq={self.seq}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class SignedHistory:
    """A site's signed ledger history (or a suffix of it): the export / replica format."""

    terms: LedgerTerms
    entries: tuple[SignedEntry, ...]
    certificates: Mapping[str, bytes] = field(default_factory=dict)  # sha256 hex -> DER
    # A site's own backup also carries its signed head receipt (`common.privacy.receipts`,
    # raw JSON here: parsed and verified by whoever restores it).
    head_receipt: Mapping[str, Any] | None = None

    @property
    def head_hash(self) -> str:
        return self.entries[-1].entry_hash if self.entries else self.terms.header_hash

    @property
    def head_seq(self) -> int:
        return self.entries[-1].seq if self.entries else 0

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no whitespace): the same history, the same bytes."""
        used = sorted({e.cert_sha256 for e in self.entries})
        extra = {} if self.head_receipt is None else {"head_receipt": dict(self.head_receipt)}
        return canonical_json(
            {
                **extra,
                "format": EXPORT_FORMAT,
                "header": {**self.terms.to_json_dict(), "header_hash": self.terms.header_hash},
                "entries": [e.to_json_dict() for e in self.entries],
                "certificates": {
                    digest: base64.b64encode(self.certificates[digest]).decode("ascii")
                    for digest in used
                    if digest in self.certificates
                },
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedHistory:
        """Strict parse of `to_bytes` output (LedgerIntegrityError if malformed)."""
        try:
            raw = parse_json(data)
        except ValidationError as exc:
            raise LedgerIntegrityError(f"not a ledger export ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != EXPORT_FORMAT:
            raise LedgerIntegrityError(f"not a ledger export (format is not {EXPORT_FORMAT})")
        if set(raw) - {"head_receipt"} != {"format", "header", "entries", "certificates"}:
            raise LedgerIntegrityError("ledger export has unexpected or missing fields")
        receipt = raw.get("head_receipt")
        if receipt is not None and not isinstance(receipt, dict):
            raise LedgerIntegrityError("ledger export: head_receipt must be an object")
        try:
            terms = LedgerTerms.from_json_dict(raw["header"])
            if not isinstance(raw["entries"], list):
                raise ConfigError("entries", "must be a list")
            entries = tuple(SignedEntry.from_json_dict(e) for e in raw["entries"])
            certs_raw = raw["certificates"]
            if not isinstance(certs_raw, dict):
                raise ConfigError("certificates", "must be an object")
            certificates: dict[str, bytes] = {}
            for digest, text in certs_raw.items():
                der = base64.b64decode(_text("certificates", text), validate=True)
                if certificate_sha256(der) != digest:
                    raise ConfigError("certificates", f"{digest[:16]}... is not that DER's hash")
                certificates[digest] = der
        except (ConfigError, binascii.Error) as exc:
            raise LedgerIntegrityError(f"malformed ledger export: {exc}") from None
        return cls(terms, entries, certificates, head_receipt=receipt)


def check_entries(
    terms: LedgerTerms,
    entries: Sequence[SignedEntry],
    certificates: Mapping[str, bytes],
    *,
    start_seq: int = 0,
    start_hash: str | None = None,
    ca_certificate: x509.Certificate | None = None,
) -> list[HistoryProblem]:
    """Every problem of `entries` as the continuation of (start_seq, start_hash).

    Checks contiguous seqs, the hash chain, the site id, each signature with the
    certificate it names, that certificate naming the ledger's site and, when
    `ca_certificate` is given, having been issued by that CA (validity windows are not
    checked: an entry stays valid after its certificate expired or was replaced)."""
    problems: list[HistoryProblem] = []
    previous = terms.header_hash if start_hash is None else start_hash
    checked_certs: dict[str, VerifyingKey | str] = {}
    for position, entry in enumerate(entries, start=start_seq + 1):
        if entry.seq != position:
            problems.append(
                HistoryProblem(entry.seq, f"sequence gap: expected seq {position} (entry "
                               "deleted, moved or inserted?)")
            )
        if entry.prev_hash != previous:
            problems.append(
                HistoryProblem(entry.seq, "prev_hash does not match the previous entry "
                               "(deleted/moved/inserted)")
            )
        if entry.site_id != terms.site_id:
            problems.append(HistoryProblem(entry.seq, f"names site {entry.site_id!r}"))
        verifier = checked_certs.get(entry.cert_sha256)
        if verifier is None:
            verifier = _certificate_verifier(
                certificates.get(entry.cert_sha256), terms.site_id, ca_certificate, check_issued_by
            )
            checked_certs[entry.cert_sha256] = verifier
        if isinstance(verifier, str):
            problems.append(HistoryProblem(entry.seq, verifier))
        else:
            try:
                verifier.verify(entry.signed_message(), entry.signature)
            except CryptoError:
                problems.append(
                    HistoryProblem(entry.seq, "signature does not verify (entry edited or "
                                   "signed by another key)")
                )
        previous = entry.entry_hash
    return problems


def _certificate_verifier(
    der: bytes | None,
    site_id: str,
    ca_certificate: x509.Certificate | None,
    check_issued_by: Any,
) -> VerifyingKey | str:
    if der is None:
        return "its signing certificate is missing"
    try:
        certificate = x509.load_der_x509_certificate(der)
        named = certified_site_id(certificate)
        if named != site_id:
            return f"signed by a certificate for site {named!r}, not {site_id!r}"
        if ca_certificate is not None:
            check_issued_by(certificate, ca_certificate, what="its signing certificate")
        return VerifyingKey.from_certificate(certificate)
    except (ValueError, PkiError) as exc:
        return f"unusable signing certificate ({exc})"


def verify_history(
    history: SignedHistory, *, ca_certificate: x509.Certificate | None = None
) -> list[HistoryProblem]:
    """Problems of a whole signed history from its genesis (empty list: it verifies)."""
    return check_entries(
        history.terms, history.entries, history.certificates, ca_certificate=ca_certificate
    )


def utc_timestamp(now: dt.datetime) -> str:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ConfigError("now", "must be timezone-aware")
    return now.isoformat()
