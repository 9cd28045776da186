"""Each site's own privacy-budget ledger: SQLite, write-ahead, signed, anchored.

The ledger is authoritative for its site (DESIGN.md "Privacy"): the coordinator is not
trusted with it, it only keeps a replica (`common.privacy.replica`). Before anything
private leaves the site, the mechanisms that produced it are committed here
(write-ahead), so a crash can over-count the spend, never under-count it. A site's ledger
and budget belong to its data for life, across studies.

Format 2 (``medfed-privacy-ledger/2``, see `common.privacy.signed`):

* the header holds the budget, delta, accountant and privacy unit; its hash is the
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
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sqlite3
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from cryptography import x509

from common.errors import (
    BudgetExhausted,
    ConfigError,
    LedgerForkError,
    LedgerIntegrityError,
    LedgerUnavailable,
    StateError,
)
from common.fileio import atomic_write, fsync_directory
from common.privacy.accountant import ACCOUNTANTS, EpsilonReport
from common.privacy.budget import BudgetReport
from common.privacy.layered import charged
from common.privacy.mechanisms import (
    MECHANISM_TYPES,
    Mechanism,
    canonical_json,
    mechanisms_to_json,
)
from common.privacy.recompose import RecordedSpend, recompose_mismatches
from common.privacy.signed import (
    LEDGER_FORMAT,
    PRIVACY_UNITS,
    PURPOSES,
    HistoryProblem,
    LedgerSigner,
    LedgerTerms,
    SignedEntry,
    SignedHistory,
    check_entries,
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
    "VerifyReport",
    "anchor_path_for",
    "export_ledger",
    "migrate_hint",
    "read_anchor",
    "read_ledger",
    "recovery_hint",
    "restore_ledger",
    "verify_ledger",
    "write_new_ledger",
]

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
    format: int = 2
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


def _read_header(connection: sqlite3.Connection) -> LedgerHeader:
    row = connection.execute(
        "SELECT site_id, budget_epsilon, delta, accountant, privacy_unit, header_hash, "
        "entry_count, head_hash, format FROM ledger_header WHERE id = 1"
    ).fetchone()
    if row is None:
        raise StateError("ledger has no header row")
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


def _check_v2(
    connection: sqlite3.Connection,
    *,
    path: Path,
    recompose: bool,
    ca_certificate: x509.Certificate | None = None,
) -> VerifyReport:
    """Header, chain, signatures (and epsilons if `recompose`): every problem found."""
    header = _read_header(connection)
    terms = _terms(header)
    problems: list[LedgerProblem] = []
    if terms.header_hash != header.header_hash:
        problems.append(LedgerProblem(None, "header fields do not match header_hash"))
    rows = connection.execute(
        f"SELECT {_ENTRY_COLUMNS} FROM ledger_entries ORDER BY seq"  # noqa: S608 (constant)
    ).fetchall()
    entries: list[SignedEntry] = []
    unreadable = False
    for row in rows:
        try:
            entries.append(_parse_row(row))
        except ConfigError as exc:
            problems.append(LedgerProblem(int(row[0]), f"unreadable entry ({exc})"))
            unreadable = True
    if not unreadable:
        found = check_entries(
            terms, entries, _read_certificates(connection), ca_certificate=ca_certificate
        )
        problems.extend(_as_problem(p) for p in found)
    head = entries[-1].entry_hash if entries else terms.header_hash
    if header.entry_count != len(rows):
        problems.append(
            LedgerProblem(
                None,
                f"header records {header.entry_count} entries but {len(rows)} are present"
                " (last entry deleted or entry inserted?)",
            )
        )
    if header.head_hash != head:
        problems.append(LedgerProblem(None, "head_hash does not match the last entry"))
    recomposed = recompose and not problems
    if recomposed:
        problems.extend(_recompose_problems(terms, entries))
    return VerifyReport(
        str(path),
        len(rows),
        head,
        tuple(problems),
        epsilons_recomposed=recomposed,
        format=2,
        signatures_checked=len(entries) if not unreadable else 0,
        ca_checked=ca_certificate is not None,
    )


def _as_problem(problem: HistoryProblem) -> LedgerProblem:
    return LedgerProblem(problem.seq, problem.message)


def _recompose_problems(terms: LedgerTerms, entries: Sequence[SignedEntry]) -> list[LedgerProblem]:
    recorded = (
        RecordedSpend(e.seq, e.mechanisms, e.epsilon_after, e.accountant_used, e.purpose)
        for e in entries
    )
    found = recompose_mismatches(
        recorded,
        delta=terms.delta,
        accountant=terms.accountant,
        relative_tolerance=EPSILON_RELATIVE_TOLERANCE,
    )
    return [LedgerProblem(seq, message) for seq, message in found]


def history_problems(
    history: SignedHistory,
    *,
    recompose: bool = True,
    ca_certificate: x509.Certificate | None = None,
) -> list[LedgerProblem]:
    """Every problem of a whole exported history (signatures, chain, epsilons)."""
    from common.privacy.signed import verify_history

    problems = [_as_problem(p) for p in verify_history(history, ca_certificate=ca_certificate)]
    if recompose and not problems:
        problems.extend(_recompose_problems(history.terms, history.entries))
    return problems


# --------------------------------------------------------------------------- anchor


@dataclass(frozen=True)
class LedgerAnchor:
    """The latest head the site recorded OUTSIDE its ledger file."""

    site_id: str
    seq: int
    head_hash: str

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "format": ANCHOR_FORMAT,
                "site_id": self.site_id,
                "seq": self.seq,
                "head_hash": self.head_hash,
            }
        )


def anchor_path_for(ledger_path: str | Path) -> Path:
    """``<ledger>.anchor``, in the site's state folder beside the ledger."""
    path = Path(ledger_path)
    return path.with_name(path.name + ".anchor")


