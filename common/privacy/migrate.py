"""`medfed ledger migrate`: sign a format-1 privacy ledger into format 2, once.

Format 1 (``medfed-privacy-ledger/1``) recorded DP-SGD segments only, chained by UNKEYED
hashes (anyone able to rewrite the file could recompute them). Format 2
(`common.privacy.ledger`) signs every entry with the site's certificate key; the ledger
refuses to open a format-1 file and names this command.

The migration checks the whole format-1 chain and recomposes every epsilon first; then
it keeps the original file beside the ledger as ``LEDGER.format1`` (for audit), re-records
each entry as a signed sampled-Gaussian entry for purpose "training" (same seq, round,
segments, epsilon_after, accountant and time), replaces the ledger in one rename, and
writes the anchor. This module is the only place that knows the format-1 schema.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from common.core.errors import (
    ConfigError,
    LedgerForkError,
    LedgerUnavailable,
    StateError,
    ValidationError,
)
from common.core.parsing import parse_json
from common.privacy.accountant import Segment
from common.privacy.ledger import (
    LedgerAnchor,
    LedgerHeader,
    LedgerProblem,
    LedgerSigner,
    VerifyReport,
    anchor_path_for,
    read_anchor,
    write_new_ledger,
)
from common.privacy.ledger_anchor import write_anchor
from common.privacy.ledger_store import EPSILON_RELATIVE_TOLERANCE, read_header_row
from common.privacy.ledger_verify import header_problems
from common.privacy.purpose import Purpose
from common.privacy.recompose import RecordedSpend, recompose_mismatches
from common.privacy.signed import LEDGER_FORMAT as FORMAT2
from common.privacy.signed import LedgerTerms, SignedEntry, SignedHistory

LEDGER_FORMAT: Final = "medfed-privacy-ledger/1"
BACKUP_SUFFIX: Final = ".format1"
STATUS_COMMITTED: Final = "committed"

FORMAT1_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS ledger_header (
    id              INTEGER PRIMARY KEY CHECK (id = 1),
    format          TEXT    NOT NULL,
    site_id         TEXT    NOT NULL,
    budget_epsilon  REAL    NOT NULL,
    delta           REAL    NOT NULL,
    accountant      TEXT    NOT NULL,
    privacy_unit    TEXT    NOT NULL,
    header_hash     TEXT    NOT NULL,
    entry_count     INTEGER NOT NULL,
    head_hash       TEXT    NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger_entries (
    seq             INTEGER PRIMARY KEY,
    round           INTEGER NOT NULL UNIQUE,
    segments        TEXT    NOT NULL,
    epsilon_after   REAL    NOT NULL,
    accountant_used TEXT    NOT NULL,
    created_at      TEXT    NOT NULL,
    status          TEXT    NOT NULL,
    prev_hash       TEXT    NOT NULL,
    entry_hash      TEXT    NOT NULL
);
"""

_ENTRY_COLUMNS = (
    "seq, round, segments, epsilon_after, accountant_used, created_at, status, "
    "prev_hash, entry_hash"
)


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical_json(value: Any) -> bytes:
    # Sorted keys, no whitespace, floats as Python's shortest round-trip repr: the same
    # values always give the same bytes, and REAL columns store these doubles exactly.
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def segments_to_json(segments: Sequence[Segment]) -> str:
    """Canonical text of a round's segments (order kept: it is what the site ran)."""
    return _canonical_json([list(s.as_tuple()) for s in segments]).decode("ascii")


def segments_from_json(text: str) -> tuple[Segment, ...]:
    try:
        raw = parse_json(text)
    except ValidationError as exc:
        raise StateError(f"ledger segments: {exc}") from None
    if not isinstance(raw, list):
        raise StateError("ledger segments are not a JSON list")
    segments = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3):
            raise StateError("ledger segment is not [sigma, q, steps]")
        sigma, rate, steps = item
        try:
            segments.append(Segment(sigma, rate, steps))
        except ConfigError as exc:
            raise StateError(f"invalid segment in ledger: {exc}") from exc
    return tuple(segments)


def header_hash(
    *,
    site_id: str,
    budget_epsilon: float,
    delta: float,
    accountant: str,
    privacy_unit: str,
) -> str:
    """SHA-256 of the header's fixed fields; the chain's genesis `prev_hash`."""
    return _sha256_hex(
        _canonical_json(
            {
                "format": LEDGER_FORMAT,
                "site_id": site_id,
                "budget_epsilon": float(budget_epsilon),
                "delta": float(delta),
                "accountant": accountant,
                "privacy_unit": privacy_unit,
            }
        )
    )


def entry_hash(
    *,
    seq: int,
    round_number: int,
    segments_json: str,
    epsilon_after: float,
    accountant_used: str,
    created_at: str,
    status: str,
    prev_hash: str,
) -> str:
    """SHA-256 over every field of an entry and the previous entry's hash."""
    return _sha256_hex(
        _canonical_json(
            {
                "seq": seq,
                "round": round_number,
                "segments": segments_json,
                "epsilon_after": float(epsilon_after),
                "accountant_used": accountant_used,
                "created_at": created_at,
                "status": status,
                "prev_hash": prev_hash,
            }
        )
    )


