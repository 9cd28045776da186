"""A kind of round the coordinator schedules itself is one registration
(`coordinator.round_kind`): a kind that exists only in this file (a rehearsal: one
evaluation-only round before any training, recorded under its own name) is registered,
and a real coordinator (mTLS sockets, SQLite state) runs it with honest site agents in
the order its rank gives it, before the study's training round, then the study's own
rounds, with nothing in the engine naming it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from common.core.codec import digest
from common.protocol.secagg.params import ROUND_NONCE_BYTES
from common.rounds.announcement import Announcement
from coordinator import release_round, selection
from coordinator.aggregation import Aggregator
from coordinator.phases import ActiveRound
from coordinator.round_kind import ROUND_KINDS, Due, RoundContext, StudyRound, register_round_kind
from coordinator.training_round import RoundResult
from tests.network.conftest import (
    HonestSites,
    InProcessCoordinator,
    PkiLayout,
    coordinator_settings,
)

SITES = ("a", "b", "c", "d")


class Rehearsal(StudyRound):
    """TEST ONLY: one evaluation-only round of the served model before training (between
    the statistics, rank 10, and training, rank 20), recorded as "test_rehearsal"."""

    name = "test_rehearsal"
    rank = 15
    spends_budget = False

    async def due(self, ctx: RoundContext) -> Due[None] | None:
        done = any(r.status == self.name for r in ctx.store.rounds())
        return None if done else Due(self, None)

    def announce(self, ctx: RoundContext, participants: list[str], job: None) -> Announcement:
        payload = ctx.model.payload()
        return selection.study_announcement(
            ctx.settings, participants, study=ctx.study,
            number=ctx.next_round_number(participants), nonce=ctx.rng(ROUND_NONCE_BYTES),
            layout=ctx.model.layout, model_sha256=digest(payload), model_bytes=len(payload),
            evaluation_round=True, now=ctx.clock())

    def serve(self, ctx: RoundContext) -> bytes | memoryview:
        return ctx.model.payload()

    async def complete(self, ctx: RoundContext, rnd: ActiveRound, aggregator: Aggregator,
                       job: None) -> RoundResult:
        result = RoundResult(rnd.number, aggregator.survivors, aggregator.dropped,
                             np.zeros(0, dtype=np.float32),
                             {"contributors": float(len(aggregator.survivors))})
        release_round.record(result, kind=self.name, store=ctx.store, metrics=ctx.metrics,
                             now=ctx.clock())
        return result


@pytest.fixture
def rehearsal() -> Iterator[None]:
    register_round_kind(Rehearsal())
    try:
        yield
    finally:
        ROUND_KINDS.pop(Rehearsal.name, None)


def test_a_kind_of_round_registered_in_one_file_runs_in_its_rank(
    rehearsal: None, pki_layout: PkiLayout, tmp_path: Path,
    honest_sites: Callable[[str, Sequence[str]], HonestSites],
) -> None:
    settings = coordinator_settings(pki_layout, tmp_path / "coordinator", rounds=1)
    with InProcessCoordinator(settings) as coordinator:
        group = honest_sites(coordinator.address, SITES)
        coordinator.wait_engine_done(120)
        records = coordinator.engine.store.rounds()
        total = coordinator.engine.total_rounds
        group.join(60)
    statuses = [r.status for r in records]
    assert statuses == ["test_rehearsal"] + ["completed"] * total, statuses
    first = records[0]
    assert set(first.survivors) == set(SITES)
    assert [r.round_number for r in records] == sorted(r.round_number for r in records)