def read_anchor(path: str | Path) -> LedgerAnchor | None:
    """The anchor at `path`, None if there is none; LedgerUnavailable if unreadable."""
    anchor_path = Path(path)
    try:
        data = anchor_path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise LedgerUnavailable(
            anchor_path, f"ledger anchor {anchor_path} is unreadable ({exc.strerror})"
        ) from None
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != ANCHOR_FORMAT:
            raise ValueError("not a ledger anchor")
        seq, head, site = raw["seq"], raw["head_hash"], raw["site_id"]
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError("bad seq")
        if not (isinstance(head, str) and isinstance(site, str)):
            raise ValueError("bad head_hash or site_id")
    except (ValueError, KeyError) as exc:
        raise LedgerUnavailable(
            anchor_path,
            f"ledger anchor {anchor_path} is damaged ({exc}); it is the site's only record "
            "of its ledger head outside the ledger: compare the ledger with the "
            "coordinator's replica (`medfed ledger export`) before removing it",
        ) from None
    return LedgerAnchor(site_id=site, seq=seq, head_hash=head)


def write_anchor(path: str | Path, anchor: LedgerAnchor) -> None:
    """Atomic, durable replace (temp file, fsync, rename, fsync of the folder)."""
    anchor_path = Path(path)
    with _guard(anchor_path, "writing the ledger anchor"):
        atomic_write(anchor_path, anchor.to_bytes(), mode=0o600)


def _check_anchor(
    path: Path, anchor: LedgerAnchor, site_id: str, entries: Sequence[SignedEntry]
) -> None:
    if anchor.site_id != site_id:
        raise LedgerForkError(
            f"ledger anchor of {path} belongs to site {anchor.site_id!r}, not {site_id!r}"
        )
    if len(entries) < anchor.seq:
        raise LedgerForkError(
            f"privacy ledger {path} holds {len(entries)} entries but its anchor records "
            f"{anchor.seq} (head {anchor.head_hash[:16]}...): this is an older, truncated or "
            "reset copy and the site will not spend a budget it already spent; "
            + recovery_hint(path)
        )
    if anchor.seq > 0 and entries[anchor.seq - 1].entry_hash != anchor.head_hash:
        raise LedgerForkError(
            f"privacy ledger {path} entry seq={anchor.seq} differs from the head its anchor "
            "records: the history was rewritten (a fork); " + recovery_hint(path)
        )


# ----------------------------------------------------------------- read-only access


