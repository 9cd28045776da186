"""The privacy ledger's storage: the SQLite schema, its header row, opening a file with
every I/O fault turned into one `LedgerUnavailable`, reading and writing entry rows,
creating the schema."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from common.errors import (
    ConfigError,
    LedgerIntegrityError,
    LedgerUnavailable,
    StateError,
)
from common.privacy.mechanisms import (
    canonical_json,
)
from common.privacy.signed import (
    LEDGER_FORMAT,
    LedgerTerms,
    SignedEntry,
)

ANCHOR_FORMAT: Final = "medfed-ledger-anchor/1"
# The format-1 header's format string: recognised only to refuse the file and name the
# migration (common.privacy.migrate holds everything else about format 1).
FORMAT1: Final = "medfed-privacy-ledger/1"
# epsilon_after is recomposed on verify; allow for FFT round-off across machines/numpy.
EPSILON_RELATIVE_TOLERANCE: Final = 1e-6

LedgerEntry = SignedEntry

_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS ledger_header ("
    " id INTEGER PRIMARY KEY CHECK (id = 1), format TEXT NOT NULL, site_id TEXT NOT NULL,"
    " budget_epsilon REAL NOT NULL, delta REAL NOT NULL, accountant TEXT NOT NULL,"
    " privacy_unit TEXT NOT NULL, header_hash TEXT NOT NULL, entry_count INTEGER NOT NULL,"
    " head_hash TEXT NOT NULL)",
    # `body` is the canonical JSON the signature covers; round and purpose are copies
    # kept as columns for the one-entry-per-(round, purpose) rule (checked on read).
    "CREATE TABLE IF NOT EXISTS ledger_entries ("
    " seq INTEGER PRIMARY KEY, round INTEGER NOT NULL, purpose TEXT NOT NULL,"
    " body TEXT NOT NULL, signature BLOB NOT NULL, entry_hash TEXT NOT NULL,"
    " UNIQUE (round, purpose))",
    "CREATE TABLE IF NOT EXISTS ledger_certificates ("
    " sha256 TEXT PRIMARY KEY, der BLOB NOT NULL)",
    # Warnings an operator accepted (a restore below a signed head receipt, a carried
    # history): shown by `ledger show` and `verify`; not part of the signed chain.
    "CREATE TABLE IF NOT EXISTS ledger_notes (id INTEGER PRIMARY KEY, note TEXT NOT NULL)",
)
_ENTRY_COLUMNS: Final = "seq, round, purpose, body, signature, entry_hash"


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


def migrate_hint(path: Path) -> str:
    return (
        f"{path} is a format-1 (unsigned) privacy ledger: with the site stopped, sign it "
        f"into format 2 once with `medfed ledger migrate --ledger {path} --cert SITE.crt "
        "--key SITE.key` (the site's mTLS certificate and key; docs/privacy.md, "
        "'Format-1 ledgers')"
    )


def recovery_hint(path: Path) -> str:
    return (
        f"restore it from the coordinator's replica: `medfed ledger export --site SITE "
        f"--state COORDINATOR_STATE > export.json` there, then `medfed ledger restore --from "
        f"export.json --ledger {path}` here (docs/privacy.md, 'Restoring a ledger')"
    )


# ------------------------------------------------------------------------- I/O faults


def _fault(path: Path, exc: BaseException, doing: str) -> LedgerUnavailable:
    """One clear error for any SQLite / OS failure on the ledger file."""
    text = str(exc)
    lowered = text.lower()
    if not path.exists():
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} disappeared while {doing}; stop the site and "
            + recovery_hint(path),
        )
    if "readonly" in lowered or "read-only" in lowered or isinstance(exc, PermissionError):
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} cannot be written ({text}): the site agent needs "
            f"read-write access to the file and to its folder {path.parent} (SQLite "
            "creates its journal there); fix the permissions and start again",
        )
    if "no such table" in lowered or "no such column" in lowered:
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} is damaged ({text}); do not delete it: "
            + recovery_hint(path),
        )
    if isinstance(exc, sqlite3.DatabaseError):
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} is unreadable or not a ledger ({text}); keep the file "
            "for investigation (move it aside) and " + recovery_hint(path),
        )
    return LedgerUnavailable(path, f"privacy ledger {path}: {doing} failed ({text})")


@contextlib.contextmanager
def _guard(path: Path, doing: str) -> Iterator[None]:
    try:
        yield
    except (sqlite3.Error, OSError) as exc:
        raise _fault(path, exc, doing) from None


def _check_writable(path: Path) -> None:
    """Refuse a ledger its owner made read-only (also when running as root, where the
    OS would let SQLite write anyway): such a site could not record its spend."""
    for target, what in ((path, "file"), (path.parent, "folder")):
        if not target.exists():
            continue
        if not target.stat().st_mode & stat.S_IWUSR or not os.access(target, os.W_OK):
            raise LedgerUnavailable(
                path,
                f"privacy ledger {path} cannot be written: its {what} {target} is read-only; "
                "the site agent needs read-write access to the file and its folder (SQLite "
                "creates its journal there); fix the permissions and start again",
            )


@contextlib.contextmanager
def _connect(path: Path, *, mode: str) -> Iterator[sqlite3.Connection]:
    """mode "ro", "rw" (never creates: a deleted ledger must not come back empty) or
    "rwc" (creation only)."""
    if mode != "rwc" and not path.exists():
        raise LedgerUnavailable(path, f"no privacy ledger at {path}")
    uri = f"{path.resolve().as_uri()}?mode={mode}"
    # isolation_level=None: BEGIN IMMEDIATE / COMMIT are explicit, so each reserve is one
    # durable transaction (WAL + synchronous=FULL: survives power loss).
    connection = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30.0)
    try:
        if mode != "ro":
            connection.execute("PRAGMA synchronous=FULL")
        yield connection
    finally:
        connection.close()


@contextlib.contextmanager
def _transaction(connection: sqlite3.Connection) -> Iterator[None]:
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


# --------------------------------------------------------------------- reading rows


def _check_format(connection: sqlite3.Connection, path: Path) -> None:
    """LedgerUnavailable unless the file is a format-2 ledger (a format-1 one names the
    migration command)."""
    row = connection.execute(
        "SELECT format FROM ledger_header WHERE id = 1"
    ).fetchone()
    if row is None:
        raise LedgerUnavailable(path, f"privacy ledger {path} has no header row; "
                                + recovery_hint(path))
    if row[0] == FORMAT1:
        raise LedgerUnavailable(path, migrate_hint(path))
    if row[0] != LEDGER_FORMAT:
        raise LedgerUnavailable(path, f"{path}: unknown ledger format {row[0]!r}")


def read_header_row(connection: sqlite3.Connection) -> LedgerHeader | None:
    """The ledger's header row (either format), or None in a ledger without one."""
    row = connection.execute(
        "SELECT site_id, budget_epsilon, delta, accountant, privacy_unit, header_hash, "
        "entry_count, head_hash, format FROM ledger_header WHERE id = 1"
    ).fetchone()
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


