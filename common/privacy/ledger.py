"""Each site's own privacy-budget ledger: SQLite, write-ahead, hash-chained.

The ledger is authoritative for its site (DESIGN.md "Privacy"): the coordinator is not
trusted with it. Before an update leaves the site, the round's DP-SGD segments are
committed here (write-ahead), so a crash can over-count the spend, never under-count it.

Integrity (see docs/privacy.md for what is and is not detectable):

* the header row holds the budget, delta, accountant and privacy unit; its hash is the
  genesis ``prev_hash``;
* each entry's ``entry_hash`` = SHA-256 over a canonical encoding of all its fields and
  ``prev_hash`` (the previous entry's hash);
* the header also keeps a running ``entry_count`` and ``head_hash`` updated in the same
  transaction as each insert, so a deleted LAST entry is detected too;
* `verify_ledger` re-walks the chain and recomposes every ``epsilon_after``.

The hashes are unkeyed: someone able to rewrite the whole file can recompute them. Anchor
the head hash elsewhere (the federation view records it) to detect that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from common.errors import (
    BudgetExhausted,
    ConfigError,
    LedgerIntegrityError,
    StateError,
)
from common.privacy.accountant import ACCOUNTANTS, EpsilonReport, Segment, account

LEDGER_FORMAT: Final = "medfed-privacy-ledger/1"
PRIVACY_UNITS: Final = ("record", "patient")
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
class BudgetStatus:
    """What a site reports about its budget (never its data)."""

    site_id: str
    budget_epsilon: float
    delta: float
    spent_epsilon: float
    remaining_epsilon: float
    last_round: int | None
    exhausted: bool
    privacy_unit: str = "record"
    ledger_entries: int = 0
    ledger_head: str = ""


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
    problems = []
    history: list[Segment] = []
    for entry in entries:
        history.extend(entry.segments)
        report = account(history, delta=header.delta, accountant=header.accountant)
        if not math.isclose(
            report.epsilon, entry.epsilon_after, rel_tol=EPSILON_RELATIVE_TOLERANCE
        ):
            problems.append(
                LedgerProblem(
                    entry.seq,
                    f"epsilon_after {entry.epsilon_after!r} differs from the recomposed "
                    f"{report.epsilon!r}",
                )
            )
        elif report.accountant != entry.accountant_used:
            problems.append(
                LedgerProblem(entry.seq, "accountant_used differs from the recomputed one")
            )
    return problems


def read_ledger(path: str | Path) -> tuple[LedgerHeader, list[LedgerEntry]]:
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


def verify_ledger(path: str | Path, *, recompose: bool = True) -> VerifyReport:
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


class PrivacyLedger:
    """The site's authoritative record of its DP spend; enforces its epsilon budget.

    Opening an existing file resumes its history: the stored site id, budget, delta,
    accountant and privacy unit must equal the ones given (a restarted site cannot
    silently change its budget; ConfigError names the field that differs). The hash
    chain is checked on open (LedgerIntegrityError if broken).
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
        self.path = Path(path)
        self.site_id = site_id
        self.budget_epsilon = float(budget_epsilon)
        self.delta = float(delta)
        self.accountant = accountant
        self.privacy_unit = privacy_unit
        self._open_or_create()

    # -- setup -------------------------------------------------------------------------

    def _open_or_create(self) -> None:
        wanted = {
            "site_id": self.site_id,
            "budget_epsilon": self.budget_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "privacy_unit": self.privacy_unit,
        }
        with _connect(self.path) as connection:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("BEGIN IMMEDIATE")
            try:
                # One statement at a time: executescript() would COMMIT our transaction.
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        connection.execute(statement)
                header = _read_header(connection)
                if header is None:
                    genesis = header_hash(
                        site_id=self.site_id,
                        budget_epsilon=self.budget_epsilon,
                        delta=self.delta,
                        accountant=self.accountant,
                        privacy_unit=self.privacy_unit,
                    )
                    connection.execute(
                        "INSERT INTO ledger_header (id, format, site_id, budget_epsilon, "
                        "delta, accountant, privacy_unit, header_hash, entry_count, "
                        "head_hash) VALUES (1, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                        (
                            LEDGER_FORMAT,
                            self.site_id,
                            self.budget_epsilon,
                            self.delta,
                            self.accountant,
                            self.privacy_unit,
                            genesis,
                            genesis,
                        ),
                    )
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            # Hashes only here (cheap); `medfed ledger verify` also recomposes epsilons.
            _check_chain(connection, path=self.path, recompose=False).raise_if_broken()
            if header is not None:
                stored = {
                    "site_id": header.site_id,
                    "budget_epsilon": header.budget_epsilon,
                    "delta": header.delta,
                    "accountant": header.accountant,
                    "privacy_unit": header.privacy_unit,
                }
                for name, value in wanted.items():
                    if stored[name] != value:
                        raise ConfigError(
                            name,
                            f"ledger {self.path} was created with {name}={stored[name]!r}, "
                            f"not {value!r}; a site resumes its ledger, it cannot change it",
                        )

    # -- reading ---------------------------------------------------------------------------

    def entries(self) -> list[LedgerEntry]:
        with _connect(self.path) as connection:
            return _read_entries(connection)

    def history(self) -> list[Segment]:
        """Every DP-SGD segment this site has committed, in order."""
        return [segment for entry in self.entries() for segment in entry.segments]

    def spent(self) -> float:
        """Epsilon of the whole committed history (as composed when last committed)."""
        entries = self.entries()
        return entries[-1].epsilon_after if entries else 0.0

    def remaining(self) -> float:
        return max(0.0, self.budget_epsilon - self.spent())

    def head_hash(self) -> str:
        with _connect(self.path) as connection:
            header = _read_header(connection)
        if header is None:
            raise StateError(f"ledger {self.path} has no header")
        return header.head_hash

    def preview(self, round_number: int, segments: Sequence[Segment]) -> float:
        """Epsilon of the whole history if `segments` were added for `round_number`."""
        del round_number  # the round does not change the maths; kept for call symmetry
        return self._compose([*self.history(), *segments]).epsilon

    def exhausted(self, next_segments: Sequence[Segment]) -> bool:
        """True if training `next_segments` would take the site past its budget."""
        return self.preview(-1, next_segments) > self.budget_epsilon

    def status(self, next_segments: Sequence[Segment] | None = None) -> BudgetStatus:
        """What the site tells the coordinator: figures only, never data."""
        entries = self.entries()
        spent = entries[-1].epsilon_after if entries else 0.0
        if next_segments is None:
            exhausted = spent >= self.budget_epsilon
        else:
            exhausted = self.exhausted(next_segments)
        return BudgetStatus(
            site_id=self.site_id,
            budget_epsilon=self.budget_epsilon,
            delta=self.delta,
            spent_epsilon=spent,
            remaining_epsilon=max(0.0, self.budget_epsilon - spent),
            last_round=entries[-1].round if entries else None,
            exhausted=exhausted,
            privacy_unit=self.privacy_unit,
            ledger_entries=len(entries),
            ledger_head=entries[-1].entry_hash if entries else self.head_hash(),
        )

    # -- writing ---------------------------------------------------------------------------

    def reserve(
        self, round_number: int, segments: Sequence[Segment], *, now: datetime
    ) -> LedgerEntry:
        """Commit this round's spend BEFORE its update leaves the site (write-ahead).

        One transaction: checks the budget, appends the chained entry, moves the header's
        count and head hash. Raises BudgetExhausted (nothing written) if the composed
        epsilon would exceed the budget. Reserving a round twice returns the existing
        entry if the segments are identical, else raises StateError.
        """
        if isinstance(round_number, bool) or not isinstance(round_number, int):
            raise ConfigError("round", f"must be an integer, got {round_number!r}")
        if round_number < 0:
            raise ConfigError("round", f"must be >= 0, got {round_number}")
        segments = tuple(segments)
        if not segments or not all(isinstance(s, Segment) for s in segments):
            raise ConfigError("segments", "a reservation needs at least one Segment")
        if now.tzinfo is None or now.utcoffset() is None:
            raise ConfigError("now", "must be timezone-aware")
        segments_json = segments_to_json(segments)
        created_at = now.isoformat()
        with _connect(self.path) as connection:
            # IMMEDIATE takes the write lock first, so two agents on one file serialise.
            connection.execute("BEGIN IMMEDIATE")
            try:
                result = self._reserve_locked(
                    connection, round_number, segments, segments_json, created_at
                )
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
        return result

    def _reserve_locked(
        self,
        connection: sqlite3.Connection,
        round_number: int,
        segments: tuple[Segment, ...],
        segments_json: str,
        created_at: str,
    ) -> LedgerEntry:
        existing = connection.execute(
            f"SELECT {_ENTRY_COLUMNS} FROM ledger_entries WHERE round = ?",  # noqa: S608
            (round_number,),
        ).fetchone()
        if existing is not None:
            entry = _row_to_entry(existing)
            if entry.segments_json == segments_json:
                return entry
            raise StateError(
                f"round {round_number} is already reserved with different segments "
                f"({entry.segments_json} != {segments_json})"
            )
        header = _read_header(connection)
        if header is None:
            raise StateError(f"ledger {self.path} has no header")
        entries = _read_entries(connection)
        history = [segment for entry in entries for segment in entry.segments]
        report = self._compose([*history, *segments])
        if report.epsilon > self.budget_epsilon:
            spent = entries[-1].epsilon_after if entries else 0.0
            raise BudgetExhausted(
                f"site {self.site_id}: round {round_number} would bring epsilon to "
                f"{report.epsilon:.4f} > budget {self.budget_epsilon} (spent {spent:.4f}, "
                f"delta {self.delta})"
            )
        seq = len(entries) + 1
        entry = LedgerEntry(
            seq=seq,
            round=round_number,
            segments=segments,
            epsilon_after=report.epsilon,
            accountant_used=report.accountant,
            created_at=created_at,
            status=STATUS_COMMITTED,
            prev_hash=header.head_hash,
            entry_hash="",
        )
        digest = _computed_entry_hash(entry, segments_json)
        connection.execute(
            f"INSERT INTO ledger_entries ({_ENTRY_COLUMNS}) "  # noqa: S608 (constant)
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                seq,
                round_number,
                segments_json,
                report.epsilon,
                report.accountant,
                created_at,
                STATUS_COMMITTED,
                header.head_hash,
                digest,
            ),
        )
        connection.execute(
            "UPDATE ledger_header SET entry_count = ?, head_hash = ? WHERE id = 1",
            (seq, digest),
        )
        return dataclasses.replace(entry, entry_hash=digest)

    def _compose(self, segments: Sequence[Segment]) -> EpsilonReport:
        return account(segments, delta=self.delta, accountant=self.accountant)