def read_ledger(path: str | Path) -> tuple[LedgerHeader, list[SignedEntry]]:
    """Header and entries of a ledger, read-only and WITHOUT verifying signatures."""
    ledger_path = Path(path)
    with _guard(ledger_path, "reading the ledger"), _connect(ledger_path, mode="ro") as conn:
        _check_format(conn, ledger_path)
        return _read_header(conn), list(_read_entries(conn))


def verify_ledger(
    path: str | Path,
    *,
    recompose: bool = True,
    ca_certificate: x509.Certificate | None = None,
    anchor_path: str | Path | None = None,
) -> VerifyReport:
    """Re-walk a ledger (read-only): header, hash chain, every signature with the
    certificate it names (issued by `ca_certificate` if given) and, when the rest is
    intact and `recompose` is set, every `epsilon_after`. With `anchor_path` (format 2),
    also the anchor file there, if any: it catches what the file alone cannot, a last
    entry deleted together with a header made to match (as the site does on open).

    LedgerUnavailable if the file is missing, is not a ledger or is a format-1 one (the
    message names `medfed ledger migrate`)."""
    ledger_path = Path(path)
    with _guard(ledger_path, "verifying the ledger"), _connect(ledger_path, mode="ro") as conn:
        _check_format(conn, ledger_path)
        report = _check_v2(conn, path=ledger_path, recompose=recompose,
                           ca_certificate=ca_certificate)
        if anchor_path is None:
            return report
        found = _anchor_problems(conn, ledger_path, Path(anchor_path))
    return dataclasses.replace(report, problems=report.problems + tuple(found))


def _anchor_problems(
    connection: sqlite3.Connection, path: Path, anchor_file: Path
) -> list[LedgerProblem]:
    """The anchor check the site runs when it opens its ledger, as problems."""
    try:
        anchor = read_anchor(anchor_file)
        if anchor is None:
            return []
        entries = list(_read_entries(connection))
    except LedgerUnavailable as exc:
        return [LedgerProblem(None, str(exc))]
    except LedgerIntegrityError:
        return []  # an unreadable entry: _check_v2 already reported it
    try:
        _check_anchor(path, anchor, _read_header(connection).site_id, entries)
    except LedgerForkError as exc:
        return [LedgerProblem(None, f"anchor {anchor_file}: {exc}")]
    return []


def export_ledger(path: str | Path, *, after_seq: int = 0) -> SignedHistory:
    """The ledger's signed history (entries after `after_seq`) and certificates."""
    ledger_path = Path(path)
    with _guard(ledger_path, "exporting the ledger"), _connect(ledger_path, mode="ro") as conn:
        _check_format(conn, ledger_path)
        header = _read_header(conn)
        entries = [e for e in _read_entries(conn) if e.seq > after_seq]
        certificates = _read_certificates(conn)
    used = {e.cert_sha256 for e in entries}
    return SignedHistory(
        _terms(header),
        tuple(entries),
        {digest: der for digest, der in certificates.items() if digest in used},
    )


