"""Each site's own privacy-budget ledger: SQLite, write-ahead, signed, anchored.

The ledger is authoritative for its site (docs/privacy.md, "5. The ledger"): the
coordinator is not trusted with it, it only keeps a replica (`common.privacy.replica`).
Before anything private leaves the site, the mechanisms that produced it are committed
here (write-ahead), so a crash can over-count the spend, never under-count it. A site's ledger
and budget belong to its data for life, across studies.

Format 2 (``medfed-privacy-ledger/2``, see `common.privacy.signed`):

* the header holds the budget, delta, accountant, privacy unit and (hospital unit) what
  the budget is charged with (`charge`, absent = the add/remove composition); its hash is the
  genesis ``prev_hash``; it also keeps ``entry_count`` and ``head_hash``, updated in the
  same transaction as each insert, so a deleted LAST entry is detected too;
* each entry records one or more mechanisms (`common.privacy.mechanisms`), its purpose
  (training, evaluation, statistics, count), its round and the composed epsilon of the
  whole history after it, and is signed with the site's certificate key; the
  certificates are stored in the file, so the history verifies after a key rotation;
* a small anchor file beside the ledger (``<ledger>.anchor``: latest seq and head hash,
  rewritten after each commit) makes a deleted, truncated or older copy of the ledger
  refuse to open instead of restarting at zero.

A format-1 file (unsigned, from before format 2) is refused with a message naming
`medfed ledger migrate` (`common.privacy.migrate`), which signs it into format 2 once.
Every I/O fault surfaces as one `LedgerUnavailable` naming the
file and the way out, never as a traceback.

The storage (schema, I/O faults, rows) is `common.privacy.ledger_store`, the anchor file
`common.privacy.ledger_anchor`, the read-only checks, export and restore
`common.privacy.ledger_verify`; this module holds `PrivacyLedger` (appending, budget
queries, the refusal) and re-exports the public names of the three.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from common.core.errors import (
    BudgetExhausted,
    ConfigError,
    LedgerUnavailable,
    StateError,
)
from common.privacy.accountant import ACCOUNTANTS, EpsilonReport
from common.privacy.budget import BudgetReport
from common.privacy.layered import charged
from common.privacy.ledger_anchor import (
    LedgerAnchor,
    _check_anchor,
    anchor_path_for,
    read_anchor,
    write_anchor,
)
from common.privacy.ledger_store import (
    ANCHOR_FORMAT,
    LedgerEntry,
    LedgerHeader,
    _check_format,
    _check_writable,
    _connect,
    _create_schema,
    _guard,
    _insert_entry,
    _read_entries,
    _read_header,
    _terms,
    _transaction,
    migrate_hint,
    recovery_hint,
)
from common.privacy.ledger_verify import (
    LedgerProblem,
    RestoreResult,
    VerifyReport,
    _check_v2,
    export_ledger,
    ledger_notes,
    read_ledger,
    restore_ledger,
    verify_ledger,
    write_new_ledger,
)
from common.privacy.mechanisms import (
    MECHANISM_TYPES,
    Mechanism,
    mechanisms_to_json,
)
from common.privacy.purpose import PURPOSES, Purpose
from common.privacy.receipts import (
    FoundReceipt,
    HeadReceipt,
    check_against,
    read_receipts,
    sign_receipt,
    write_receipt,
)
from common.privacy.signed import (
    CHARGE_RECORD_LEVEL,
    CHARGE_UNIT,
    CHARGES,
    LEDGER_FORMAT,
    PRIVACY_UNITS,
    LedgerSigner,
    LedgerTerms,
    QueryRef,
    SignedEntry,
    SignedHistory,
    utc_timestamp,
)

__all__ = [
    "ANCHOR_FORMAT",
    "LEDGER_FORMAT",
    "PRIVACY_UNITS",
    "PURPOSES",
    "LedgerAnchor",
    "LedgerEntry",
    "LedgerHeader",
    "LedgerProblem",
    "LedgerSigner",
    "PrivacyLedger",
    "RestoreResult",
    "VerifyReport",
    "anchor_path_for",
    "check_history",
    "export_ledger",
    "ledger_notes",
    "migrate_hint",
    "read_anchor",
    "read_ledger",
    "recovery_hint",
    "restore_ledger",
    "verify_ledger",
    "write_new_ledger",
]

# ----------------------------------------------------------------------- the ledger


def _refuse_missing(
    path: Path, *, anchor_path: Path, anchor: LedgerAnchor | None,
    receipt: FoundReceipt | None,
) -> None:
    """A missing ledger whose receipt or anchor shows history is not started again at
    zero (LedgerUnavailable naming the file and the way out)."""
    if receipt is not None and receipt.receipt.entries > 0:
        raise LedgerUnavailable(
            path,
            f"privacy ledger {path} is missing, but the signed head receipt "
            f"{receipt.where} records {receipt.receipt.entries} entries (epsilon "
            f"{receipt.receipt.epsilon_spent:.4f}): the site refuses to start again at "
            "zero spend; " + recovery_hint(path),
        )
    if anchor is not None and anchor.seq > 0:
        raise LedgerUnavailable(
            path,
            f"privacy ledger {path} is missing, but its anchor "
            f"{anchor_path} records {anchor.seq} entries (head "
            f"{anchor.head_hash[:16]}...): the site refuses to start again at zero "
            "spend; " + recovery_hint(path),
        )


def check_history(
    path: str | Path, *, site_id: str, receipts_dir: str | Path | None = None
) -> None:
    """The refusals of `PrivacyLedger`'s open that need none of its terms, read-only: a
    missing ledger whose anchor or head receipt shows history (LedgerUnavailable), a
    ledger shorter than its anchor or rewritten under it (LedgerForkError). A site
    checks them at start, before it loads its training (seconds of CPU) and enrols;
    the open checks them again, with the rest."""
    ledger_path = Path(path)
    anchor_path = anchor_path_for(ledger_path)
    anchor = read_anchor(anchor_path)
    if not ledger_path.exists():
        receipt = None if receipts_dir is None else read_receipts(Path(receipts_dir), site_id)
        _refuse_missing(ledger_path, anchor_path=anchor_path, anchor=anchor, receipt=receipt)
        return
    if anchor is not None:
        _, entries = read_ledger(ledger_path)
        _check_anchor(ledger_path, anchor, site_id, entries)


class PrivacyLedger:
    """The site's authoritative record of its DP spend; enforces its epsilon budget.

    Opening an existing file resumes its history: the stored site id, budget, delta,
    accountant and privacy unit must equal the ones given (ConfigError names the field).
    The chain and every signature are checked on open (LedgerIntegrityError), and the
    file is compared with its anchor (LedgerForkError if older, shorter or rewritten). A
    missing ledger whose anchor shows history is NOT recreated (LedgerUnavailable).
    Every `reserve` reads the terms again in its own transaction: a ledger carried or
    replaced under this process since it opened is refused there (LedgerUnavailable).

    `signer` (the site's certificate key + certificate) is needed to record anything;
    without it the ledger can only be read.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        site_id: str,
        budget_epsilon: float,
        delta: float,
        accountant: str = "prv",
        privacy_unit: str = "record",
        charge: str = CHARGE_UNIT,
        signer: LedgerSigner | None = None,
        anchor_path: str | Path | None = None,
        receipts_dir: str | Path | None = None,
    ) -> None:
        if not site_id:
            raise ConfigError("site_id", "must not be empty")
        if not (math.isfinite(budget_epsilon) and budget_epsilon > 0):
            raise ConfigError("budget_epsilon", f"must be finite and > 0, got {budget_epsilon}")
        if not (math.isfinite(delta) and 0 < delta < 1):
            raise ConfigError("delta", f"must be in (0, 1), got {delta}")
        if accountant not in ACCOUNTANTS:
            raise ConfigError("accountant", f"must be one of {ACCOUNTANTS}, got {accountant!r}")
        if privacy_unit not in PRIVACY_UNITS:
            raise ConfigError(
                "privacy_unit", f"must be one of {PRIVACY_UNITS}, got {privacy_unit!r}"
            )
        if charge not in CHARGES:
            raise ConfigError("charge", f"must be one of {CHARGES}, got {charge!r}")
        if charge == CHARGE_RECORD_LEVEL and privacy_unit != "hospital":
            raise ConfigError("charge", f"{CHARGE_RECORD_LEVEL!r} is the charge of a "
                              f"hospital-unit ledger, not of a {privacy_unit}-level one")
        if signer is not None and signer.site_id != site_id:
            raise ConfigError(
                "signer", f"certificate names site {signer.site_id!r}, not {site_id!r}"
            )
        self.path = Path(path)
        self.anchor_path = anchor_path_for(self.path) if anchor_path is None else Path(anchor_path)
        self.site_id = site_id
        self.budget_epsilon = float(budget_epsilon)
        self.delta = float(delta)
        self.accountant = accountant
        self.privacy_unit = privacy_unit
        self.charge = charge
        self.signer = signer
        # A folder the site names, ideally on another volume: after every commit a signed
        # head receipt goes there, and on open a ledger shorter than it is refused.
        self.receipts_dir = None if receipts_dir is None else Path(receipts_dir)
        self.terms = LedgerTerms(
            site_id=site_id,
            budget_epsilon=self.budget_epsilon,
            delta=self.delta,
            accountant=accountant,
            privacy_unit=privacy_unit,
            charge=charge,
        )
        self._open_or_create()

    # -- setup -------------------------------------------------------------------------

    def _open_or_create(self) -> None:
        anchor = read_anchor(self.anchor_path)
        receipt = (None if self.receipts_dir is None
                   else read_receipts(self.receipts_dir, self.site_id))
        if not self.path.exists():
            _refuse_missing(self.path, anchor_path=self.anchor_path, anchor=anchor,
                            receipt=receipt)
            _check_writable(self.path)
            with (
                _guard(self.path, "creating the ledger"),
                _connect(self.path, mode="rwc") as conn,
            ):
                conn.execute("PRAGMA journal_mode=WAL")
                with _transaction(conn):
                    _create_schema(conn, self.terms)
        else:
            _check_writable(self.path)
            with _guard(self.path, "opening the ledger"), self._open() as conn:
                conn.execute("PRAGMA journal_mode=WAL")
                _check_format(conn, self.path)
        with _guard(self.path, "opening the ledger"), self._open() as conn:
            _check_v2(conn, path=self.path, recompose=False).raise_if_broken()
            header = _read_header(conn)
            entries = _read_entries(conn)
        stored = _terms(header)
        for name in ("site_id", "budget_epsilon", "delta", "accountant", "privacy_unit",
                     "charge"):
            if getattr(stored, name) != getattr(self.terms, name):
                raise ConfigError(
                    name,
                    f"ledger {self.path} was created with {name}="
                    f"{getattr(stored, name)!r}, not {getattr(self.terms, name)!r}; a site "
                    "resumes its ledger, it cannot change it"
                    + ("" if name in ("site_id", "privacy_unit") else
                       f". To change it with the spend carried over, stop the site and run "
                       f"`medfed ledger carry --ledger {self.path} --{name.replace('_', '-')} "
                       f"{getattr(self.terms, name)} --cert SITE.crt --key SITE.key`"),
                )
        if anchor is not None:
            _check_anchor(self.path, anchor, self.site_id, entries)
        if receipt is not None:
            check_against(receipt, stored, entries, what=f"privacy ledger {self.path}")
        self._write_anchor(entries)

    def _open(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return _connect(self.path, mode="rw")

    def _write_anchor(self, entries: Sequence[SignedEntry]) -> None:
        head = entries[-1].entry_hash if entries else self.terms.header_hash
        write_anchor(self.anchor_path, LedgerAnchor(self.site_id, len(entries), head))
        if self.receipts_dir is not None and self.signer is not None:
            write_receipt(self.receipts_dir, sign_receipt(self.signer, self.terms, entries))

    def receipt(self) -> HeadReceipt:
        """A signed head receipt of the ledger as it is now (for a backup)."""
        if self.signer is None:
            raise ConfigError("signer", "a head receipt needs the site's signing key")
        return sign_receipt(self.signer, self.terms, self.entries())

    def _store_certificate(self, conn: sqlite3.Connection) -> None:
        if self.signer is None:
            raise ConfigError("signer", "recording needs the site's signing key")
        conn.execute(
            "INSERT INTO ledger_certificates (sha256, der) VALUES (?, ?) "
            "ON CONFLICT (sha256) DO NOTHING",
            (self.signer.cert_sha256, self.signer.certificate_der),
        )

    # -- reading ---------------------------------------------------------------------------

    def entries(self) -> list[SignedEntry]:
        with _guard(self.path, "reading the ledger"), self._open() as conn:
            return _read_entries(conn)

    def history(self) -> list[Mechanism]:
        """Every mechanism this site has committed, in order."""
        return [mechanism for entry in self.entries() for mechanism in entry.mechanisms]

    def spent(self) -> float:
        """Epsilon of the whole committed history (as composed when last committed)."""
        entries = self.entries()
        return entries[-1].epsilon_after if entries else 0.0

    def remaining(self) -> float:
        return max(0.0, self.budget_epsilon - self.spent())

    def head_hash(self) -> str:
        with _guard(self.path, "reading the ledger"), self._open() as conn:
            return _read_header(conn).head_hash

    def export(self, *, after_seq: int = 0) -> SignedHistory:
        """Signed entries after `after_seq` + their certificates (for the replica)."""
        return export_ledger(self.path, after_seq=after_seq)

    def preview(
        self, round_number: int, mechanisms: Sequence[Mechanism], *,
        purpose: str = Purpose.TRAINING, also: Sequence[tuple[str, Sequence[Mechanism]]] = (),
    ) -> float:
        """Epsilon charged after the whole history if `mechanisms` (of `purpose`) and
        `also` ((purpose, mechanisms) pairs, e.g. the round's evaluation) were added."""
        del round_number  # the round does not change the maths; kept for call symmetry
        pairs = [*self._pairs(self.entries()), (purpose, tuple(mechanisms)), *also]
        return self._charge(pairs).epsilon

    def require(
        self, round_number: int, mechanisms: Sequence[Mechanism], *,
        purpose: str = Purpose.TRAINING, also: Sequence[tuple[str, Sequence[Mechanism]]] = (),
        what: str | None = None,
    ) -> float:
        """The budget refusal: BudgetExhausted unless `mechanisms` (of `purpose`) and
        `also` fit the budget together after the whole history (`preview`); else the
        epsilon they would bring. `what` names the release in the refusal (default
        "round N"). Checks only: `reserve` writes, and checks again."""
        after = self.preview(round_number, mechanisms, purpose=purpose, also=also)
        if after > self.budget_epsilon:
            raise self._refusal(what or f"round {round_number}", after, spent=self.spent())
        return after

    def _refusal(self, what: str, epsilon: float, *, spent: float) -> BudgetExhausted:
        return BudgetExhausted(
            f"site {self.site_id}: {what} would bring epsilon to {epsilon:.4f} > budget "
            f"{self.budget_epsilon:g} (spent {spent:.4f}, delta {self.delta:g}"
            + ("; the per-patient epsilon, hospital rounds at 2S" if self.charge ==
               CHARGE_RECORD_LEVEL else "") + ")"
        )

    def status(self, next_mechanisms: Sequence[Mechanism] | None = None) -> BudgetReport:
        """What the site tells the coordinator: figures only, never data."""
        entries = self.entries()
        spent = entries[-1].epsilon_after if entries else 0.0
        if next_mechanisms is None:
            exhausted = spent >= self.budget_epsilon
        else:  # would releasing `next_mechanisms` take the site past its budget?
            exhausted = self.preview(-1, next_mechanisms) > self.budget_epsilon
        return BudgetReport(
            site_id=self.site_id,
            budget_epsilon=self.budget_epsilon,
            delta=self.delta,
            spent_epsilon=spent,
            last_round=entries[-1].round if entries else None,
            exhausted=exhausted,
            privacy_unit=self.privacy_unit,
            ledger_entries=len(entries),
            ledger_head=entries[-1].entry_hash if entries else self.terms.header_hash,
        )

    # -- writing ---------------------------------------------------------------------------

    def reserve(
        self,
        round_number: int,
        mechanisms: Sequence[Mechanism],
        *,
        now: datetime,
        purpose: str = Purpose.TRAINING,
        query: QueryRef | None = None,
    ) -> SignedEntry:
        """Commit this release's spend BEFORE it leaves the site (write-ahead).
        A "query" entry names its query (`query`), no other entry does.

        One transaction: checks the budget, appends the signed, chained entry, moves the
        header's count and head hash; then the anchor is rewritten. Raises
        BudgetExhausted (nothing written) if the composed epsilon would exceed the
        budget. Reserving the same (round, purpose) twice returns the existing entry if
        the mechanisms are identical, else raises StateError.
        """
        if isinstance(round_number, bool) or not isinstance(round_number, int):
            raise ConfigError("round", f"must be an integer, got {round_number!r}")
        if not 0 <= round_number < 1 << 63:
            raise ConfigError("round", f"must be in [0, 2^63), got {round_number}")
        if purpose not in PURPOSES:
            raise ConfigError("purpose", f"must be one of {PURPOSES}, got {purpose!r}")
        purpose = Purpose(purpose).value  # stored as its plain value
        if (query is not None) != (purpose == Purpose.QUERY):
            raise ConfigError("query", "a query entry, and only one, names its query")
        mechanisms = tuple(mechanisms)
        if not mechanisms or not all(isinstance(m, MECHANISM_TYPES) for m in mechanisms):
            raise ConfigError("mechanisms", "a reservation needs at least one mechanism")
        created_at = utc_timestamp(now)
        if self.signer is None:
            raise ConfigError("signer", "recording a spend needs the site's signing key")
        _check_writable(self.path)
        with _guard(self.path, "recording a spend"), self._open() as conn, _transaction(conn):
            entry, entries = self._reserve_locked(
                conn, round_number, purpose, mechanisms, created_at, query=query
            )
        self._write_anchor(entries)
        return entry

    def _reserve_locked(
        self,
        conn: sqlite3.Connection,
        round_number: int,
        purpose: str,
        mechanisms: tuple[Mechanism, ...],
        created_at: str,
        *,
        query: QueryRef | None = None,
    ) -> tuple[SignedEntry, list[SignedEntry]]:
        signer = self.signer
        if signer is None:
            raise ConfigError("signer", "recording a spend needs the site's signing key")
        header = _read_header(conn)
        self._refuse_other_terms(header)
        entries = _read_entries(conn)
        for existing in entries:
            if existing.round == round_number and existing.purpose == purpose:
                if (mechanisms_to_json(existing.mechanisms) == mechanisms_to_json(mechanisms)
                        and existing.query == query):
                    return existing, entries
                raise StateError(
                    f"round {round_number} ({purpose}) is already reserved with different "
                    f"mechanisms ({mechanisms_to_json(existing.mechanisms)} != "
                    f"{mechanisms_to_json(mechanisms)})"
                )
        report = self._charge([*self._pairs(entries), (purpose, mechanisms)])
        if report.epsilon > self.budget_epsilon:
            spent = entries[-1].epsilon_after if entries else 0.0
            raise self._refusal(f"{purpose} for round {round_number}", report.epsilon,
                                spent=spent)
        entry = signer.sign(
            SignedEntry(
                site_id=self.site_id,
                seq=len(entries) + 1,
                round=round_number,
                purpose=purpose,
                mechanisms=mechanisms,
                epsilon_after=report.epsilon,
                accountant_used=report.accountant,
                created_at=created_at,
                prev_hash=header.head_hash,
                cert_sha256=signer.cert_sha256,
                query=query,
            )
        )
        self._store_certificate(conn)
        _insert_entry(conn, entry)
        return entry, [*entries, entry]

    def _refuse_other_terms(self, header: LedgerHeader) -> None:
        """The file's terms, read in the write transaction, must still be the ones this
        process opened it with: a ledger carried (or replaced) by another process since
        would otherwise be charged, and checked, against this process's stale budget."""
        stored = _terms(header)
        if stored == self.terms:
            return
        changed = ", ".join(
            f"{name} {getattr(stored, name)!r} (opened with {getattr(self.terms, name)!r})"
            for name in ("site_id", "budget_epsilon", "delta", "accountant", "privacy_unit",
                         "charge") if getattr(stored, name) != getattr(self.terms, name))
        raise LedgerUnavailable(
            self.path,
            f"privacy ledger {self.path} now holds other terms than this process opened it "
            f"with: {changed or 'another header'}. It was carried (`medfed ledger carry`) "
            "or replaced while the site ran; nothing was recorded and nothing leaves the "
            "site. Stop the site, set the site config to the ledger's terms, and start it "
            "again",
        )

    @staticmethod
    def _pairs(entries: Sequence[SignedEntry]) -> list[tuple[str, Sequence[Mechanism]]]:
        return [(entry.purpose, entry.mechanisms) for entry in entries]

    def _charge(self, pairs: Sequence[tuple[str, Sequence[Mechanism]]]) -> EpsilonReport:
        """What the budget is charged with under this ledger's terms
        (`common.privacy.layered.charged`): the whole history composed, or for a
        hospital-unit ledger with `charge = "record_level"` the per-patient figure."""
        return charged(pairs, delta=self.delta, accountant=self.accountant,
                       charge=self.charge)
