"""Format-1 ledgers (medfed-privacy-ledger/1): read, verify and migrate them.

Format 1 recorded DP-SGD segments only, chained by UNKEYED hashes (anyone able to rewrite
the file could recompute them). Format 2 (`common.privacy.ledger`) signs every entry.
A site agent opening a format-1 ledger with its signing key migrates it once
(`common.privacy.ledger.PrivacyLedger`): the format-1 chain is checked first, its rows are
kept in ``ledger_entries_format1`` for audit, and each entry is re-recorded as a signed
sampled-Gaussian entry for purpose "training". This module keeps the format-1 checks so
`medfed ledger verify` still reads a file that was never migrated.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from common.errors import (
    ConfigError,
    LedgerIntegrityError,
    StateError,
)
from common.privacy.accountant import Segment
from common.privacy.recompose import RecordedSpend, recompose_mismatches

LEDGER_FORMAT: Final = "medfed-privacy-ledger/1"
STATUS_COMMITTED: Final = "committed"

# epsilon_after is recomposed on verify; allow for FFT round-off across machines/numpy.
EPSILON_RELATIVE_TOLERANCE: Final = 1e-6

_SCHEMA = """
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
    raw = json.loads(text)
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
class LedgerEntry:
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


@dataclass(frozen=True)
class LedgerProblem:
    """One integrity failure; `seq` is the entry concerned (None: the header)."""

    seq: int | None
    message: str

    def __str__(self) -> str:
        where = "header" if self.seq is None else f"entry seq={self.seq}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """Result of `verify_ledger`; `problems[0]` is the first bad entry."""

    path: str
    entries_checked: int
    head_hash: str
    problems: tuple[LedgerProblem, ...] = field(default_factory=tuple)
    epsilons_recomposed: bool = False
    format: int = 1
    signatures_checked: int = 0
    ca_checked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_broken(self) -> None:
        if self.problems:
            raise LedgerIntegrityError(
                f"ledger {self.path} does not verify: {self.problems[0]}"
                + (f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else "")
            )


@dataclass(frozen=True)
class LedgerHeader:
    """The header row: the site's fixed budget terms plus the chain's anchors."""

    site_id: str
    budget_epsilon: float
    delta: float
    accountant: str
    privacy_unit: str
    header_hash: str
    entry_count: int
    head_hash: str
    format: str


@contextlib.contextmanager
def _connect(path: Path, *, read_only: bool = False) -> Iterator[sqlite3.Connection]:
    # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves so each reserve is
    # exactly one durable transaction (WAL + synchronous=FULL: survives power loss).
    if read_only:
        uri = f"{path.resolve().as_uri()}?mode=ro"
        connection = sqlite3.connect(uri, uri=True, isolation_level=None)
    else:
        connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("PRAGMA synchronous=FULL")
        yield connection
    finally:
        connection.close()


def _read_header(connection: sqlite3.Connection) -> LedgerHeader | None:
    try:
        row = connection.execute(
            "SELECT site_id, budget_epsilon, delta, accountant, privacy_unit, header_hash, "
            "entry_count, head_hash, format FROM ledger_header WHERE id = 1"
        ).fetchone()
    except sqlite3.DatabaseError as exc:
        raise StateError(f"not a medfed privacy ledger: {exc}") from exc
    if row is None:
        return None
    return LedgerHeader(
        site_id=str(row[0]),
        budget_epsilon=float(row[1]),
        delta=float(row[2]),
        accountant=str(row[3]),
        privacy_unit=str(row[4]),
        header_hash=str(row[5]),
        entry_count=int(row[6]),
        head_hash=str(row[7]),
        format=str(row[8]),
    )


def _row_to_entry(row: Sequence[Any]) -> LedgerEntry:
    return LedgerEntry(
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


def _read_entries(connection: sqlite3.Connection) -> list[LedgerEntry]:
    rows = connection.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM ledger_entries ORDER BY seq"  # noqa: S608 (constant)
    ).fetchall()
    return [_row_to_entry(row) for row in rows]


def _computed_entry_hash(entry: LedgerEntry, segments_json: str) -> str:
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
    checked: list[LedgerEntry] = []
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
    if header.entry_count != len(raw_rows):
        problems.append(
            LedgerProblem(
                None,
                f"header records {header.entry_count} entries but {len(raw_rows)} are present"
                " (last entry deleted or entry inserted?)",
            )
        )
    if header.head_hash != prev_hash:
        problems.append(LedgerProblem(None, "head_hash does not match the last entry"))
    # Recompose only an intact chain: a broken one already fails, and recomposing costs
    # an accountant call per entry. This catches an epsilon edited with rehashed chain.
    recomposed = recompose and not problems
    if recomposed:
        problems.extend(_recompose_problems(header, checked))
    return VerifyReport(
        str(path), len(raw_rows), prev_hash, tuple(problems), epsilons_recomposed=recomposed
    )


def _recompose_problems(header: LedgerHeader, entries: list[LedgerEntry]) -> list[LedgerProblem]:
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


def read_ledger_format1(path: str | Path) -> tuple[LedgerHeader, list[LedgerEntry]]:
    """Header and entries of a ledger, read-only and WITHOUT verifying it."""
    ledger_path = Path(path)
    if not ledger_path.is_file():
        raise StateError(f"no ledger at {ledger_path}")
    try:
        with _connect(ledger_path, read_only=True) as connection:
            header = _read_header(connection)
            if header is None:
                raise StateError(f"ledger {ledger_path} has no header row")
            return header, _read_entries(connection)
    except sqlite3.DatabaseError as exc:
        raise StateError(f"{ledger_path} is not a readable ledger: {exc}") from exc


def verify_ledger_format1(path: str | Path, *, recompose: bool = True) -> VerifyReport:
    """Re-walk a ledger's hash chain (read-only) and, if the chain is intact and
    `recompose` is set, recompose every `epsilon_after` from the stored segments.

    Detects an edited, deleted (including the last), reordered or inserted entry, an
    edited header, and a wrong `epsilon_after` even when its hashes were recomputed.
    Raises StateError if the file is missing or is not a ledger.
    """
    ledger_path = Path(path)
    if not ledger_path.is_file():
        raise StateError(f"no ledger at {ledger_path}")
    try:
        with _connect(ledger_path, read_only=True) as connection:
            return _check_chain(connection, path=ledger_path, recompose=recompose)
    except sqlite3.DatabaseError as exc:
        raise StateError(f"{ledger_path} is not a readable ledger: {exc}") from exc




def check_chain_format1(
    connection: sqlite3.Connection, *, path: Path, recompose: bool
) -> VerifyReport:
    """The format-1 chain check on an open connection (used before migrating)."""
    return _check_chain(connection, path=path, recompose=recompose)


def read_format1(connection: sqlite3.Connection) -> tuple[LedgerHeader | None, list[LedgerEntry]]:
    """Header and entries of an open format-1 ledger, unverified."""
    return _read_header(connection), _read_entries(connection)
