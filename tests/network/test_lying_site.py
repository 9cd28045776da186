"""A lying site cannot stop the federation, over real mTLS.

Every integer a site sends is range-checked at the boundary (common.wire). The attack
that used to work: a budget report with ledger_last_round = 2^63 - 1 made the next round
number overflow SQLite's signed 64-bit integers, and the coordinator died at every
restart. Now the report is INVALID_ARGUMENT and honest rounds go on with small numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from common import wire
from common.proto.medfed.v1 import federation_pb2 as pb
from tests.network.conftest import (
    InProcessCoordinator,
    PkiLayout,
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
    # The largest honest report is still accepted: the next round number fits.
    fits = lying_budget(wire.MAX_ROUND_NUMBER - 1)
    assert status_of(
        liar.Enroll, pb.EnrollRequest(agent_version="liar/1", budget=fits), timeout=10
    ) == grpc.StatusCode.OK
    # ... but "d" never waits for a round, so it is never selected; the honest sites
    # run both rounds with ordinary numbers.
    sites = honest_sites(coord.address, ["a", "b", "c"])
    assert sites.join(120) == {"a": 0, "b": 0, "c": 0}
    coord.wait_engine_done(30)
    rounds = coord.engine.store.rounds()
    assert [r.status for r in rounds] == ["completed", "completed"]
    assert max(r.round_number for r in rounds) < wire.MAX_ROUND_NUMBER
