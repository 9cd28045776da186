"""The coordinator's SQL database: SQLite (default) or PostgreSQL, chosen by URL.

Callers write ONE set of portable SQL statements; this module is the whole dialect layer:

- placeholders: statements use ``?``; on PostgreSQL they become ``%s`` (psycopg), with
  any literal ``%`` escaped. Statements must not contain a literal ``?``;
- upserts: ``INSERT ... ON CONFLICT (key) DO UPDATE SET c = excluded.c`` is valid on both
  (SQLite >= 3.24), so nothing is translated;
- write transactions: SQLite's ``BEGIN IMMEDIATE`` takes the database write lock up
  front. The PostgreSQL equivalent used here is a transaction-scoped advisory lock taken
  as the first statement (``pg_advisory_xact_lock``): every writer of the federation's
  state queues on it, so read-check-write sequences (the next round number, a spend that
  may only grow) are serialised across coordinator replicas with no retry loop, as under
  SERIALIZABLE but without serialization failures to handle.

psycopg (3) is imported only when a ``postgresql://`` URL is used, so the SQLite default
needs nothing beyond the standard library.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import urlsplit, urlunsplit

from common.core.errors import ConfigError, DatabaseUnavailable

log = logging.getLogger("medfed.database")

SQLITE: Final = "sqlite"
POSTGRESQL: Final = "postgresql"

# Key of the advisory lock that plays the role of SQLite's database write lock
# (a fixed signed 64-bit value, "medfed" in ASCII followed by 0x0001).
WRITE_LOCK_KEY: Final = 0x6D65_6466_6564_0001

SQLITE_BUSY_TIMEOUT_SECONDS: Final = 30.0


@dataclass(frozen=True)
class DatabaseUrl:
    """A parsed database URL: `target` is a file path (SQLite) or a libpq URL."""

    dialect: str
    target: str

    def redacted(self) -> str:
        """The URL without its password (safe for logs and error messages)."""
        if self.dialect != POSTGRESQL:
            return self.target
        parts = urlsplit(self.target)
        netloc = parts.netloc
        if parts.password is not None:
            netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
        # libpq also takes the password as a query parameter (?password=...).
        query = "&".join(
            "password=***" if item.split("=", 1)[0].lower() == "password" else item
            for item in parts.query.split("&")
        ) if parts.query else parts.query
        return urlunsplit(parts._replace(netloc=netloc, query=query))


def parse_database_url(url: str) -> DatabaseUrl:
    """``sqlite:///PATH`` (or a bare path) or ``postgresql://...`` / ``postgres://...``."""
    if url.startswith("sqlite:///"):
        return DatabaseUrl(SQLITE, url[len("sqlite:///") :])
    if url.startswith(("postgresql://", "postgres://")):
        return DatabaseUrl(POSTGRESQL, url)
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise ConfigError(
            "database_url",
            f"unsupported scheme {scheme!r}: use sqlite:///PATH or postgresql://...",
        )
    if not url:
        raise ConfigError("database_url", "must not be empty")
    return DatabaseUrl(SQLITE, url)


class _DbApiCursor(Protocol):
    def execute(self, sql: str, parameters: Sequence[Any] = ..., /) -> Any: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...


class Statements:
    """Runs portable statements (``?`` placeholders) inside one transaction."""

    def __init__(self, cursor: _DbApiCursor, dialect: str) -> None:
        self._cursor = cursor
        self._dialect = dialect

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> Statements:
        self._cursor.execute(translate(sql, self._dialect), tuple(parameters))
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        row = self._cursor.fetchone()
        return None if row is None else tuple(row)

    def fetchall(self) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self._cursor.fetchall()]


def translate(sql: str, dialect: str) -> str:
    """Rewrite a portable statement for `dialect` (placeholders only; see module doc)."""
    if dialect == POSTGRESQL:
        return sql.replace("%", "%%").replace("?", "%s")
    return sql


CONNECT_TIMEOUT_SECONDS: Final = 10
RECONNECT_TIMEOUT_SECONDS: Final = 3
"""A reconnect is one short attempt: the engine backs off between attempts, and a
database that is down refuses at once (the timeout bounds a black-holed host)."""

# SQLSTATEs that mean "this connection is gone", whatever psycopg's flags say yet:
# class 08 (connection exception) and the server shutting down or not yet accepting.
_CONNECTION_LOST_STATES: Final = frozenset({"57P01", "57P02", "57P03"})