@dataclass(frozen=True)
class Format1Entry:
    """One committed round: its segments and the epsilon of the whole history after it."""

    seq: int
    round: int
    segments: tuple[Segment, ...]
    epsilon_after: float
    accountant_used: str
    created_at: str
    status: str
    prev_hash: str
    entry_hash: str

    @property
    def segments_json(self) -> str:
        return segments_to_json(self.segments)


def _read_header(connection: sqlite3.Connection) -> LedgerHeader | None:
    try:
        return read_header_row(connection)
    except sqlite3.DatabaseError as exc:
        raise StateError(f"not a medfed privacy ledger: {exc}") from exc


def _row_to_entry(row: Sequence[Any]) -> Format1Entry:
    return Format1Entry(
        seq=int(row[0]),
        round=int(row[1]),
        segments=segments_from_json(str(row[2])),
        epsilon_after=float(row[3]),
        accountant_used=str(row[4]),
        created_at=str(row[5]),
        status=str(row[6]),
        prev_hash=str(row[7]),
        entry_hash=str(row[8]),
    )


def _read_entries(connection: sqlite3.Connection) -> list[Format1Entry]:
    rows = connection.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM ledger_entries ORDER BY seq"  # noqa: S608 (constant)
    ).fetchall()
    return [_row_to_entry(row) for row in rows]


def _computed_entry_hash(entry: Format1Entry, segments_json: str) -> str:
    return entry_hash(
        seq=entry.seq,
        round_number=entry.round,
        segments_json=segments_json,
        epsilon_after=entry.epsilon_after,
        accountant_used=entry.accountant_used,
        created_at=entry.created_at,
        status=entry.status,
        prev_hash=entry.prev_hash,
    )


def _check_chain(connection: sqlite3.Connection, *, path: Path, recompose: bool) -> VerifyReport:
    """Walk header + entries; collect every problem (the first one is what users see)."""
    header = _read_header(connection)
    if header is None:
        return VerifyReport(str(path), 0, "", (LedgerProblem(None, "header row missing"),))
    problems: list[LedgerProblem] = []
    if header.format != LEDGER_FORMAT:
        problems.append(LedgerProblem(None, f"unknown ledger format {header.format!r}"))
    expected_header_hash = header_hash(
        site_id=header.site_id,
        budget_epsilon=header.budget_epsilon,
        delta=header.delta,
        accountant=header.accountant,
        privacy_unit=header.privacy_unit,
    )
    if expected_header_hash != header.header_hash:
        problems.append(LedgerProblem(None, "header fields do not match header_hash"))
    # Raw rows first: an edited segments column may not even parse.
    raw_rows = connection.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM ledger_entries ORDER BY seq"  # noqa: S608 (constant)
    ).fetchall()
    prev_hash = expected_header_hash
    checked: list[Format1Entry] = []
    for position, row in enumerate(raw_rows, start=1):
        seq = int(row[0])
        try:
            entry = _row_to_entry(row)
        except (StateError, ValueError, TypeError) as exc:
            problems.append(LedgerProblem(seq, f"unreadable entry ({exc})"))
            prev_hash = str(row[8])
            continue
        if entry.seq != position:
            problems.append(
                LedgerProblem(seq, f"sequence gap: expected seq {position} (entry deleted?)")
            )
        if entry.prev_hash != prev_hash:
            problems.append(
                LedgerProblem(
                    seq, "prev_hash does not match the previous entry (deleted/moved/inserted)"
                )
            )
        if _computed_entry_hash(entry, entry.segments_json) != entry.entry_hash:
            problems.append(LedgerProblem(seq, "entry_hash does not match its fields (edited)"))
        if entry.status != STATUS_COMMITTED:
            problems.append(LedgerProblem(seq, f"unknown status {entry.status!r}"))
        checked.append(entry)
        prev_hash = entry.entry_hash
    problems.extend(header_problems(header, rows=len(raw_rows), head=prev_hash))
    # Recompose only an intact chain: a broken one already fails, and recomposing costs
    # an accountant call per entry. This catches an epsilon edited with rehashed chain.
    recomposed = recompose and not problems
    if recomposed:
        problems.extend(_recompose_problems(header, checked))
    return VerifyReport(
        str(path), len(raw_rows), prev_hash, tuple(problems), epsilons_recomposed=recomposed,
        format=1,
    )


def _recompose_problems(header: LedgerHeader, entries: list[Format1Entry]) -> list[LedgerProblem]:
    recorded = (
        RecordedSpend(e.seq, e.segments, e.epsilon_after, e.accountant_used) for e in entries
    )
    found = recompose_mismatches(
        recorded,
        delta=header.delta,
        accountant=header.accountant,
        relative_tolerance=EPSILON_RELATIVE_TOLERANCE,
    )
    return [LedgerProblem(seq, message) for seq, message in found]


