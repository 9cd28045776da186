"""The privacy ledger's storage: the SQLite schema, its header row, opening a file with
every I/O fault turned into one `LedgerUnavailable`, reading and writing entry rows,
creating the schema."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from common.core.errors import (
    ConfigError,
    LedgerIntegrityError,
    LedgerUnavailable,
    StateError,
    ValidationError,
)
from common.core.parsing import parse_json
from common.privacy.mechanisms import (
    canonical_json,
)
from common.privacy.signed import (
    CHARGE_UNIT,
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
    " head_hash TEXT NOT NULL, charge TEXT)",
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
    charge: str = CHARGE_UNIT
    """What the budget is charged with; `CHARGE_UNIT` in a file without the column."""


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


# SQLite's primary result codes (https://www.sqlite.org/rescode.html): the low byte of
# `sqlite3.Error.sqlite_errorcode`.
_SQLITE_PERM: Final = 3
_SQLITE_READONLY: Final = 8
_SQLITE_IOERR: Final = 10
_SQLITE_CORRUPT: Final = 11
_SQLITE_FULL: Final = 13
_SQLITE_CANTOPEN: Final = 14
_SQLITE_NOTADB: Final = 26
_DISK_FULL_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
_READ_ONLY_ERRNOS: Final = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def _sqlite_code(exc: BaseException) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


# Below this many free bytes a failed write is put down to a full disk: SQLite reports
# ENOSPC while growing its -shm index as a plain I/O error (SQLITE_IOERR_SHMSIZE), and a
# ledger write needs at least a 32 KiB index page plus its log pages.
_NEARLY_FULL_BYTES: Final = 1 << 20


def _free_bytes(folder: Path) -> int | None:
    """Bytes this process may still write on `folder`'s filesystem (root may use the
    reserved blocks), or None when that cannot be asked."""
    try:
        found = os.statvfs(folder)
    except OSError:
        return None
    blocks = found.f_bfree if os.geteuid() == 0 else found.f_bavail
    return blocks * found.f_frsize


def _fault(path: Path, exc: BaseException, doing: str) -> LedgerUnavailable:
    """One clear error for any SQLite / OS failure on the ledger file. A full disk, a
    read-only file or folder and a damaged file are told apart: only damage calls for a
    restore, the other two leave the ledger intact and name what to fix."""
    text = str(exc)
    lowered = text.lower()
    code = _sqlite_code(exc)
    os_errno = exc.errno if isinstance(exc, OSError) else None
    free = _free_bytes(path.parent) if code == _SQLITE_IOERR else None
    if (code == _SQLITE_FULL or os_errno in _DISK_FULL_ERRNOS
            or (free is not None and free < _NEARLY_FULL_BYTES)):
        left = "" if free is None else f"; {free} bytes free"
        return LedgerUnavailable(
            path,
            f"disk full at {path.parent} while {doing} ({text}{left}): free space on that "
            f"filesystem and start again; the privacy ledger {path} is intact (the "
            "unfinished write was rolled back), do not move or restore it",
        )
    if not path.exists():
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} disappeared while {doing}; stop the site and "
            + recovery_hint(path),
        )
    if (code in (_SQLITE_READONLY, _SQLITE_PERM) or os_errno in _READ_ONLY_ERRNOS
            or "readonly" in lowered or "read-only" in lowered):
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} is read-only ({text}): the site agent needs "
            f"read-write access to the file and to its folder {path.parent} (SQLite "
            "creates its journal there); fix the permissions or the mount and start "
            "again. The ledger is not damaged: `medfed ledger show` and `verify` read a "
            "read-only copy as it is",
        )
    if code == _SQLITE_CANTOPEN:
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} cannot be opened while {doing} ({text}): check that "
            f"the file and its folder {path.parent} are readable (and, for the site "
            "agent, writable); this is not a sign of damage",
        )
    if "no such table" in lowered or "no such column" in lowered:
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} is damaged ({text}); do not delete it: "
            + recovery_hint(path),
        )
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or (
        isinstance(exc, sqlite3.DatabaseError)
        and not isinstance(exc, sqlite3.OperationalError)
    ):
        return LedgerUnavailable(
            path,
            f"privacy ledger {path} is unreadable or not a ledger ({text}); keep the file "
            "for investigation (move it aside) and " + recovery_hint(path),
        )
    if code == _SQLITE_IOERR or isinstance(exc, OSError):
        return LedgerUnavailable(
            path,
            f"privacy ledger {path}: I/O error while {doing} ({text}); check the disk "
            "(kernel log) and run `medfed ledger verify` before restoring anything",
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
    "rwc" (creation only). "ro" also reads a copy in a folder nobody can write (an
    auditor's snapshot, a read-only mount), see `_read_only_uri`."""
    if mode != "rwc" and not path.exists():
        raise LedgerUnavailable(path, f"no privacy ledger at {path}")
    uri = f"{path.resolve().as_uri()}?mode={mode}"
    if mode == "ro":
        uri = _read_only_uri(path, uri)
    # isolation_level=None: BEGIN IMMEDIATE / COMMIT are explicit, so each reserve is one
    # durable transaction (WAL + synchronous=FULL: survives power loss).
    connection = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=30.0)
    try:
        if mode != "ro":
            connection.execute("PRAGMA synchronous=FULL")
        yield connection
    finally:
        connection.close()


