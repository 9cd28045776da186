"""The coordinator's state database on SQLite and on a real PostgreSQL server: the same
store and federation-view code, the same expectations (`database_url` runs each test
on both)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from common.core.errors import ConfigError, DatabaseUnavailable, StateError
from common.core.sqldb import POSTGRESQL, SQLITE, Database, parse_database_url, translate
from common.privacy.budget import BudgetReport
from common.privacy.federation import FederationBudgetView, has_budget_left
from coordinator.store import AbandonedRound, Checkpoint, CoordinatorStore

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def report(site_id: str, *, spent: float, budget: float = 4.0, entries: int = 1) -> BudgetReport:
    return BudgetReport(
        site_id=site_id,
        budget_epsilon=budget,
        delta=1e-5,
        spent_epsilon=spent,
        last_round=entries if entries else None,
        exhausted=spent >= budget,
        ledger_entries=entries,
        ledger_head=f"{entries:064x}",
    )


# ------------------------------------------------------------------------ URLs


def test_database_urls_choose_the_dialect() -> None:
    assert parse_database_url("sqlite:////var/medfed/c.db").target == "/var/medfed/c.db"
    assert parse_database_url("state/c.db").dialect == SQLITE
    pg = parse_database_url("postgresql://medfed:s3cret@db.example:5432/medfed")
    assert pg.dialect == POSTGRESQL
    assert "s3cret" not in pg.redacted() and "***" in pg.redacted()
    assert parse_database_url("postgres://db/medfed").dialect == POSTGRESQL
    with pytest.raises(ConfigError) as info:
        parse_database_url("mysql://db/medfed")
    assert info.value.field == "database_url"
    # One statement text for both: only the placeholders change (and % is escaped).
    sql = "SELECT a FROM t WHERE b = ? AND c LIKE 'x%'"
    assert translate(sql, SQLITE) == sql
    assert translate(sql, POSTGRESQL) == "SELECT a FROM t WHERE b = %s AND c LIKE 'x%%'"


def test_unreachable_postgresql_is_a_config_error_without_the_password() -> None:
    pytest.importorskip("psycopg")
    port = _closed_port()
    with pytest.raises(ConfigError) as info:
        Database(f"postgresql://medfed:hunter2@127.0.0.1:{port}/medfed?connect_timeout=2")
    assert info.value.field == "database_url"
    assert "hunter2" not in str(info.value)


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ----------------------------------------------------------------------- store


def test_store_rounds_checkpoints_and_sites(database_url: str, tmp_path: Path) -> None:
    store = CoordinatorStore(database_url)
    assert store.next_round_number() == 1
    store.begin_round(1, ["b", "a"], now=10.0)
    ckpt = Checkpoint(1, tmp_path / "round-000001.mfm", "ab" * 32)
    store.finish_round(
        1, status="completed", now=11.5, survivors=["b", "a"], dropped=["c"],
        metrics={"auc": 0.75}, checkpoint=ckpt,
    )
    store.begin_round(2, ["a", "b"], now=12.0)
    store.finish_round(2, status="aborted", now=12.5, detail="too few survivors")
    store.begin_round(3, ["a", "b"], now=13.0)
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        store.begin_round(3, ["a"], now=13.1)  # a round number is never reused
    store.record_site("a", cert_serial="1f", agent_version="v1", device="cpu", now=1.0)
    store.record_site("b", cert_serial="2e", agent_version="v1", device="cuda:0", now=2.0)
    store.record_site("a", cert_serial="3d", agent_version="v2", device="cpu", now=3.0)
    store.set_meta("federation", "demo")
    store.set_meta("federation", "prod")
    store.close()

    # A new connection (a restarted coordinator) sees exactly what was committed.
    reopened = CoordinatorStore(database_url)
    assert reopened.get_meta("federation") == "prod" and reopened.get_meta("nope") is None
    assert reopened.enrolled_sites() == ["a", "b"]
    assert reopened.completed_rounds() == 1
    assert reopened.latest_checkpoint() == ckpt
    assert reopened.round_status(2) == "aborted" and reopened.round_status(99) is None
    assert reopened.round_status(2**64 - 1) is None  # uint64 from the wire: no error
    assert reopened.abandon_in_flight(now=20.0) == [AbandonedRound(3, unmasked=False)]
    assert reopened.abandon_in_flight(now=21.0) == []
    assert reopened.next_round_number() == 4
    # A round whose sum was unmasked before the crash is reported as such.
    reopened.begin_round(4, ["a", "b"], now=22.0)
    reopened.mark_unmasked(4)
    assert reopened.round_status(4) == "unmasked"
    assert reopened.abandon_in_flight(now=23.0) == [AbandonedRound(4, unmasked=True)]
    rounds = reopened.rounds()
    assert [(r.round_number, r.status) for r in rounds] == [
        (1, "completed"), (2, "aborted"), (3, "abandoned"), (4, "abandoned")
    ]
    assert rounds[3].detail == "coordinator restarted after its sum was or may have been unmasked"
    first, _, third, _ = rounds
    assert first.participants == ("a", "b") and first.survivors == ("a", "b")
    assert first.dropped == ("c",) and first.metrics == {"auc": 0.75}
    assert first.started_at == 10.0 and first.finished_at == 11.5
    assert third.detail == "coordinator restarted" and third.finished_at == 20.0
    reopened.close()


def test_failed_transaction_leaves_nothing_behind(database_url: str) -> None:
    store = CoordinatorStore(database_url)
    store.begin_round(1, ["a"], now=1.0)
    store.finish_round(1, status="completed", now=2.0,
                       checkpoint=Checkpoint(1, Path("/x/1.mfm"), "00" * 32))
    store.begin_round(2, ["a"], now=3.0)
    # The checkpoint insert fails (round 1 already has one): the status update made in
    # the same transaction must be rolled back with it.
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        store.finish_round(2, status="completed", now=4.0,
                           checkpoint=Checkpoint(1, Path("/x/2.mfm"), "11" * 32))
    assert store.round_status(2) == "in_flight"
    assert store.completed_rounds() == 1
    # ...and the connection is usable afterwards.
    store.finish_round(2, status="aborted", now=5.0)
    assert store.round_status(2) == "aborted"
    store.close()


def test_completed_count_kept_by_the_store_matches_the_table(database_url: str) -> None:
    """The store counts completed rounds once and keeps the count through finish_round
    (the engine asks several times a round); a second store on the same database, which
    counts afresh, must agree after every kind of close, a re-close and a failed one."""
    store = CoordinatorStore(database_url)
    assert store.completed_rounds() == 0  # the count is now kept, not re-read

    def agrees() -> int:
        fresh = CoordinatorStore(database_url)
        try:
            assert fresh.completed_rounds() == store.completed_rounds()
            return fresh.completed_rounds()
        finally:
            fresh.close()

    store.begin_round(1, ["a"], now=1.0)
    store.finish_round(1, status="completed", now=2.0,
                       checkpoint=Checkpoint(1, Path("/x/1.mfm"), "00" * 32))
    assert agrees() == 1
    store.begin_round(2, ["a"], now=3.0)
    store.finish_round(2, status="aborted", now=4.0)
    assert agrees() == 1
    store.finish_round(1, status="completed", now=5.0)  # closed twice: counted once
    assert agrees() == 1
    store.begin_round(3, ["a"], now=6.0)
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
        store.finish_round(3, status="completed", now=7.0,
                           checkpoint=Checkpoint(1, Path("/x/3.mfm"), "11" * 32))
    assert agrees() == 1
    store.finish_round(3, status="completed", now=8.0)
    store.finish_round(99, status="completed", now=9.0)  # no such round: nothing counted
    assert agrees() == 2
    store.close()


# ------------------------------------------------------------- federation view


def test_federation_view_in_the_state_database(database_url: str) -> None:
    store = CoordinatorStore(database_url)
    view = FederationBudgetView(store.database)  # shares the store's connection
    view.update_site("a", report("a", spent=1.0), now=T0)
    view.update_site("b", report("b", spent=4.0), now=T0)
    view.update_site("c", report("c", spent=3.9999995), now=T0)
    view.update_site("a", report("a", spent=2.5, entries=2), now=T0)
    with pytest.raises(StateError, match="cannot shrink"):
        view.update_site("a", report("a", spent=2.0, entries=3), now=T0)
    with pytest.raises(StateError, match="ledger entries"):
        view.update_site("a", report("a", spent=3.0, entries=1), now=T0)
    store.close()

    reopened = FederationBudgetView.open(database_url)
    rows = {row.site_id: row for row in reopened.snapshot()}
    assert sorted(rows) == ["a", "b", "c"]
    assert rows["a"].spent_epsilon == 2.5 and rows["a"].ledger_entries == 2
    assert rows["a"].ledger_head == f"{2:064x}" and rows["a"].last_round == 2
    assert rows["b"].status == "exhausted" and rows["a"].status == "active"
    # c has 5e-7 left: below MIN_REMAINING_EPSILON, so it counts as exhausted.
    assert [s for s in ("c", "b", "a") if has_budget_left(rows[s])] == ["a"]
    assert [s for s in ("c", "a") if has_budget_left(rows[s], min_remaining=0.0)] == ["c", "a"]
    reopened.close()


def test_concurrent_reports_never_lower_the_recorded_spend(database_url: str) -> None:
    """Two coordinator replicas (two connections) race to record reports of one site:
    the read-check-write is one write transaction, so the view ends at the highest
    spend and never records a lower one after a higher one."""
    views = [FederationBudgetView.open(database_url) for _ in range(2)]
    refused: list[float] = []
    lock = threading.Lock()

    def report_all(view: FederationBudgetView, spends: list[float]) -> None:
        for spent in spends:
            try:
                view.update_site(
                    "a", report("a", spent=spent, budget=100.0, entries=int(spent)), now=T0
                )
            except StateError:
                with lock:
                    refused.append(spent)

    spends = [float(n) for n in range(1, 41)]
    threads = [
        threading.Thread(target=report_all, args=(views[0], spends[0::2])),
        threading.Thread(target=report_all, args=(views[1], spends[1::2])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    row = views[0].get("a")
    assert row is not None and row.spent_epsilon == 40.0 and row.ledger_entries == 40
    # Whatever interleaving happened, every refusal was of a report below one recorded.
    assert all(spent < 40.0 for spent in refused)
    for view in views:
        view.close()


def test_postgresql_writers_queue_on_the_write_lock(postgres_url: str) -> None:
    """PostgreSQL's stand-in for BEGIN IMMEDIATE: a second writer waits until the first
    commits, then reads what the first wrote (no lost update, no retry)."""
    first, second, observer = (Database(postgres_url) for _ in range(3))
    with first.transaction() as cur:
        cur.execute("CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)")
        cur.execute("INSERT INTO counter (id, n) VALUES (1, 0)")
    seen: list[int] = []

    def increment() -> None:
        with second.transaction() as cur:
            row = cur.execute("SELECT n FROM counter WHERE id = ?", (1,)).fetchone()
            assert row is not None
            seen.append(int(row[0]))
            cur.execute("UPDATE counter SET n = ? WHERE id = ?", (int(row[0]) + 1, 1))

    with first.transaction() as cur:
        row = cur.execute("SELECT n FROM counter WHERE id = ?", (1,)).fetchone()
        assert row == (0,)
        worker = threading.Thread(target=increment)
        worker.start()
        # Wait (bounded) until the second writer is blocked on the advisory lock.
        for _ in range(2000):
            with observer.transaction(write=False) as obs:
                waiting = obs.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone()
            if waiting == (1,):
                break
        else:
            pytest.fail("second writer never queued on the write lock")
        assert seen == []  # it has not read anything yet
        cur.execute("UPDATE counter SET n = ? WHERE id = ?", (int(row[0]) + 1, 1))
    worker.join(30)
    assert seen == [1]  # it read the first writer's committed value
    with observer.transaction(write=False) as obs:
        assert obs.execute("SELECT n FROM counter").fetchone() == (2,)
    for database in (first, second, observer):
        database.close()


def test_postgresql_connection_is_reopened_after_it_breaks(postgres_url: str) -> None:
    """A failover or server restart kills the connection: the next transaction's liveness
    check finds it dead and reconnects first, so that transaction runs (and is counted)."""
    import psycopg

    store = CoordinatorStore(postgres_url)
    reconnects: list[int] = []
    store.database.on_reconnect = lambda: reconnects.append(1)
    store.set_meta("k", "v1")

    def backend_pid() -> int:
        with store.database.transaction(write=False) as cur:
            row = cur.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        return int(row[0])

    pid = backend_pid()
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert store.get_meta("k") == "v1"  # on a new connection, at the first try
    assert backend_pid() != pid
    assert reconnects == [1]
    store.close()


def test_postgresql_connection_lost_mid_transaction_is_unavailable_not_a_bug(
    postgres_url: str,
) -> None:
    """A connection that dies inside a transaction raises DatabaseUnavailable (the
    engine rides it out, nothing committed); a wrong statement stays the database's own
    error, which is not ridden out."""
    import psycopg

    store = CoordinatorStore(postgres_url)
    store.set_meta("k", "v1")
    with (pytest.raises(DatabaseUnavailable, match="unreachable") as lost,
          store.database.transaction() as cur):
        cur.execute("UPDATE meta SET value = ? WHERE key = ?", ("v2", "k"))
        row = cur.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))
        cur.execute("SELECT 1")
    assert "medfed_test_" in str(lost.value)  # names the database
    assert store.get_meta("k") == "v1"  # the lost transaction committed nothing
    with pytest.raises(psycopg.errors.UndefinedTable), store.database.transaction() as cur:
        cur.execute("SELECT * FROM no_such_table")
    store.close()
