"""What the coordinator must remember across a crash: rounds, checkpoints, enrolment.

SQLite by default (one file under the state folder, WAL, synchronous=FULL); PostgreSQL
when `database_url` is ``postgresql://...`` (a highly available coordinator). The SQL is
written once, portably; `common.core.sqldb` holds the few dialect differences.

A round is written as ``in_flight`` before any site hears of it, and ``unmasked`` just
before its sum is computed in the clear (the intent, written before Unmask closes, so
no crash can fall between a sum existing and the record of it). After a crash the next
start marks either ``abandoned`` and says which ones may have been unmasked: the
coordinator may have seen their sum, although no model was built from it. Numbering goes
on from the largest number used (`recorded_next_round`), so a site can never confuse two
rounds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.core.errors import ValidationError
from common.core.parsing import parse_json
from common.core.sqldb import Database

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS rounds (
        round_number BIGINT PRIMARY KEY,
        status TEXT NOT NULL,
        started_at DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION,
        participants TEXT NOT NULL,
        survivors TEXT,
        dropped TEXT,
        detail TEXT,
        metrics TEXT)""",
    """CREATE TABLE IF NOT EXISTS checkpoints (
        round_number BIGINT PRIMARY KEY,
        path TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS sites (
        site_id TEXT PRIMARY KEY,
        enrolled_at DOUBLE PRECISION NOT NULL,
        last_seen DOUBLE PRECISION NOT NULL,
        cert_serial TEXT NOT NULL,
        agent_version TEXT NOT NULL,
        device TEXT NOT NULL)""",
)


ROUND_WINDOW = 1000
"""How many rounds past the coordinator's own record one site's ledger report may move
the numbering (`coordinator.selection.round_ceiling`); a stored round further than this
from its predecessor is a jump (`recorded_next_round`)."""
ROUND_FLOOR_KEY = "round_floor"
"""meta key of the latest round begun more than ROUND_WINDOW past the record (a jump
corroborated by enough sites): the record never goes back below it."""


def recorded_next_round(numbers: Iterable[int], *, floor: int, window: int) -> int:
    """The coordinator's own record of round numbers: after the last round reached from
    round 0 in steps of at most `window`, or through `floor` (a recorded, corroborated
    jump). A stored round beyond a larger step was numbered after one site's ledger
    report alone, before such reports were bounded (a lie: 2^53 - 2 left no next
    number); numbering resumes after the last round before it (the numbers above it
    stay used). `numbers` ascending."""
    last = 0
    for number in numbers:
        if number <= floor or number - last <= window:
            last = max(last, number)
        else:
            break
    return max(last, floor) + 1


EVALUATION_EDGES_KEY = "evaluation_edges"
"""meta key of the bucket edges the next round's DP evaluation announces (JSON list)."""


@dataclass(frozen=True)
class RoundRecord:
    round_number: int
    status: str
    started_at: float
    finished_at: float | None
    participants: tuple[str, ...]
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    detail: str
    metrics: dict[str, Any]


@dataclass(frozen=True)
class AbandonedRound:
    round_number: int
    unmasked: bool  # its sum had been unmasked before the crash


@dataclass(frozen=True)
class Checkpoint:
    round_number: int
    path: Path
    sha256: str