def _read_only_uri(path: Path, uri: str) -> str:
    """The URI that reads `path` without writing anything. A WAL-mode ledger opened
    read-only still needs its -shm index, which SQLite creates beside the file; in a
    folder that cannot be written that fails, so the file is opened `immutable=1`
    (https://www.sqlite.org/uri.html): no -wal/-shm, no locks. Only safe when nothing
    else can be pending: a non-empty -wal beside the file holds committed entries the
    immutable read would skip, so it is read with its -shm, or refused."""
    folder = path.resolve().parent
    if os.access(folder, os.W_OK):
        return uri
    wal = folder / f"{path.name}-wal"
    if wal.exists() and wal.stat().st_size > 0:
        if (folder / f"{path.name}-shm").exists():
            return uri
        raise LedgerUnavailable(
            path,
            f"privacy ledger {path} has a write-ahead log {wal} with entries not yet in "
            f"the file, and its folder {folder} is read-only: copy the ledger together "
            "with its -wal file into a writable folder and read that copy",
        )
    return f"{uri}&immutable=1"


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
    # A ledger created before the `charge` column keeps its file as it is: the column is
    # read where it exists, never added.
    columns = {str(c[1]) for c in connection.execute("PRAGMA table_info(ledger_header)")}
    row = connection.execute(
        "SELECT site_id, budget_epsilon, delta, accountant, privacy_unit, header_hash, "
        "entry_count, head_hash, format, charge FROM ledger_header WHERE id = 1"
        if "charge" in columns else
        "SELECT site_id, budget_epsilon, delta, accountant, privacy_unit, header_hash, "
        "entry_count, head_hash, format, NULL FROM ledger_header WHERE id = 1"
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
        charge=CHARGE_UNIT if row[9] is None else str(row[9]),
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
        charge=header.charge,
    )


def _parse_row(row: Sequence[Any]) -> SignedEntry:
    """An entries row -> SignedEntry; ConfigError if the stored copies disagree."""
    seq, round_number, purpose, body, signature, digest = row
    try:
        raw = parse_json(str(body))
    except ValidationError as exc:
        raise ConfigError("body", str(exc)) from None
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
        "privacy_unit, header_hash, entry_count, head_hash, charge) "
        "VALUES (1, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)",
        (
            LEDGER_FORMAT,
            terms.site_id,
            terms.budget_epsilon,
            terms.delta,
            terms.accountant,
            terms.privacy_unit,
            genesis,
            genesis,
            None if terms.charge == CHARGE_UNIT else terms.charge,
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