def restore_ledger(
    history: SignedHistory,
    path: str | Path,
    *,
    anchor_path: str | Path | None = None,
    min_seq: int = 0,
    ca_certificate: x509.Certificate | None = None,
    site_id: str | None = None,
) -> LedgerAnchor:
    """Write `history` as a new ledger at `path` after verifying all of it.

    Refuses (LedgerIntegrityError / LedgerForkError, nothing written) a history whose
    signatures, chain or epsilons do not verify, that is for another site, that is
    shorter than `min_seq` or than the anchor's head, or that does not contain the
    anchor's head. Never overwrites an existing ledger. A restore proves a LOWER bound on
    the spend: entries the site made after the export was taken cannot be in it."""
    ledger_path = Path(path)
    anchor_file = anchor_path_for(ledger_path) if anchor_path is None else Path(anchor_path)
    if ledger_path.exists():
        raise LedgerUnavailable(
            ledger_path, f"{ledger_path} exists; a restore never overwrites a ledger "
            "(move it aside first if it is damaged)"
        )
    for target, what in ((ledger_path, "ledger"), (anchor_file, "anchor")):
        # Never created here: a mistyped --ledger would put the restored ledger where
        # the site agent never reads it, which then starts from an empty one elsewhere.
        if not target.parent.is_dir():
            raise LedgerUnavailable(
                ledger_path, f"the folder {target.parent} for the restored {what} "
                f"{target} does not exist. A restore creates no folder: name the site's "
                "state folder (the one `site run --state` uses; the ledger is "
                "STATE/privacy-ledger.db), or create it first if this is a new machine "
                f"(`mkdir -m 700 {target.parent}`)"
            )
    if site_id is not None and history.terms.site_id != site_id:
        raise LedgerIntegrityError(
            f"the export is for site {history.terms.site_id!r}, not {site_id!r}"
        )
    problems = history_problems(history, ca_certificate=ca_certificate)
    if problems:
        raise LedgerIntegrityError(f"the export does not verify: {problems[0]}"
                                   + (f" (+{len(problems) - 1} more)" if len(problems) > 1
                                      else ""))
    anchor = read_anchor(anchor_file)
    floor = max(min_seq, anchor.seq if anchor is not None else 0)
    if history.head_seq < floor:
        raise LedgerForkError(
            f"the export ends at seq {history.head_seq}, but this site is known to have "
            f"reached seq {floor}: restoring it would forget spent budget"
        )
    if anchor is not None:
        _check_anchor(ledger_path, anchor, history.terms.site_id, history.entries)
    write_new_ledger(ledger_path, history)
    restored = LedgerAnchor(history.terms.site_id, history.head_seq, history.head_hash)
    write_anchor(anchor_file, restored)
    return restored


def write_new_ledger(path: Path, history: SignedHistory) -> None:
    """Write `history` (already verified or freshly signed by the caller) as the ledger
    at `path`: built in a temporary file, checked, then renamed over `path` in one step."""
    temporary = path.with_name(path.name + ".restoring")
    with _guard(path, "writing the ledger"):
        for leftover in (temporary, Path(f"{temporary}-wal"), Path(f"{temporary}-shm")):
            leftover.unlink(missing_ok=True)
        with _connect(temporary, mode="rwc") as conn:
            with _transaction(conn):
                _create_schema(conn, history.terms)
                for digest, der in history.certificates.items():
                    conn.execute(
                        "INSERT INTO ledger_certificates (sha256, der) VALUES (?, ?)",
                        (digest, der),
                    )
                for entry in history.entries:
                    _insert_entry(conn, entry)
            _check_v2(conn, path=path, recompose=False).raise_if_broken()
        os.replace(temporary, path)
        fsync_directory(path.parent)


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


# ----------------------------------------------------------------------- the ledger