@dataclass(frozen=True)
class Migration:
    """What `migrate_ledger` did: the entries it signed, the epsilon of the whole history
    (the same before and after) and where the format-1 original was kept."""

    path: Path
    backup_path: Path
    entries: int
    spent_epsilon: float
    head_hash: str


def _format_of(connection: sqlite3.Connection) -> str | None:
    try:
        row = connection.execute("SELECT format FROM ledger_header WHERE id = 1").fetchone()
    except sqlite3.DatabaseError:
        return None
    return None if row is None else str(row[0])


def _signed(
    terms: LedgerTerms, entries: Sequence[Format1Entry], signer: LedgerSigner
) -> SignedHistory:
    signed: list[SignedEntry] = []
    previous = terms.header_hash
    for old in entries:
        entry = signer.sign(
            SignedEntry(
                site_id=terms.site_id,
                seq=old.seq,
                round=old.round,
                purpose=Purpose.TRAINING.value,
                mechanisms=tuple(old.segments),
                epsilon_after=old.epsilon_after,
                accountant_used=old.accountant_used,
                created_at=old.created_at,
                prev_hash=previous,
                cert_sha256=signer.cert_sha256,
            )
        )
        signed.append(entry)
        previous = entry.entry_hash
    return SignedHistory(terms, tuple(signed), {signer.cert_sha256: signer.certificate_der})


def migrate_ledger(
    path: str | Path, signer: LedgerSigner, *, anchor_path: str | Path | None = None
) -> Migration | None:
    """Sign the format-1 ledger at `path` into format 2 in place; None if it is already
    format 2. Run it with the site stopped.

    Refuses (nothing changed) a chain or an epsilon that does not verify
    (LedgerIntegrityError), a signer for another site (ConfigError), an anchor that shows
    more entries than the file (LedgerForkError), and an existing ``LEDGER.format1``.
    """
    ledger_path = Path(path)
    anchor_file = anchor_path_for(ledger_path) if anchor_path is None else Path(anchor_path)
    backup = ledger_path.with_name(ledger_path.name + BACKUP_SUFFIX)
    if not ledger_path.is_file():
        raise LedgerUnavailable(ledger_path, f"no privacy ledger at {ledger_path}")
    try:
        with contextlib.closing(sqlite3.connect(ledger_path, isolation_level=None)) as conn:
            found = _format_of(conn)
            if found == FORMAT2:
                return None
            if found != LEDGER_FORMAT:
                raise LedgerUnavailable(
                    ledger_path, f"{ledger_path} is not a medfed privacy ledger "
                    f"(format {found!r}); nothing was changed"
                )
            if backup.exists():
                raise LedgerUnavailable(
                    ledger_path, f"{backup} exists (an earlier migration's copy of the "
                    "format-1 ledger?); move it away first, nothing was changed"
                )
            _check_chain(conn, path=ledger_path, recompose=True).raise_if_broken()
            header = _read_header(conn)
            if header is None:
                raise LedgerUnavailable(ledger_path, f"ledger {ledger_path} has no header row")
            entries = _read_entries(conn)
            # Checkpoint any write-ahead log into the file, so that the file alone is the
            # ledger when it is copied and then replaced (no stale -wal left beside it).
            conn.execute("PRAGMA journal_mode=DELETE")
            with contextlib.closing(sqlite3.connect(backup)) as copy:
                conn.backup(copy)
    except sqlite3.Error as exc:
        raise LedgerUnavailable(
            ledger_path, f"cannot read the format-1 ledger {ledger_path} ({exc}); nothing "
            "was migrated"
        ) from None
    except OSError as exc:
        raise LedgerUnavailable(
            ledger_path, f"cannot migrate {ledger_path}: {exc.strerror}"
        ) from None
    try:
        if signer.site_id != header.site_id:
            raise ConfigError(
                "signer", f"the certificate names site {signer.site_id!r}, but {ledger_path} "
                f"is the ledger of {header.site_id!r}"
            )
        anchor = read_anchor(anchor_file)
        if anchor is not None and anchor.seq > len(entries):
            raise LedgerForkError(
                f"{anchor_file} records {anchor.seq} entries but {ledger_path} holds "
                f"{len(entries)}: this is an older copy of the ledger; nothing was migrated"
            )
        terms = LedgerTerms(
            site_id=header.site_id,
            budget_epsilon=header.budget_epsilon,
            delta=header.delta,
            accountant=header.accountant,
            privacy_unit=header.privacy_unit,
        )
        history = _signed(terms, entries, signer)
    except BaseException:
        backup.unlink(missing_ok=True)
        raise
    write_new_ledger(ledger_path, history)
    write_anchor(anchor_file, LedgerAnchor(terms.site_id, history.head_seq, history.head_hash))
    return Migration(
        path=ledger_path,
        backup_path=backup,
        entries=len(entries),
        spent_epsilon=entries[-1].epsilon_after if entries else 0.0,
        head_hash=history.head_hash,
    )
