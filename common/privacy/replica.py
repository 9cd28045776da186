"""The coordinator's replica of every site's signed ledger entries.

Entries hold mechanism parameters, purposes, rounds and epsilons: no data. Keeping them
lets the coordinator (1) refuse a site whose reported ledger head does not extend what it
has already seen: a fork (history rewritten), a shrink (an older copy) or a reset (a
fresh ledger), and (2) hand a site that lost its ledger a verified copy to restore
(`medfed ledger export --site ID` here, `medfed ledger restore` at the site). Because the
entries are signed with the site's certificate key, the coordinator cannot forge a
site's history: a restore verifies every signature. It CAN hand over a truncated one
(every remaining entry still verifies); what refuses that is the site's own signed head
receipt (`common.privacy.receipts`), which `medfed ledger restore` checks.

Lives in the coordinator's state database (`common.core.sqldb`: SQLite or PostgreSQL), SQL
written once (TEXT / BIGINT, base64 for certificates so no BLOB/BYTEA difference).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from cryptography import x509

from common.core.errors import ConfigError, LedgerForkError, LedgerIntegrityError, ValidationError
from common.core.parsing import parse_json
from common.core.sqldb import Database, Statements
from common.privacy.carry import check_carry
from common.privacy.mechanisms import canonical_json
from common.privacy.signed import (
    LedgerTerms,
    SignedEntry,
    SignedHistory,
    check_entries,
    utc_timestamp,
)

_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS privacy_replica_sites ("
    " site_id TEXT PRIMARY KEY, header_json TEXT NOT NULL, entry_count BIGINT NOT NULL,"
    " head_hash TEXT NOT NULL, updated_at TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS privacy_replica_entries ("
    " site_id TEXT NOT NULL, seq BIGINT NOT NULL, entry_json TEXT NOT NULL,"
    " entry_hash TEXT NOT NULL, PRIMARY KEY (site_id, seq))",
    "CREATE TABLE IF NOT EXISTS privacy_replica_certificates ("
    " sha256 TEXT PRIMARY KEY, der_base64 TEXT NOT NULL)",
    # A carry replaced a site's terms and entries (`common.privacy.carry`): what the
    # replica held before, kept for audit (the old signed entries verify under it).
    "CREATE TABLE IF NOT EXISTS privacy_replica_carried ("
    " site_id TEXT NOT NULL, old_head_hash TEXT NOT NULL, old_header_json TEXT NOT NULL,"
    " old_entry_count BIGINT NOT NULL, old_spent TEXT NOT NULL, new_header_json TEXT NOT NULL,"
    " new_head_hash TEXT NOT NULL, new_spent TEXT NOT NULL, carried_at TEXT NOT NULL,"
    " PRIMARY KEY (site_id, old_head_hash))",
    "CREATE TABLE IF NOT EXISTS privacy_replica_carried_entries ("
    " site_id TEXT NOT NULL, old_head_hash TEXT NOT NULL, seq BIGINT NOT NULL,"
    " entry_json TEXT NOT NULL, PRIMARY KEY (site_id, old_head_hash, seq))",
)


@dataclass(frozen=True)
class ReplicaCarry:
    """A carry the replica accepted: what it held before and what it holds now."""

    old_head_hash: str
    old_entries: int
    old_spent: float
    new_head_hash: str
    new_spent: float


@dataclass(frozen=True)
class ReplicaHead:
    """How far the replica of one site's ledger goes (`carried`: set by the `extend`
    that accepted a carry)."""

    site_id: str
    entries: int
    head_hash: str
    carried: ReplicaCarry | None = None


class LedgerReplica:
    """Per-site signed ledger entries; `extend` only ever appends a verified suffix.

    `ca_certificate`: when given, every signing certificate must have been issued by it
    (the federation CA), so no one can extend a site's replica with a key of their own.
    """

    def __init__(
        self, database: Database, *, ca_certificate: x509.Certificate | None = None
    ) -> None:
        self.database = database
        self.ca_certificate = ca_certificate
        with database.transaction() as cur:
            for statement in _SCHEMA:
                cur.execute(statement)

    @classmethod
    def open(
        cls, database_url: str, *, ca_certificate: x509.Certificate | None = None
    ) -> LedgerReplica:
        return cls(Database(database_url), ca_certificate=ca_certificate)

    @classmethod
    def sqlite(
        cls, path: str | Path, *, ca_certificate: x509.Certificate | None = None
    ) -> LedgerReplica:
        return cls(Database(f"sqlite:///{path}"), ca_certificate=ca_certificate)

    def close(self) -> None:
        self.database.close()

    # -- reading ---------------------------------------------------------------------------

    def head(self, site_id: str) -> ReplicaHead | None:
        """What the replica holds for `site_id` (None: nothing yet)."""
        with self.database.transaction(write=False) as cur:
            row = _site_row(cur, site_id)
        return None if row is None else ReplicaHead(site_id, int(row[1]), str(row[2]))

    def sites(self) -> list[str]:
        with self.database.transaction(write=False) as cur:
            rows = cur.execute(
                "SELECT site_id FROM privacy_replica_sites ORDER BY site_id"
            ).fetchall()
        return [str(row[0]) for row in rows]

    def history(self, site_id: str) -> SignedHistory:
        """The replica of `site_id` as a signed history (ValidationError if unknown)."""
        with self.database.transaction(write=False) as cur:
            row = _site_row(cur, site_id)
            if row is None:
                raise ValidationError(f"the coordinator holds no ledger replica for {site_id!r}")
            terms = LedgerTerms.from_json_dict(_stored(row[0]))
            entries = tuple(
                SignedEntry.from_json_dict(_stored(r[0]))
                for r in cur.execute(
                    "SELECT entry_json FROM privacy_replica_entries WHERE site_id = ? "
                    "ORDER BY seq",
                    (site_id,),
                ).fetchall()
            )
            certificates = _certificates(cur, {e.cert_sha256 for e in entries})
        return SignedHistory(terms, entries, certificates)

    def export(self, site_id: str) -> bytes:
        """Canonical JSON of the site's signed entries and certificates: the file
        `medfed ledger restore --from` reads."""
        return self.history(site_id).to_bytes()

    def check_head(self, site_id: str, *, entries: int, head_hash: str) -> bool:
        """Compare a head a site REPORTS (BudgetStatus.ledger_entries/ledger_head) with
        the replica: True if the replica already holds it, False if the site is ahead
        (extend the replica with its new entries before selecting it). LedgerForkError
        for a head behind the replica (shrink, reset) or different at the same seq (fork).
        """
        current = self.head(site_id)
        if current is None:
            return entries == 0
        if entries < current.entries:
            raise LedgerForkError(_shrink_message(site_id, entries, current.entries))
        if entries == current.entries:
            if head_hash != current.head_hash:
                raise LedgerForkError(
                    f"site {site_id} reports head {head_hash[:16]}... at seq {entries}, but "
                    f"the replica holds {current.head_hash[:16]}... there: its ledger forked "
                    "(a ledger carried into new terms, `medfed ledger carry`, is accepted "
                    "once the site sends its whole history)"
                )
            return True
        return False

    # -- writing ---------------------------------------------------------------------------

    def extend(
        self, site_id: str, history: SignedHistory | bytes, *, now: datetime
    ) -> ReplicaHead:
        """Append the entries of `history` that the replica lacks, after checking them.

        `history` (or its `to_bytes()`) holds the site's ledger terms and a contiguous
        run of signed entries ENDING AT THE SITE'S HEAD, starting at or before the
        replica's next seq (entries the replica already holds must be identical). Raises,
        writing nothing:

        * LedgerForkError: the head is behind the replica (shrink), the terms changed and
          the history is not a carry of the replica's (`common.privacy.carry.check_carry`:
          a reset), the ledger is empty while the replica is not (reset), an entry
          differs from the replica's at the same seq (fork);
        * LedgerIntegrityError: a new entry's chain, site or signature does not verify
          (or its certificate is not from the CA);
        * ValidationError: the run starts after the replica's next seq (a gap: send the
          entries from `head(site_id).entries + 1`), or names another site, or the
          bytes are not a signed history at all.
        """
        if isinstance(history, bytes | bytearray):
            try:
                history = SignedHistory.from_bytes(bytes(history))
            except LedgerIntegrityError as exc:
                # Bytes that do not parse as a signed history (not JSON, nested too
                # deep, a field missing) are a malformed message: INVALID_ARGUMENT.
                raise ValidationError(f"ledger history from {site_id}: {exc}") from None
        if history.terms.site_id != site_id:
            raise ValidationError(
                f"ledger history is for site {history.terms.site_id!r}, not {site_id!r}"
            )
        updated_at = utc_timestamp(now)
        with self.database.transaction() as cur:
            row = _site_row(cur, site_id)
            if row is None:
                stored_terms, count, head = history.terms, 0, history.terms.header_hash
            else:
                stored_terms = LedgerTerms.from_json_dict(_stored(row[0]))
                count, head = int(row[1]), str(row[2])
                if history.terms != stored_terms:
                    return self._carry(cur, site_id, history, stored_terms, head,
                                       updated_at=updated_at)
            new = self._new_entries(cur, site_id, history, stored_terms, count, head)
            if row is not None and not new:
                return ReplicaHead(site_id, count, head)
            certificates = {**_certificates(cur, {e.cert_sha256 for e in new}),
                            **dict(history.certificates)}
            problems = check_entries(
                stored_terms,
                new,
                certificates,
                start_seq=count,
                start_hash=head,
                ca_certificate=self.ca_certificate,
            )
            if problems:
                raise LedgerIntegrityError(
                    f"site {site_id}: ledger entries do not verify: {problems[0]}"
                )
            _insert_entries(cur, site_id, new, certificates)
            new_count = count + len(new)
            new_head = new[-1].entry_hash if new else head
            cur.execute(
                "INSERT INTO privacy_replica_sites (site_id, header_json, entry_count, "
                "head_hash, updated_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT (site_id) DO "
                "UPDATE SET entry_count = excluded.entry_count, head_hash = "
                "excluded.head_hash, updated_at = excluded.updated_at",
                (
                    site_id,
                    canonical_json(stored_terms.to_json_dict()).decode("ascii"),
                    new_count,
                    new_head,
                    updated_at,
                ),
            )
        return ReplicaHead(site_id, new_count, new_head)

    def _carry(
        self,
        cur: Statements,
        site_id: str,
        history: SignedHistory,
        stored_terms: LedgerTerms,
        head: str,
        *,
        updated_at: str,
    ) -> ReplicaHead:
        """Replace the replica's history by `history` if it verifies as a carry of it
        (see `extend`); archive the old one first. Inside `extend`'s transaction."""
        rows = cur.execute(
            "SELECT entry_json FROM privacy_replica_entries WHERE site_id = ? ORDER BY seq",
            (site_id,),
        ).fetchall()
        old_entries = [SignedEntry.from_json_dict(_stored(r[0])) for r in rows]
        try:
            check_carry(stored_terms, old_entries, history)
        except LedgerForkError as exc:
            raise LedgerForkError(
                f"{exc} (the replica holds terms {_terms_text(stored_terms)}; the site "
                f"reports {_terms_text(history.terms)})"
            ) from None
        entries = list(history.entries)
        certificates = {**_certificates(cur, {e.cert_sha256 for e in entries}),
                        **dict(history.certificates)}
        problems = check_entries(history.terms, entries, certificates,
                                 ca_certificate=self.ca_certificate)
        if problems:
            raise LedgerIntegrityError(
                f"site {site_id}: the carried ledger does not verify: {problems[0]}"
            )
        new_head = history.head_hash
        carried = ReplicaCarry(
            old_head_hash=head,
            old_entries=len(old_entries),
            old_spent=old_entries[-1].epsilon_after if old_entries else 0.0,
            new_head_hash=new_head,
            new_spent=entries[-1].epsilon_after if entries else 0.0,
        )
        cur.execute(
            "INSERT INTO privacy_replica_carried (site_id, old_head_hash, old_header_json, "
            "old_entry_count, old_spent, new_header_json, new_head_hash, new_spent, "
            "carried_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (site_id, head, canonical_json(stored_terms.to_json_dict()).decode("ascii"),
             len(old_entries), repr(carried.old_spent),
             canonical_json(history.terms.to_json_dict()).decode("ascii"), new_head,
             repr(carried.new_spent), updated_at),
        )
        for old, raw in zip(old_entries, rows, strict=True):
            cur.execute(
                "INSERT INTO privacy_replica_carried_entries (site_id, old_head_hash, seq, "
                "entry_json) VALUES (?, ?, ?, ?)",
                (site_id, head, old.seq, str(raw[0])),
            )
        cur.execute("DELETE FROM privacy_replica_entries WHERE site_id = ?", (site_id,))
        _insert_entries(cur, site_id, entries, certificates)
        cur.execute(
            "UPDATE privacy_replica_sites SET header_json = ?, entry_count = ?, "
            "head_hash = ?, updated_at = ? WHERE site_id = ?",
            (canonical_json(history.terms.to_json_dict()).decode("ascii"), len(entries),
             new_head, updated_at, site_id),
        )
        return ReplicaHead(site_id, len(entries), new_head, carried)

    @staticmethod
    def _new_entries(
        cur: Statements,
        site_id: str,
        history: SignedHistory,
        stored_terms: LedgerTerms,
        count: int,
        head: str,
    ) -> list[SignedEntry]:
        # Other terms than the stored ones never get here: `extend` checks them as a carry.
        del stored_terms
        entries = list(history.entries)
        if not entries:
            if count > 0:
                raise LedgerForkError(
                    f"site {site_id} reports an empty ledger but the replica holds {count} "
                    "entries: its ledger was reset"
                )
            return []
        last = entries[-1].seq
        if last < count:
            raise LedgerForkError(_shrink_message(site_id, last, count))
        first = entries[0].seq
        if first > count + 1:
            raise ValidationError(
                f"site {site_id}: the replica ends at seq {count}; send the ledger entries "
                f"from seq {count + 1} (got a run starting at {first})"
            )
        overlap = [e for e in entries if e.seq <= count]
        if overlap:
            stored = dict(
                (int(r[0]), str(r[1]))
                for r in cur.execute(
                    "SELECT seq, entry_hash FROM privacy_replica_entries WHERE site_id = ? "
                    "AND seq >= ? AND seq <= ?",
                    (site_id, overlap[0].seq, overlap[-1].seq),
                ).fetchall()
            )
            for entry in overlap:
                if stored.get(entry.seq) != entry.entry_hash:
                    raise LedgerForkError(
                        f"site {site_id}: ledger entry seq={entry.seq} differs from the "
                        "replica's: its history was rewritten (a fork)"
                    )
        del head
        return [e for e in entries if e.seq > count]


