"""A lying site cannot stop the federation, over real mTLS.

Every integer a site sends is range-checked at the boundary (common.rounds.wire). The attack
that used to work: a budget report with ledger_last_round = 2^63 - 1 made the next round
number overflow SQLite's signed 64-bit integers, and the coordinator died at every
restart. Now the report is INVALID_ARGUMENT and honest rounds go on with small numbers.

The report the wire accepts can still lie: ledger_last_round = 2^53 - 2 (the largest)
once made the federation jump to round 2^53 - 1, after which no number was left, and
2^40 renumbered it for good. One site's report now moves the numbering at most
`ROUND_WINDOW` rounds past the coordinator's own record; beyond, the site is refused
(FAILED_PRECONDITION, logged, counted) unless other sites corroborate it
(`coordinator.selection.round_ceiling`), and a state database such a lie already
poisoned resumes after its last round before the jump.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from common.proto.medfed.v1 import federation_pb2 as pb
from common.rounds import wire
from coordinator.store import ROUND_WINDOW, CoordinatorStore
from tests.network.conftest import (
    InProcessCoordinator,
    PkiLayout,
    coordinator_settings,
    raw_stub,
    status_of,
)

LIES = (2**63 - 1, 2**64 - 1, wire.MAX_ROUND_NUMBER)


def lying_budget(last_round: int) -> pb.BudgetStatus:
    return pb.BudgetStatus(
        epsilon_budget=1.0, privacy_unit="record", ledger_entries=1,
        ledger_head="0" * 64, ledger_last_round=last_round,
    )


def test_budget_report_with_huge_ledger_round_is_refused_and_rounds_continue(
    pki_layout: PkiLayout,
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[..., Any],
) -> None:
    coord = coordinator(rounds=2, min_sites=3)
    liar = raw_stub(pki_layout, coord.address, cert_of="d")
    for lie in LIES:
        budget = lying_budget(lie)
        assert status_of(
            liar.Enroll, pb.EnrollRequest(agent_version="liar/1", budget=budget), timeout=10
        ) == grpc.StatusCode.INVALID_ARGUMENT
        assert status_of(
            liar.WaitForRound, pb.WaitForRoundRequest(wait_seconds=1, budget=budget), timeout=10
        ) == grpc.StatusCode.INVALID_ARGUMENT
        assert status_of(
            liar.DeclineRound, pb.DeclineRoundRequest(round=1, budget=budget), timeout=10
        ) == grpc.StatusCode.INVALID_ARGUMENT
        after = max(lie, wire.MAX_ROUND_NUMBER + 1)  # a round number no round can have
        assert status_of(
            liar.WaitForRound, pb.WaitForRoundRequest(wait_seconds=1, after_round=after),
            timeout=10,
        ) == grpc.StatusCode.INVALID_ARGUMENT
    # The largest value the wire accepts is refused too, now as a lie about the
    # federation's rounds: no other site reports a ledger anywhere near it.
    fits = lying_budget(wire.MAX_ROUND_NUMBER - 1)
    assert status_of(
        liar.Enroll, pb.EnrollRequest(agent_version="liar/1", budget=fits), timeout=10
    ) == grpc.StatusCode.FAILED_PRECONDITION
    # ... "d" is never selected; the honest sites run both rounds with ordinary numbers.
    sites = honest_sites(coord.address, ["a", "b", "c"])
    assert sites.join(120) == {"a": 0, "b": 0, "c": 0}
    coord.wait_engine_done(30)
    rounds = coord.engine.store.rounds()
    assert [r.status for r in rounds] == ["completed", "completed"]
    assert max(r.round_number for r in rounds) < wire.MAX_ROUND_NUMBER


def _refusals(coord: InProcessCoordinator, site: str) -> float:
    """medfed_coordinator_round_reports_refused_total{site=...} from /metrics."""
    url = f"http://127.0.0.1:{coord.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    prefix = f'medfed_coordinator_round_reports_refused_total{{site="{site}"}} '
    values = [float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


@pytest.mark.parametrize("lie", [wire.MAX_ROUND_NUMBER - 1, 2**40])
def test_lying_ledger_round_does_not_renumber_the_federation(
    pki_layout: PkiLayout,
    coordinator: Callable[..., InProcessCoordinator],
    honest_sites: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
    lie: int,
) -> None:
    """A site certificate ("d") reports a ledger far ahead, at enrolment, when declining
    and in long polls it keeps making while the honest sites train (before bounded
    reports it was selected with them and round 1 was numbered `lie` + 1): every call is
    FAILED_PRECONDITION naming the report and the window, logged once and counted per
    call; the honest sites train rounds 1 and 2."""
    caplog.set_level(logging.WARNING, logger="medfed.coordinator")
    coord = coordinator(rounds=2, min_sites=3)
    liar = raw_stub(pki_layout, coord.address, cert_of="d")
    budget = lying_budget(lie)
    with pytest.raises(grpc.RpcError) as refused:
        liar.Enroll(pb.EnrollRequest(agent_version="liar/1", budget=budget), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details() or ""
    assert f"ledger_last_round {lie}" in details and f"more than {ROUND_WINDOW} rounds" in details
    assert status_of(
        liar.DeclineRound, pb.DeclineRoundRequest(round=1, budget=budget), timeout=10
    ) == grpc.StatusCode.FAILED_PRECONDITION
    done = threading.Event()
    codes: list[grpc.StatusCode] = []

    def keep_polling() -> None:
        while not done.is_set():
            codes.append(status_of(
                liar.WaitForRound, pb.WaitForRoundRequest(wait_seconds=2, budget=budget),
                timeout=10))
            done.wait(0.2)  # pacing only: a refused poll returns at once

    poller = threading.Thread(target=keep_polling, daemon=True)
    poller.start()
    try:
        sites = honest_sites(coord.address, ["a", "b", "c"])
        assert sites.join(120) == {"a": 0, "b": 0, "c": 0}
        coord.wait_engine_done(30)
    finally:
        done.set()
        poller.join(15)
    rounds = coord.engine.store.rounds()
    assert [(r.round_number, r.status) for r in rounds] == [(1, "completed"), (2, "completed")]
    assert all("d" not in r.participants for r in rounds)
    assert codes and set(codes) == {grpc.StatusCode.FAILED_PRECONDITION}
    assert _refusals(coord, "d") == 2 + len(codes)
    logged = [r for r in caplog.records if getattr(r, "event", None) == "round_report_refused"]
    assert len(logged) == 1 and getattr(logged[0], "ledger_last_round", None) == lie


def _poisoned_state(state: Path, *, poison: int) -> None:
    """A coordinator state written before reports were bounded: round 1 completed, then
    round `poison`, numbered after one site's lie, abandoned at a crash."""
    state.mkdir(parents=True)
    store = CoordinatorStore(f"sqlite:///{state / 'coordinator.db'}")
    try:
        store.begin_round(1, ["a", "b", "c"], now=1.0)
        store.finish_round(1, status="completed", survivors=["a", "b", "c"], dropped=[],
                           detail="", metrics={}, now=2.0)
        with store.database.transaction() as cur:
            cur.execute(
                "INSERT INTO rounds (round_number, status, started_at, participants) "
                "VALUES (?, 'abandoned', ?, ?)", (poison, 3.0, json.dumps(["a", "b", "d"])))
    finally:
        store.close()


@pytest.mark.parametrize("poison", [wire.MAX_ROUND_NUMBER, 2**40])
def test_federation_poisoned_by_an_old_lie_recovers(
    pki_layout: PkiLayout, tmp_path: Path, honest_sites: Callable[..., Any], poison: int,
) -> None:
    """The state database holds round 2^53 - 1 (or 2^40) from an old lie: the next number
    used to be past the wire limit (honest sites refused forever). The coordinator now
    resumes after round 1; the poisoned number stays in the history, unused again."""
    state = tmp_path / "poisoned"
    _poisoned_state(state, poison=poison)
    settings = coordinator_settings(pki_layout, state, rounds=3, min_sites=3)
    with InProcessCoordinator(settings) as coord:
        assert coord.engine.store.next_round_number() == 2
        sites = honest_sites(coord.address, ["a", "b", "c"])
        assert sites.join(120) == {"a": 0, "b": 0, "c": 0}
        coord.wait_engine_done(30)  # raises if the engine failed
        rounds = [(r.round_number, r.status) for r in coord.engine.store.rounds()]
    assert rounds == [(1, "completed"), (2, "completed"), (3, "completed"),
                      (poison, "abandoned")]