class CoordinatorStore:
    """Thread-safe access to the coordinator's state database."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.database = Database(database_url)
        self._tx = self.database.transaction
        # Completed rounds, counted once and then kept by finish_round: the engine asks
        # several times a round, and COUNT(*) scans the whole table (55 ms a call at
        # 200,000 rounds in the soak). This process is the table's only writer.
        self._completed: int | None = None
        # The next round number of the record (`recorded_next_round`): computed once from
        # the whole table, then kept by begin_round.
        self._next: int | None = None
        with self._tx() as cur:
            for statement in SCHEMA:
                cur.execute(statement)

    @property
    def dialect(self) -> str:
        return self.database.dialect

    def close(self) -> None:
        self.database.close()

    # ------------------------------------------------------------------ meta
    def get_meta(self, key: str) -> str | None:
        with self._tx(write=False) as cur:
            row = cur.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    # ---------------------------------------------------------------- rounds
    def abandon_in_flight(self, *, now: float) -> list[AbandonedRound]:
        """Mark rounds a crash left open as abandoned; returns them."""
        with self._tx() as cur:
            rows = cur.execute(
                "SELECT round_number, status FROM rounds "
                "WHERE status IN ('in_flight', 'unmasked') ORDER BY round_number"
            ).fetchall()
            cur.execute(
                "UPDATE rounds SET status = 'abandoned', finished_at = ?, detail = "
                "'coordinator restarted after its sum was or may have been unmasked' "
                "WHERE status = 'unmasked'",
                (now,),
            )
            cur.execute(
                "UPDATE rounds SET status = 'abandoned', finished_at = ?, "
                "detail = 'coordinator restarted' WHERE status = 'in_flight'",
                (now,),
            )
        return [AbandonedRound(int(r[0]), str(r[1]) == "unmasked") for r in rows]

    def mark_unmasked(self, round_number: int) -> None:
        """The round's sum is about to be computed in the clear (written before Unmask
        closes, so a restart never claims a round's sum was not unmasked when it was)."""
        with self._tx() as cur:
            cur.execute(
                "UPDATE rounds SET status = 'unmasked' WHERE round_number = ? "
                "AND status = 'in_flight'",
                (round_number,),
            )

    def next_round_number(self) -> int:
        """The next round number by the coordinator's own record (`recorded_next_round`):
        normally after the largest number used; after a jump that an old lie caused,
        after the last round before it."""
        if self._next is None:
            with self._tx(write=False) as cur:
                rows = cur.execute(
                    "SELECT round_number FROM rounds ORDER BY round_number").fetchall()
                floor = cur.execute(
                    "SELECT value FROM meta WHERE key = ?", (ROUND_FLOOR_KEY,)).fetchone()
            self._next = recorded_next_round(
                (int(r[0]) for r in rows), floor=0 if floor is None else int(floor[0]),
                window=ROUND_WINDOW)
        return self._next

    def begin_round(self, round_number: int, participants: Sequence[str], *, now: float) -> None:
        """Record a round as in flight; one begun more than ROUND_WINDOW past the record
        (a corroborated jump) also becomes the record's floor, so a restart keeps it."""
        recorded = self.next_round_number()
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO rounds (round_number, status, started_at, participants) "
                "VALUES (?, 'in_flight', ?, ?)",
                (round_number, now, json.dumps(sorted(participants))),
            )
            if round_number - (recorded - 1) > ROUND_WINDOW:
                cur.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (ROUND_FLOOR_KEY, str(round_number)),
                )
        self._next = max(recorded, round_number + 1)

    def finish_round(
        self,
        round_number: int,
        *,
        status: str,
        now: float,
        survivors: Sequence[str] = (),
        dropped: Sequence[str] = (),
        detail: str = "",
        metrics: dict[str, Any] | None = None,
        checkpoint: Checkpoint | None = None,
        evaluation_edges: Sequence[float] | None = None,
    ) -> None:
        """Close a round; a checkpoint, and the evaluation edges the round chose for the
        next (`evaluation_edges`), are recorded in the same transaction."""
        with self._tx() as cur:
            row = cur.execute(
                "SELECT status FROM rounds WHERE round_number = ?", (round_number,)
            ).fetchone()
            was_completed = row is not None and str(row[0]) == "completed"
            cur.execute(
                "UPDATE rounds SET status = ?, finished_at = ?, survivors = ?, dropped = ?, "
                "detail = ?, metrics = ? WHERE round_number = ?",
                (
                    status,
                    now,
                    json.dumps(sorted(survivors)),
                    json.dumps(sorted(dropped)),
                    detail,
                    json.dumps(metrics or {}),
                    round_number,
                ),
            )
            if checkpoint is not None:
                cur.execute(
                    "INSERT INTO checkpoints (round_number, path, sha256, created_at) "
                    "VALUES (?, ?, ?, ?)",
                    (checkpoint.round_number, str(checkpoint.path), checkpoint.sha256, now),
                )
            if evaluation_edges is not None:
                cur.execute(
                    "INSERT INTO meta (key, value) VALUES (?, ?) "
                    "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (EVALUATION_EDGES_KEY, json.dumps([float(v) for v in evaluation_edges])),
                )
        if row is not None and self._completed is not None:
            self._completed += int(status == "completed") - int(was_completed)

    def evaluation_edges(self) -> tuple[float, ...]:
        """The evaluation edges the last completed round chose for the next; () when
        none (or unreadable: the default layout is always safe to count with)."""
        raw = self.get_meta(EVALUATION_EDGES_KEY)
        if raw is None:
            return ()
        try:
            values = parse_json(raw)
            return tuple(float(v) for v in values)
        except (ValidationError, ValueError, TypeError):
            return ()

    def rounds(self) -> list[RoundRecord]:
        with self._tx(write=False) as cur:
            rows = cur.execute(
                "SELECT round_number, status, started_at, finished_at, participants, survivors, "
                "dropped, detail, metrics FROM rounds ORDER BY round_number"
            ).fetchall()
        return [
            RoundRecord(
                round_number=int(r[0]),
                status=str(r[1]),
                started_at=float(r[2]),
                finished_at=None if r[3] is None else float(r[3]),
                participants=tuple(parse_json(r[4])),
                survivors=tuple(parse_json(r[5] or "[]")),
                dropped=tuple(parse_json(r[6] or "[]")),
                detail=str(r[7] or ""),
                metrics=parse_json(r[8] or "{}"),
            )
            for r in rows
        ]

    def round_status(self, round_number: int) -> str | None:
        # Round numbers come off the wire as uint64; SQL BIGINTs are signed 64-bit,
        # and no round that large was ever stored.
        if not 0 <= round_number < 1 << 63:
            return None
        with self._tx(write=False) as cur:
            row = cur.execute(
                "SELECT status FROM rounds WHERE round_number = ?", (round_number,)
            ).fetchone()
        return None if row is None else str(row[0])

    def completed_rounds(self) -> int:
        if self._completed is None:
            with self._tx(write=False) as cur:
                row = cur.execute(
                    "SELECT COUNT(*) FROM rounds WHERE status = 'completed'"
                ).fetchone()
            self._completed = 0 if row is None else int(row[0])
        return self._completed

    def latest_checkpoint(self) -> Checkpoint | None:
        with self._tx(write=False) as cur:
            row = cur.execute(
                "SELECT round_number, path, sha256 FROM checkpoints "
                "ORDER BY round_number DESC LIMIT 1"
            ).fetchone()
        return None if row is None else Checkpoint(int(row[0]), Path(row[1]), str(row[2]))

    # ----------------------------------------------------------------- sites
    def record_site(
        self, site_id: str, *, cert_serial: str, agent_version: str, device: str, now: float
    ) -> None:
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO sites (site_id, enrolled_at, last_seen, cert_serial, agent_version, "
                "device) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (site_id) DO UPDATE SET "
                "last_seen = excluded.last_seen, cert_serial = excluded.cert_serial, "
                "agent_version = excluded.agent_version, device = excluded.device",
                (site_id, now, now, cert_serial, agent_version[:64], device[:64]),
            )

    def enrolled_sites(self) -> list[str]:
        with self._tx(write=False) as cur:
            rows = cur.execute("SELECT site_id FROM sites ORDER BY site_id").fetchall()
        return [str(r[0]) for r in rows]