def _terms_text(terms: LedgerTerms) -> str:
    return (f"budget={terms.budget_epsilon:g}, delta={terms.delta:g}, accountant="
            f"{terms.accountant}, unit={terms.privacy_unit}, charge={terms.charge}")


def _shrink_message(site_id: str, reported: int, held: int) -> str:
    return (
        f"site {site_id} reports {reported} ledger entries but the replica holds {held}: "
        "its ledger is an older, truncated or reset copy; the site must restore it "
        "(`medfed ledger export --site ...` here, `medfed ledger restore` there)"
    )


def _stored(text: object) -> Any:
    """A JSON column of the replica's tables (written canonical by `extend`): damage
    is a LedgerIntegrityError, never a RecursionError."""
    try:
        return parse_json(str(text))
    except ValidationError as exc:
        raise LedgerIntegrityError(f"the ledger replica's stored JSON is damaged ({exc})") from None


def _site_row(cur: Statements, site_id: str) -> tuple[Any, ...] | None:
    return cur.execute(
        "SELECT header_json, entry_count, head_hash FROM privacy_replica_sites "
        "WHERE site_id = ?",
        (site_id,),
    ).fetchone()


def _insert_entries(
    cur: Statements,
    site_id: str,
    entries: Sequence[SignedEntry],
    certificates: Mapping[str, bytes],
) -> None:
    """Store verified `entries` of `site_id` and each certificate they were signed
    with (a certificate already stored is kept)."""
    for entry in entries:
        cur.execute(
            "INSERT INTO privacy_replica_entries (site_id, seq, entry_json, "
            "entry_hash) VALUES (?, ?, ?, ?)",
            (site_id, entry.seq, canonical_json(entry.to_json_dict()).decode("ascii"),
             entry.entry_hash),
        )
    for digest in sorted({e.cert_sha256 for e in entries}):
        cur.execute(
            "INSERT INTO privacy_replica_certificates (sha256, der_base64) "
            "VALUES (?, ?) ON CONFLICT (sha256) DO NOTHING",
            (digest, base64.b64encode(certificates[digest]).decode("ascii")),
        )


def _certificates(cur: Statements, digests: set[str]) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for digest in sorted(digests):
        row = cur.execute(
            "SELECT der_base64 FROM privacy_replica_certificates WHERE sha256 = ?", (digest,)
        ).fetchone()
        if row is not None:
            found[digest] = base64.b64decode(str(row[0]))
    return found


def export_from_state(
    site_id: str, *, state: str | Path | None = None, database_url: str | None = None
) -> bytes:
    """`medfed ledger export`: the replica of `site_id` from the coordinator's state
    database (`state`/coordinator.db, or `database_url`)."""
    if (state is None) == (database_url is None):
        raise ConfigError("state", "give exactly one of --state DIR and --database-url URL")
    if database_url is None:
        database_file = Path(str(state)) / "coordinator.db"
        if not database_file.is_file():
            raise ConfigError("state", f"no coordinator state database at {database_file}")
        database_url = f"sqlite:///{database_file}"
    replica = LedgerReplica.open(database_url)
    try:
        return replica.export(site_id)
    finally:
        replica.close()