class PrivacyLedger:
    """The site's authoritative record of its DP spend; enforces its epsilon budget.

    Opening an existing file resumes its history: the stored site id, budget, delta,
    accountant and privacy unit must equal the ones given (ConfigError names the field).
    The chain and every signature are checked on open (LedgerIntegrityError), and the
    file is compared with its anchor (LedgerForkError if older, shorter or rewritten). A
    missing ledger whose anchor shows history is NOT recreated (LedgerUnavailable).

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
        signer: LedgerSigner | None = None,
        anchor_path: str | Path | None = None,
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
        self.signer = signer
        self.terms = LedgerTerms(
            site_id=site_id,
            budget_epsilon=self.budget_epsilon,
            delta=self.delta,
            accountant=accountant,
            privacy_unit=privacy_unit,
        )
        self._open_or_create()

    # -- setup -------------------------------------------------------------------------

    def _open_or_create(self) -> None:
        anchor = read_anchor(self.anchor_path)
        if not self.path.exists():
            if anchor is not None and anchor.seq > 0:
                raise LedgerUnavailable(
                    self.path,
                    f"privacy ledger {self.path} is missing, but its anchor "
                    f"{self.anchor_path} records {anchor.seq} entries (head "
                    f"{anchor.head_hash[:16]}...): the site refuses to start again at zero "
                    "spend; " + recovery_hint(self.path),
                )
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
        for name in ("site_id", "budget_epsilon", "delta", "accountant", "privacy_unit"):
            if getattr(stored, name) != getattr(self.terms, name):
                raise ConfigError(
                    name,
                    f"ledger {self.path} was created with {name}="
                    f"{getattr(stored, name)!r}, not {getattr(self.terms, name)!r}; a site "
                    "resumes its ledger, it cannot change it",
                )
        if anchor is not None:
            _check_anchor(self.path, anchor, self.site_id, entries)
        self._write_anchor(entries)

    def _open(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return _connect(self.path, mode="rw")

    def _write_anchor(self, entries: Sequence[SignedEntry]) -> None:
        head = entries[-1].entry_hash if entries else self.terms.header_hash
        write_anchor(self.anchor_path, LedgerAnchor(self.site_id, len(entries), head))

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

    def spent_by_purpose(self) -> dict[str, float]:
        """Epsilon of each purpose's entries composed ALONE (for reports: what is spent
        on what). These do not add up to `spent()`, which composes everything."""
        by_purpose: dict[str, list[SignedEntry]] = {}
        for entry in self.entries():
            by_purpose.setdefault(entry.purpose, []).append(entry)
        return {
            purpose: self._charge(self._pairs(entries)).epsilon
            for purpose, entries in sorted(by_purpose.items())
        }

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
        purpose: str = "training", also: Sequence[tuple[str, Sequence[Mechanism]]] = (),
    ) -> float:
        """Epsilon charged after the whole history if `mechanisms` (of `purpose`) and
        `also` ((purpose, mechanisms) pairs, e.g. the round's evaluation) were added."""
        del round_number  # the round does not change the maths; kept for call symmetry
        pairs = [*self._pairs(self.entries()), (purpose, tuple(mechanisms)), *also]
        return self._charge(pairs).epsilon

    def require(
        self, round_number: int, mechanisms: Sequence[Mechanism], *,
        purpose: str = "training", also: Sequence[tuple[str, Sequence[Mechanism]]] = (),
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
            f"{self.budget_epsilon:g} (spent {spent:.4f}, delta {self.delta:g})"
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
        purpose: str = "training",
    ) -> SignedEntry:
        """Commit this release's spend BEFORE it leaves the site (write-ahead).

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
        mechanisms = tuple(mechanisms)
        if not mechanisms or not all(isinstance(m, MECHANISM_TYPES) for m in mechanisms):
            raise ConfigError("mechanisms", "a reservation needs at least one mechanism")
        created_at = utc_timestamp(now)
        if self.signer is None:
            raise ConfigError("signer", "recording a spend needs the site's signing key")
        _check_writable(self.path)
        with _guard(self.path, "recording a spend"), self._open() as conn, _transaction(conn):
            entry, entries = self._reserve_locked(
                conn, round_number, purpose, mechanisms, created_at
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
    ) -> tuple[SignedEntry, list[SignedEntry]]:
        signer = self.signer
        if signer is None:
            raise ConfigError("signer", "recording a spend needs the site's signing key")
        entries = _read_entries(conn)
        for existing in entries:
            if existing.round == round_number and existing.purpose == purpose:
                if mechanisms_to_json(existing.mechanisms) == mechanisms_to_json(mechanisms):
                    return existing, entries
                raise StateError(
                    f"round {round_number} ({purpose}) is already reserved with different "
                    f"mechanisms ({mechanisms_to_json(existing.mechanisms)} != "
                    f"{mechanisms_to_json(mechanisms)})"
                )
        header = _read_header(conn)
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
            )
        )
        self._store_certificate(conn)
        _insert_entry(conn, entry)
        return entry, [*entries, entry]

    @staticmethod
    def _pairs(entries: Sequence[SignedEntry]) -> list[tuple[str, Sequence[Mechanism]]]:
        return [(entry.purpose, entry.mechanisms) for entry in entries]

    def _charge(self, pairs: Sequence[tuple[str, Sequence[Mechanism]]]) -> EpsilonReport:
        """The whole history composed, or under record/patient-level DP-SGD beneath
        hospital-level DP the record-level epsilon (`common.privacy.layered.charged`)."""
        return charged(pairs, delta=self.delta, accountant=self.accountant)
