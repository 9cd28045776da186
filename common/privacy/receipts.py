"""Signed head receipts: the site's own record of how far its ledger went, kept where
losing the state folder does not lose it.

A receipt says "site S's ledger held N entries ending at head H, composed epsilon E,
under the terms with header hash T", signed with the site's certificate key under its
own domain label (``medfed/v1/ledger-head-receipt``, so no ledger entry, TLS handshake
or SecAgg statement signed with the same key can be taken for one). The site writes one
after every commit into a receipts folder it names (`privacy.receipts_dir`, ideally on
another volume or machine) and into every backup it writes (`medfed ledger backup`).

A signed history, however validly signed, cannot prove it is complete: whoever holds an
export can drop its last entries and the rest still verifies. A receipt is what makes
that visible: `medfed ledger restore` refuses a history shorter than, or forked from,
the best receipt it can find, and the site refuses to open such a ledger. Only a site
that loses its state folder AND every copy of its receipts can be lowered.

Pure: no clock (a receipt carries its head entry's own time), no OS randomness.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from cryptography import x509

from common.core.errors import (
    ConfigError,
    CryptoError,
    LedgerForkError,
    LedgerIntegrityError,
    LedgerUnavailable,
    PkiError,
    ValidationError,
)
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from common.crypto.encoding import encode_fields
from common.crypto.signing import SigningKey, VerifyingKey
from common.privacy.mechanisms import canonical_json
from common.privacy.signed import (
    LedgerSigner,
    LedgerTerms,
    SignedEntry,
    certificate_sha256,
    certified_site_id,
)
from common.protocol.pki import check_issued_by

RECEIPT_FORMAT: Final = "medfed-ledger-head-receipt/1"
RECEIPT_SIGNATURE_LABEL: Final = "medfed/v1/ledger-head-receipt"
RECEIPT_SUFFIX: Final = ".head-receipt.json"
# A receipt superseded by an explicitly accepted lower restore: kept, no longer read.
SUPERSEDED_SUFFIX: Final = ".superseded"


@dataclass(frozen=True)
class HeadReceipt:
    """The head of a site's ledger, signed by the site (see the module docstring)."""

    site_id: str
    entries: int
    head_hash: str
    epsilon_spent: float
    header_hash: str
    head_created_at: str
    certificate_der: bytes
    signature: bytes = b""

    def body(self) -> dict[str, Any]:
        return {
            "format": RECEIPT_FORMAT,
            "site_id": self.site_id,
            "entries": self.entries,
            "head_hash": self.head_hash,
            "epsilon_spent": float(self.epsilon_spent),
            "header_hash": self.header_hash,
            "head_created_at": self.head_created_at,
            "cert_sha256": certificate_sha256(self.certificate_der),
        }

    def signed_message(self) -> bytes:
        return encode_fields(RECEIPT_SIGNATURE_LABEL, canonical_json(self.body()))

    def to_json_dict(self) -> dict[str, Any]:
        return {
            **self.body(),
            "certificate": base64.b64encode(self.certificate_der).decode("ascii"),
            "signature": self.signature.hex(),
        }

    def to_bytes(self) -> bytes:
        return canonical_json(self.to_json_dict())

    @classmethod
    def from_json_dict(cls, raw: object) -> HeadReceipt:
        """Strict parse (ConfigError names the field); the signature is NOT checked
        here (`problem` does)."""
        if not isinstance(raw, dict) or raw.get("format") != RECEIPT_FORMAT:
            raise ConfigError("receipt", f"not a head receipt (format {RECEIPT_FORMAT})")
        expected = {"format", "site_id", "entries", "head_hash", "epsilon_spent",
                    "header_hash", "head_created_at", "cert_sha256", "certificate",
                    "signature"}
        if set(raw) != expected:
            raise ConfigError("receipt", f"needs exactly the fields {sorted(expected)}")
        entries = raw["entries"]
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0:
            raise ConfigError("entries", f"must be an integer >= 0, got {entries!r}")
        spent = raw["epsilon_spent"]
        if isinstance(spent, bool) or not isinstance(spent, int | float):
            raise ConfigError("epsilon_spent", f"must be a number, got {spent!r}")
        texts = {name: raw[name] for name in ("site_id", "head_hash", "header_hash",
                                               "head_created_at", "cert_sha256",
                                               "certificate", "signature")}
        for name, value in texts.items():
            if not isinstance(value, str):
                raise ConfigError(name, f"must be a string, got {value!r}")
        try:
            der = base64.b64decode(str(raw["certificate"]), validate=True)
            signature = bytes.fromhex(str(raw["signature"]))
        except (binascii.Error, ValueError):
            raise ConfigError("receipt", "certificate or signature is not encoded") from None
        receipt = cls(
            site_id=str(raw["site_id"]),
            entries=entries,
            head_hash=str(raw["head_hash"]),
            epsilon_spent=float(spent),
            header_hash=str(raw["header_hash"]),
            head_created_at=str(raw["head_created_at"]),
            certificate_der=der,
            signature=signature,
        )
        if receipt.body()["cert_sha256"] != raw["cert_sha256"]:
            raise ConfigError("cert_sha256", "is not the embedded certificate's hash")
        return receipt

    @classmethod
    def from_bytes(cls, data: bytes) -> HeadReceipt:
        try:
            raw = parse_json(data)
        except ValidationError as exc:
            raise ConfigError("receipt", str(exc)) from None
        return cls.from_json_dict(raw)

    def problem(self, *, ca_certificate: x509.Certificate | None = None) -> str | None:
        """Why this receipt cannot be trusted (None: its signature verifies with its
        certificate, which names its site and, with `ca_certificate`, chains to it)."""
        try:
            certificate = x509.load_der_x509_certificate(self.certificate_der)
            named = certified_site_id(certificate)
            if named != self.site_id:
                return f"signed by a certificate for site {named!r}, not {self.site_id!r}"
            if ca_certificate is not None:
                check_issued_by(certificate, ca_certificate, what="its signing certificate")
            VerifyingKey.from_certificate(certificate).verify(
                self.signed_message(), self.signature
            )
        except (ValueError, PkiError, ConfigError):
            return "its certificate is unusable"
        except CryptoError:
            return "its signature does not verify (edited or signed by another key)"
        return None