def _read_header(connection: sqlite3.Connection) -> LedgerHeader:
    header = read_header_row(connection)
    if header is None:
        raise StateError("ledger has no header row")
    return header


def _terms(header: LedgerHeader) -> LedgerTerms:
    return LedgerTerms(
        site_id=header.site_id,
        budget_epsilon=header.budget_epsilon,
        delta=header.delta,
        accountant=header.accountant,
        privacy_unit=header.privacy_unit,
    )


def _parse_row(row: Sequence[Any]) -> SignedEntry:
    """An entries row -> SignedEntry; ConfigError if the stored copies disagree."""
    seq, round_number, purpose, body, signature, digest = row
    try:
        raw = json.loads(str(body))
    except ValueError:
        raise ConfigError("body", "not JSON") from None
    if not isinstance(raw, dict):
        raise ConfigError("body", "not a JSON object")
    entry = SignedEntry.from_json_dict(
        {**raw, "signature": bytes(signature).hex(), "entry_hash": str(digest)}
    )
    if canonical_json(raw).decode("ascii") != str(body):
        raise ConfigError("body", "not in canonical form")
    if (entry.seq, entry.round, entry.purpose) != (int(seq), int(round_number), str(purpose)):
        raise ConfigError("body", "seq/round/purpose columns differ from the signed body")
    return entry


def _read_entries(connection: sqlite3.Connection) -> list[SignedEntry]:
    rows = connection.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM ledger_entries ORDER BY seq"  # noqa: S608 (constant)
    ).fetchall()
    entries = []
    for row in rows:
        try:
            entries.append(_parse_row(row))
        except ConfigError as exc:
            raise LedgerIntegrityError(f"entry seq={row[0]}: unreadable ({exc})") from None
    return entries


def _read_certificates(connection: sqlite3.Connection) -> dict[str, bytes]:
    rows = connection.execute("SELECT sha256, der FROM ledger_certificates").fetchall()
    return {str(digest): bytes(der) for digest, der in rows}


def read_notes(connection: sqlite3.Connection) -> list[str]:
    """The ledger's recorded warnings (none in a ledger written before notes existed)."""
    exists = connection.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'ledger_notes'"
    ).fetchone()
    if exists is None:
        return []
    return [str(r[0]) for r in connection.execute("SELECT note FROM ledger_notes ORDER BY id")]


def add_note(connection: sqlite3.Connection, note: str) -> None:
    connection.execute(
        "CREATE TABLE IF NOT EXISTS ledger_notes (id INTEGER PRIMARY KEY, note TEXT NOT NULL)"
    )
    connection.execute("INSERT INTO ledger_notes (note) VALUES (?)", (note,))


def _create_schema(connection: sqlite3.Connection, terms: LedgerTerms) -> None:
    for statement in _SCHEMA:
        connection.execute(statement)
    genesis = terms.header_hash
    connection.execute(
        "INSERT INTO ledger_header (id, format, site_id, budget_epsilon, delta, accountant, "
        "privacy_unit, header_hash, entry_count, head_hash) VALUES (1, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
        (
            LEDGER_FORMAT,
            terms.site_id,
            terms.budget_epsilon,
            terms.delta,
            terms.accountant,
            terms.privacy_unit,
            genesis,
            genesis,
        ),
    )


def _insert_entry(connection: sqlite3.Connection, entry: SignedEntry) -> None:
    digest = entry.entry_hash
    connection.execute(
        f"INSERT INTO ledger_entries ({_ENTRY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",  # noqa: S608
        (
            entry.seq,
            entry.round,
            entry.purpose,
            entry.body_bytes().decode("ascii"),
            entry.signature,
            digest,
        ),
    )
    connection.execute(
        "UPDATE ledger_header SET entry_count = ?, head_hash = ? WHERE id = 1",
        (entry.seq, digest),
    )


