"""A coordinator on PostgreSQL rides out a server restart and an outage mid-round.

A real PostgreSQL server of this test alone, a real in-process coordinator and four
honest sites over mTLS. The server is restarted (`pg_ctl restart`) while no round is in
flight, then stopped (`pg_ctl stop -m fast`) at the moment round 2 records its
intent to unmask, and started again once the coordinator reported the loss. The
coordinator must stay up, abandon round 2 only (nothing of it unmasked), finish the
study, and count the reconnects.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from common.core.errors import DatabaseUnavailable
from tests.db.conftest import _Server
from tests.db.test_restart_postgres import on_loop
from tests.network.conftest import (
    HonestSites,
    InProcessCoordinator,
    PkiLayout,
    coordinator_settings,
)

SITES = ("a", "b", "c", "d")

pytestmark = pytest.mark.timeout(300)


class EventLatch(logging.Handler):
    """Sets `seen` when a record with `event` == `name` is logged (any thread)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name_wanted = name
        self.seen = threading.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == self.name_wanted:
            self.records.append(record)
            self.seen.set()


@pytest.fixture
def latch() -> Iterator[Callable[[str], EventLatch]]:
    made: list[EventLatch] = []

    def make(name: str) -> EventLatch:
        handler = EventLatch(name)
        logging.getLogger("medfed").addHandler(handler)
        made.append(handler)
        return handler

    yield make
    for handler in made:
        logging.getLogger("medfed").removeHandler(handler)


def test_restart_and_outage_cost_at_most_the_round_in_flight(
    pki_layout: PkiLayout,
    tmp_path: Path,
    private_postgres: _Server,
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
    latch: Callable[[str], EventLatch],
    caplog: pytest.LogCaptureFixture,
) -> None:
    lost, over = latch("database_lost"), latch("database_outage_over")
    caplog.set_level(logging.INFO, logger="medfed")
    settings = coordinator_settings(
        pki_layout, tmp_path / "state", database_url=private_postgres.url, rounds=3,
        database_outage_seconds=120.0,
    )
    with InProcessCoordinator(settings) as coordinator:
        engine = coordinator.engine
        metrics = engine.metrics.registry
        # A restart while no round is in flight (the engine recovered and waits for
        # sites; its start-up ran before this call reached its loop): the next
        # transaction's liveness check finds the closed connection and reconnects.
        on_loop(coordinator, lambda: None)
        private_postgres.control("restart", "-m", "fast")

        store = engine.store
        record_intent = store.mark_unmasked
        stopped: list[int] = []

        def stop_server_then_record(round_number: int) -> None:
            if round_number == 2 and not stopped:
                stopped.append(round_number)
                private_postgres.control("stop", "-m", "fast")
            record_intent(round_number)

        store.mark_unmasked = stop_server_then_record  # type: ignore[method-assign]
        sites = honest_sites(coordinator.address, SITES)

        for _ in range(120):
            if lost.seen.wait(1) or coordinator.engine_done.is_set():
                break
        error = coordinator.engine_error()
        assert error is None, "".join(traceback.format_exception(error))
        assert lost.seen.is_set(), "the coordinator never reported the lost database"
        private_postgres.control("start")
        assert over.seen.wait(120), "the coordinator did not ride out the outage"

        coordinator.wait_engine_done(180)
        assert sites.join(60) == dict.fromkeys(SITES, 0)
        rounds = on_loop(coordinator, lambda: [(r.round_number, r.status)
                                               for r in store.rounds()])
        reconnects = metrics.get_sample_value("medfed_coordinator_database_reconnects_total")
        outage = metrics.get_sample_value("medfed_coordinator_database_outage_seconds")
        abandoned = metrics.get_sample_value(
            "medfed_coordinator_rounds_total", {"outcome": "abandoned"})

    assert stopped == [2]
    # Round 2 was abandoned before its sum existed (the intent was never recorded);
    # the study then ran its three training rounds.
    assert rounds == [
        (1, "completed"), (2, "abandoned"), (3, "completed"), (4, "completed")]
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round 2 was")]
    assert said == ["round 2 was in flight at a loss of the state database: abandoned"]
    assert abandoned == 1.0
    # One reconnect after the restart, one after the outage (sites' calls may find
    # the connection first; each reconnect is counted once).
    assert reconnects is not None and reconnects >= 2
    assert outage is not None and outage > 0
    assert len(lost.records) == 1  # the outage is reported once, not per retry
    assert "postgresql://medfed@127.0.0.1" in lost.records[0].getMessage()


def test_a_database_that_stays_down_stops_the_engine_naming_it(
    pki_layout: PkiLayout,
    tmp_path: Path,
    private_postgres: _Server,
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
) -> None:
    """Beyond `database_outage_seconds` the engine gives up with an error that names the
    database, its password redacted (the server trusts local connections, so the URL
    may carry any password)."""
    url = private_postgres.url.replace("medfed@", "medfed:s3cret@", 1)
    settings = coordinator_settings(
        pki_layout, tmp_path / "state", database_url=url, rounds=3,
        database_outage_seconds=2.0,
    )
    with InProcessCoordinator(settings) as coordinator:
        store = coordinator.engine.store
        record_intent = store.mark_unmasked

        def stop_server_then_record(round_number: int) -> None:
            if round_number == 2:
                private_postgres.control("stop", "-m", "fast")
            record_intent(round_number)

        store.mark_unmasked = stop_server_then_record  # type: ignore[method-assign]
        honest_sites(coordinator.address, SITES)
        assert coordinator.engine_done.wait(120), "the engine did not give up"
        error = coordinator.engine_error()
    assert isinstance(error, DatabaseUnavailable), repr(error)
    text = str(error)
    assert "still unreachable after 2 s (database_outage_seconds)" in text
    assert "postgresql://medfed:***@127.0.0.1" in text
    assert "s3cret" not in text