def sign_receipt(
    signer: LedgerSigner, terms: LedgerTerms, entries: Sequence[SignedEntry]
) -> HeadReceipt:
    """The receipt of a ledger holding `entries` (all of them, from seq 1)."""
    if signer.site_id != terms.site_id:
        raise ConfigError("signer", f"certificate names {signer.site_id!r}, not {terms.site_id!r}")
    head = entries[-1] if entries else None
    receipt = HeadReceipt(
        site_id=terms.site_id,
        entries=len(entries),
        head_hash=head.entry_hash if head else terms.header_hash,
        epsilon_spent=head.epsilon_after if head else 0.0,
        header_hash=terms.header_hash,
        head_created_at=head.created_at if head else "",
        certificate_der=signer.certificate_der,
    )
    key: SigningKey = signer.signing_key
    return replace(receipt, signature=key.sign(receipt.signed_message()))


def receipt_path(folder: str | Path, site_id: str) -> Path:
    """Where the site's latest receipt lives in a receipts folder."""
    return Path(folder) / f"{site_id}{RECEIPT_SUFFIX}"


@dataclass(frozen=True)
class FoundReceipt:
    """A verified receipt and where it was found (a file, or 'the export itself')."""

    receipt: HeadReceipt
    where: str


def check_against(
    receipt: FoundReceipt, terms: LedgerTerms, entries: Sequence[SignedEntry], *, what: str
) -> None:
    """LedgerForkError unless `entries` (a whole history from seq 1 under `terms`)
    reaches the receipt's head and holds it: shorter is a lowered copy, a different
    entry at the receipt's seq (or other terms) a fork."""
    r = receipt.receipt
    if r.site_id != terms.site_id:
        return  # another site's receipt proves nothing here (callers filter by site)
    if len(entries) < r.entries:
        raise LedgerForkError(
            f"{what} holds {len(entries)} entries, but the signed head receipt {receipt.where} "
            f"records {r.entries} (head {r.head_hash[:16]}..., epsilon spent "
            f"{r.epsilon_spent:.4f}): it is a truncated or older copy, and restoring it "
            "would forget spent budget"
        )
    if r.header_hash != terms.header_hash:
        raise LedgerForkError(
            f"{what} has other terms (header {terms.header_hash[:16]}...) than the signed "
            f"head receipt {receipt.where} (header {r.header_hash[:16]}...): a different "
            "ledger (after `medfed ledger carry`, give it the receipts folder with "
            "--receipts so the receipt follows the new terms)"
        )
    held = entries[r.entries - 1].entry_hash if r.entries else terms.header_hash
    if held != r.head_hash:
        raise LedgerForkError(
            f"{what} differs at seq {r.entries} from the head the signed receipt "
            f"{receipt.where} records: the history was rewritten (a fork)"
        )


def best(found: Sequence[FoundReceipt]) -> FoundReceipt | None:
    """The receipt proving the most entries (None: none found)."""
    return max(found, key=lambda f: f.receipt.entries, default=None)


def read_receipt_file(path: str | Path, site_id: str, *,
                      ca_certificate: x509.Certificate | None = None) -> FoundReceipt | None:
    """The verified receipt at `path` (None: no file). A receipt that is damaged, for
    another site or does not verify is an error naming the file, never skipped: it may
    be the only record that the site's ledger went further."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerIntegrityError(f"head receipt {file} is unreadable ({exc.strerror})") from None
    try:
        receipt = HeadReceipt.from_bytes(data)
    except ConfigError as exc:
        raise LedgerIntegrityError(f"head receipt {file} is damaged ({exc})") from None
    if receipt.site_id != site_id:
        raise LedgerIntegrityError(
            f"head receipt {file} is for site {receipt.site_id!r}, not {site_id!r}")
    problem = receipt.problem(ca_certificate=ca_certificate)
    if problem is not None:
        raise LedgerIntegrityError(f"head receipt {file} does not verify: {problem}")
    return FoundReceipt(receipt, str(file))


def read_receipts(folder: str | Path, site_id: str, *,
                  ca_certificate: x509.Certificate | None = None) -> FoundReceipt | None:
    """The site's receipt in a receipts folder (ConfigError if the folder is missing:
    an unmounted volume must not read as 'no receipt')."""
    where = Path(folder)
    if not where.is_dir():
        raise ConfigError("receipts_dir", f"the receipts folder {where} does not exist "
                          "(is its volume mounted?)")
    return read_receipt_file(receipt_path(where, site_id), site_id,
                             ca_certificate=ca_certificate)


def write_receipt(folder: str | Path, receipt: HeadReceipt) -> Path:
    """Atomic, durable replace of the site's receipt in `folder` (which must exist)."""
    where = Path(folder)
    path = receipt_path(where, receipt.site_id)
    if not where.is_dir():
        raise ConfigError("receipts_dir", f"the receipts folder {where} does not exist "
                          "(is its volume mounted?)")
    try:
        atomic_write(path, receipt.to_bytes(), mode=0o600)
    except OSError as exc:
        raise LedgerUnavailable(path, f"cannot write the head receipt {path} "
                                f"({exc.strerror or exc})") from None
    return path