class Database:
    """One connection to the state database, shared by the coordinator's store and its
    federation budget view; thread-safe (one transaction at a time per process).

    PostgreSQL: before each transaction a liveness check (``SELECT 1``, one round trip)
    finds a connection a server restart or failover closed, and one reconnect replaces
    it. A connection lost for good (the reconnect failed) or lost during a transaction
    raises `DatabaseUnavailable`, which the round engine rides out; any other database
    error (a constraint, a full disk) is raised as it is."""

    def __init__(self, url: str) -> None:
        self.url = parse_database_url(url)
        self.dialect = self.url.dialect
        self._lock = threading.Lock()
        self._lost_at: float | None = None  # time.monotonic() the connection was lost
        self._psycopg: Any = None
        # Called after each reconnect (the coordinator counts them in a metric).
        self.on_reconnect: Callable[[], None] | None = None
        self._conn: Any = self._open()

    def _open(self) -> Any:
        if self.dialect == SQLITE:
            path = Path(self.url.target)
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(
                path,
                check_same_thread=False,
                isolation_level=None,  # transactions are explicit (BEGIN IMMEDIATE)
                timeout=SQLITE_BUSY_TIMEOUT_SECONDS,
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            return conn
        try:
            self._psycopg = psycopg = importlib.import_module("psycopg")
        except ImportError as exc:
            raise ConfigError(
                "database_url", "PostgreSQL needs the psycopg package (pip install psycopg)"
            ) from exc
        try:
            # autocommit: transactions are opened explicitly by `transaction()`.
            return psycopg.connect(
                self.url.target, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS
            )
        except psycopg.Error as exc:
            raise ConfigError(
                "database_url", f"cannot connect to {self.url.redacted()}: {exc}"
            ) from exc

    def _unavailable(self, exc: BaseException) -> DatabaseUnavailable:
        return DatabaseUnavailable(
            f"the state database {self.url.redacted()} is unreachable: "
            f"{' '.join(str(exc).split()) or type(exc).__name__}"
        )

    def _connection_lost(self, exc: BaseException) -> bool:
        """`exc` (raised by psycopg) means the connection is gone, not the statement."""
        psycopg = self._psycopg
        if psycopg is None or not isinstance(exc, psycopg.OperationalError):
            return False
        sqlstate = getattr(exc, "sqlstate", None) or ""
        return bool(
            self._conn is None or self._conn.closed or self._conn.broken
            or sqlstate.startswith("08") or sqlstate in _CONNECTION_LOST_STATES
        )

    def _alive(self) -> bool:
        """Pre-ping: one round trip on the current connection."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            return False
        try:
            conn.execute("SELECT 1")
        except self._psycopg.Error as exc:
            if self._connection_lost(exc):
                return False
            raise
        return True

    def _ensure_connected(self) -> None:
        """A live connection, reconnecting once if the current one was lost (caller
        holds the lock)."""
        if self._alive():
            return
        psycopg = self._psycopg
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None
        try:
            self._conn = psycopg.connect(
                self.url.target, autocommit=True, connect_timeout=RECONNECT_TIMEOUT_SECONDS
            )
        except psycopg.Error as exc:
            raise self._unavailable(exc) from None
        seconds, self._lost_at = time.monotonic() - self._lost_at, None
        log.warning("reconnected to the state database %s (connection lost for %.1f s)",
                    self.url.redacted(), seconds,
                    extra={"event": "database_reconnected", "lost_seconds": round(seconds, 3)})
        if self.on_reconnect is not None:
            self.on_reconnect()

    def ping(self) -> None:
        """Reconnect now if the connection was lost; `DatabaseUnavailable` while the
        database cannot be reached. SQLite (a local file) has nothing to reconnect."""
        if self.dialect == SQLITE:
            return
        with self._lock:
            self._ensure_connected()

    @contextmanager
    def transaction(self, *, write: bool = True) -> Iterator[Statements]:
        """One transaction; committed on success, rolled back on any exception."""
        with self._lock:
            if self.dialect == SQLITE:
                cursor = self._conn.cursor()
                cursor.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    yield Statements(cursor, self.dialect)
                except BaseException:
                    cursor.execute("ROLLBACK")
                    raise
                cursor.execute("COMMIT")
                return
            self._ensure_connected()
            try:
                with self._conn.transaction(), self._conn.cursor() as cursor:
                    if write:
                        cursor.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK_KEY,))
                    yield Statements(cursor, self.dialect)
            except self._psycopg.Error as exc:
                if self._connection_lost(exc):
                    if self._lost_at is None:
                        self._lost_at = time.monotonic()
                    # Lost before COMMIT: rolled back by the server; lost during
                    # COMMIT: either. The engine re-reads its state after reconnecting.
                    raise self._unavailable(exc) from exc
                raise

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
