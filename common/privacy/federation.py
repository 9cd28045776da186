"""The coordinator's federation view of every site's privacy budget.

This is a VIEW for the operator and for site selection, fed by what sites report; each
site's own ledger (`common.privacy.ledger`) stays authoritative, and a site declines a
round its ledger refuses whatever this view says. The view also keeps each site's ledger
head hash and entry count: an external anchor that makes a rewritten site ledger visible.

It lives in the coordinator's state database (`common.core.sqldb`: SQLite by default,
PostgreSQL by URL); the SQL is written once (TEXT / BIGINT / DOUBLE PRECISION,
INSERT ... ON CONFLICT) and runs on both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from common.core.errors import ConfigError, StateError
from common.core.sqldb import Database, Statements
from common.privacy.budget import STATUS_EXHAUSTED, BudgetReport

MIN_REMAINING_EPSILON: Final = 1e-6
"""A site with this little epsilon left (or less) is treated as exhausted: no useful
round fits in it, and float rounding in the accountant is far larger than this."""

_COLUMNS = (
    "site_id, budget_epsilon, delta, spent_epsilon, remaining_epsilon, last_round, "
    "status, privacy_unit, ledger_entries, ledger_head, updated_at"
)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS federation_site_budgets ("
    " site_id TEXT PRIMARY KEY,"
    " budget_epsilon DOUBLE PRECISION NOT NULL,"
    " delta DOUBLE PRECISION NOT NULL,"
    " spent_epsilon DOUBLE PRECISION NOT NULL,"
    " remaining_epsilon DOUBLE PRECISION NOT NULL,"
    " last_round BIGINT,"
    " status TEXT NOT NULL,"
    " privacy_unit TEXT NOT NULL,"
    " ledger_entries BIGINT NOT NULL,"
    " ledger_head TEXT NOT NULL,"
    " updated_at TEXT NOT NULL)"
)


class FederationBudgetView:
    """Per-site budget, spent, delta, remaining, last round and status.

    Give it the coordinator's `Database` (shared with `CoordinatorStore`), or use
    `FederationBudgetView.open(url)` / `.sqlite(path)` for a standalone view.
    """

    def __init__(self, database: Database) -> None:
        self.database = database
        with database.transaction() as cur:
            cur.execute(_SCHEMA)

    @classmethod
    def open(cls, database_url: str) -> FederationBudgetView:
        return cls(Database(database_url))

    @classmethod
    def sqlite(cls, path: str | Path) -> FederationBudgetView:
        return cls(Database(f"sqlite:///{path}"))

    def close(self) -> None:
        self.database.close()

    def update_site(self, site_id: str, status: BudgetReport, *, now: datetime) -> BudgetReport:
        """Record what `site_id` reported. The spend of a site never goes down: a report
        with less spent or a shorter ledger than already recorded is refused (StateError,
        nothing written), since a site's ledger is append-only.

        Read, check and write happen in one write transaction, so two coordinator
        replicas cannot interleave between the check and the write."""
        if site_id != status.site_id:
            raise ConfigError("site_id", f"report is for {status.site_id!r}, not {site_id!r}")
        for name in ("budget_epsilon", "delta", "spent_epsilon"):
            value = getattr(status, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(name, f"must be finite and >= 0, got {value!r}")
        row = dataclasses.replace(
            status,
            budget_epsilon=float(status.budget_epsilon),
            delta=float(status.delta),
            spent_epsilon=float(status.spent_epsilon),
            exhausted=status.out_of_budget,
            privacy_unit=status.privacy_unit or "record",
            ledger_entries=int(status.ledger_entries),
            updated_at=now.isoformat(),
        )
        with self.database.transaction() as cur:
            previous = _select_one(cur, site_id)
            if previous is not None:
                if row.spent_epsilon < previous.spent_epsilon:
                    raise StateError(
                        f"site {site_id} reports spent {row.spent_epsilon} < recorded "
                        f"{previous.spent_epsilon}: a ledger cannot shrink"
                    )
                if row.ledger_entries < previous.ledger_entries:
                    raise StateError(
                        f"site {site_id} reports {row.ledger_entries} ledger entries < "
                        f"recorded {previous.ledger_entries}"
                    )
            cur.execute(
                f"INSERT INTO federation_site_budgets ({_COLUMNS}) "  # noqa: S608 (constant)
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (site_id) DO UPDATE SET "
                "budget_epsilon = excluded.budget_epsilon, delta = excluded.delta, "
                "spent_epsilon = excluded.spent_epsilon, "
                "remaining_epsilon = excluded.remaining_epsilon, "
                "last_round = excluded.last_round, status = excluded.status, "
                "privacy_unit = excluded.privacy_unit, "
                "ledger_entries = excluded.ledger_entries, ledger_head = excluded.ledger_head, "
                "updated_at = excluded.updated_at",
                (
                    row.site_id,
                    row.budget_epsilon,
                    row.delta,
                    row.spent_epsilon,
                    row.remaining_epsilon,
                    row.last_round,
                    row.status,
                    row.privacy_unit,
                    row.ledger_entries,
                    row.ledger_head,
                    row.updated_at,
                ),
            )
        return row

    def get(self, site_id: str) -> BudgetReport | None:
        with self.database.transaction(write=False) as cur:
            return _select_one(cur, site_id)

    def snapshot(self) -> list[BudgetReport]:
        """Every site's row, sorted by site id (for `medfed` status pages and metrics)."""
        with self.database.transaction(write=False) as cur:
            rows = cur.execute(
                f"SELECT {_COLUMNS} FROM federation_site_budgets ORDER BY site_id"  # noqa: S608
            ).fetchall()
        return [_to_site_budget(row) for row in rows]


def has_budget_left(row: BudgetReport, *, min_remaining: float = MIN_REMAINING_EPSILON) -> bool:
    """The selection rule: not reported exhausted, and more than `min_remaining` left."""
    _check_min_remaining(min_remaining)
    if row.out_of_budget:
        return False
    return row.remaining_epsilon > min_remaining and row.remaining_epsilon > 0


def _check_min_remaining(min_remaining: float) -> None:
    if not (math.isfinite(min_remaining) and min_remaining >= 0):
        raise ConfigError("min_remaining", f"must be finite and >= 0, got {min_remaining}")


def _select_one(cur: Statements, site_id: str) -> BudgetReport | None:
    row = cur.execute(
        f"SELECT {_COLUMNS} FROM federation_site_budgets WHERE site_id = ?",  # noqa: S608
        (site_id,),
    ).fetchone()
    return None if row is None else _to_site_budget(row)


def _to_site_budget(row: Sequence[Any]) -> BudgetReport:
    # row[4] (remaining_epsilon) is derived: stored for SQL readers of the table.
    return BudgetReport(
        site_id=str(row[0]),
        budget_epsilon=float(row[1]),
        delta=float(row[2]),
        spent_epsilon=float(row[3]),
        last_round=None if row[5] is None else int(row[5]),
        exhausted=str(row[6]) == STATUS_EXHAUSTED,
        privacy_unit=str(row[7]),
        ledger_entries=int(row[8]),
        ledger_head=str(row[9]),
        updated_at=str(row[10]),
    )
