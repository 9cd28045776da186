"""The coordinator's federation view of every site's privacy budget.

This is a VIEW for the operator and for site selection, fed by what sites report; each
site's own ledger (`common.privacy.ledger`) stays authoritative, and a site declines a
round its ledger refuses whatever this view says. The view also keeps each site's ledger
head hash and entry count: an external anchor that makes a rewritten site ledger visible.

Schema is plain SQL (TEXT / INTEGER / DOUBLE PRECISION, INSERT ... ON CONFLICT) so the
same statements run on PostgreSQL; only the parameter marker differs (`paramstyle`).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Protocol

from common.errors import ConfigError, StateError
from common.privacy.ledger import BudgetStatus

STATUS_ACTIVE: Final = "active"
STATUS_EXHAUSTED: Final = "exhausted"

_COLUMNS = (
    "site_id, budget_epsilon, delta, spent_epsilon, remaining_epsilon, last_round, "
    "status, privacy_unit, ledger_entries, ledger_head, updated_at"
)


class _Connection(Protocol):
    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Any: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class SiteBudget:
    """One row of the federation view."""

    site_id: str
    budget_epsilon: float
    delta: float
    spent_epsilon: float
    remaining_epsilon: float
    last_round: int | None
    status: str
    privacy_unit: str
    ledger_entries: int
    ledger_head: str
    updated_at: str


class FederationBudgetView:
    """Per-site budget, spent, delta, remaining, last round and status.

    `connect` returns a DB-API connection; `paramstyle` is ``"qmark"`` (sqlite3) or
    ``"format"`` (psycopg). Use `FederationBudgetView.sqlite(path)` for the default.
    """

    def __init__(self, connect: Callable[[], _Connection], *, paramstyle: str = "qmark") -> None:
        if paramstyle not in ("qmark", "format"):
            raise ConfigError("paramstyle", f"unsupported: {paramstyle!r}")
        self._connect = connect
        self._marker = "?" if paramstyle == "qmark" else "%s"
        self._run(
            "CREATE TABLE IF NOT EXISTS federation_site_budgets ("
            " site_id TEXT PRIMARY KEY,"
            " budget_epsilon DOUBLE PRECISION NOT NULL,"
            " delta DOUBLE PRECISION NOT NULL,"
            " spent_epsilon DOUBLE PRECISION NOT NULL,"
            " remaining_epsilon DOUBLE PRECISION NOT NULL,"
            " last_round INTEGER,"
            " status TEXT NOT NULL,"
            " privacy_unit TEXT NOT NULL,"
            " ledger_entries INTEGER NOT NULL,"
            " ledger_head TEXT NOT NULL,"
            " updated_at TEXT NOT NULL)",
            (),
        )

    @classmethod
    def sqlite(cls, path: str | Path) -> FederationBudgetView:
        def connect() -> _Connection:
            connection = sqlite3.connect(path)
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=FULL")
            return connection

        return cls(connect, paramstyle="qmark")

    def _sql(self, statement: str) -> str:
        return statement.replace("?", self._marker)

    def _run(self, statement: str, parameters: Sequence[Any]) -> list[Any]:
        connection = self._connect()
        try:
            cursor = connection.execute(self._sql(statement), parameters)
            rows = list(cursor.fetchall()) if cursor.description else []
            connection.commit()
            return rows
        except BaseException:
            connection.rollback()
            raise
        finally:
            connection.close()

    def update_site(self, site_id: str, status: BudgetStatus, *, now: datetime) -> SiteBudget:
        """Record what `site_id` reported. The spend of a site never goes down: a report
        with less spent, an earlier round or a shorter ledger than already recorded is
        refused (StateError), since a site's ledger is append-only."""
        if site_id != status.site_id:
            raise ConfigError("site_id", f"report is for {status.site_id!r}, not {site_id!r}")
        for name in ("budget_epsilon", "delta", "spent_epsilon", "remaining_epsilon"):
            value = getattr(status, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(name, f"must be finite and >= 0, got {value!r}")
        previous = self.get(site_id)
        if previous is not None:
            if status.spent_epsilon < previous.spent_epsilon:
                raise StateError(
                    f"site {site_id} reports spent {status.spent_epsilon} < recorded "
                    f"{previous.spent_epsilon}: a ledger cannot shrink"
                )
            if status.ledger_entries < previous.ledger_entries:
                raise StateError(
                    f"site {site_id} reports {status.ledger_entries} ledger entries < "
                    f"recorded {previous.ledger_entries}"
                )
        row = SiteBudget(
            site_id=site_id,
            budget_epsilon=float(status.budget_epsilon),
            delta=float(status.delta),
            spent_epsilon=float(status.spent_epsilon),
            remaining_epsilon=float(status.remaining_epsilon),
            last_round=status.last_round,
            status=STATUS_EXHAUSTED if status.exhausted else STATUS_ACTIVE,
            privacy_unit=status.privacy_unit,
            ledger_entries=int(status.ledger_entries),
            ledger_head=status.ledger_head,
            updated_at=now.isoformat(),
        )
        self._run(
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

    def get(self, site_id: str) -> SiteBudget | None:
        rows = self._run(
            f"SELECT {_COLUMNS} FROM federation_site_budgets WHERE site_id = ?",  # noqa: S608
            (site_id,),
        )
        return _to_site_budget(rows[0]) if rows else None

    def snapshot(self) -> list[SiteBudget]:
        """Every site's row, sorted by site id (for `medfed` status pages and metrics)."""
        rows = self._run(
            f"SELECT {_COLUMNS} FROM federation_site_budgets ORDER BY site_id",  # noqa: S608
            (),
        )
        return [_to_site_budget(row) for row in rows]

    def eligible_sites(self, candidates: Iterable[str], *, min_remaining: float) -> list[str]:
        """Candidates (order kept) with a reported budget that is not exhausted and has at
        least `min_remaining` epsilon left. A site that never reported is not selected:
        the coordinator only opens rounds for sites that report budget left."""
        if not (math.isfinite(min_remaining) and min_remaining >= 0):
            raise ConfigError("min_remaining", f"must be finite and >= 0, got {min_remaining}")
        by_site = {row.site_id: row for row in self.snapshot()}
        chosen = []
        for site_id in candidates:
            row = by_site.get(site_id)
            if row is None or row.status == STATUS_EXHAUSTED:
                continue
            if row.remaining_epsilon >= min_remaining and row.remaining_epsilon > 0:
                chosen.append(site_id)
        return chosen


def _to_site_budget(row: Sequence[Any]) -> SiteBudget:
    return SiteBudget(
        site_id=str(row[0]),
        budget_epsilon=float(row[1]),
        delta=float(row[2]),
        spent_epsilon=float(row[3]),
        remaining_epsilon=float(row[4]),
        last_round=None if row[5] is None else int(row[5]),
        status=str(row[6]),
        privacy_unit=str(row[7]),
        ledger_entries=int(row[8]),
        ledger_head=str(row[9]),
        updated_at=str(row[10]),
    )
