"""The study's statistics round: once per study, before any training, every site
releases its DP statistics (`common.releases.plugins.statistics`); the decoded sum
becomes the GlobalStatistics every later announcement carries and every site
preprocesses with (kept under STATE: `StudyRun.save_statistics`)."""

from __future__ import annotations

import logging
from functools import partial

from common.core.errors import StateError
from common.protocol.secagg.params import ROUND_NONCE_BYTES
from common.releases.egress import STATISTICS
from common.releases.seam import DecodedSum, DpRelease
from common.rounds.announcement import Announcement
from coordinator import release_round, selection
from coordinator.aggregation import Aggregator
from coordinator.phases import ActiveRound
from coordinator.round_kind import Due, RoundContext, StudyRound, register_round_kind
from coordinator.study_run import StudyRun
from coordinator.training_round import RoundResult

log = logging.getLogger("medfed.coordinator")


def keep_statistics(run: StudyRun, release: DpRelease, decoded: DecodedSum,
                    round_number: int) -> None:
    """Keep the statistics under STATE (StudyRun.save_statistics), from where every
    later announcement carries them; each noise warning is logged."""
    del release
    stats = decoded.value
    for warning in stats.warnings:
        log.warning("statistics round %d: %s", round_number, warning,
                    extra={"event": "statistics_noise_dominated",
                           "round_number": round_number})
    run.save_statistics(stats, round_number)


class StatisticsRound(StudyRound):
    name = "statistics"
    rank = 10

    async def due(self, ctx: RoundContext) -> Due[None] | None:
        if ctx.study is not None and ctx.study.statistics is None:
            return Due(self, None)
        return None

    def announce(self, ctx: RoundContext, participants: list[str], job: None) -> Announcement:
        study = ctx.study
        if study is None:
            raise StateError("the statistics round runs for a study, and none is run")
        return selection.release_announcement(
            ctx.settings, participants, study=study,
            number=ctx.next_round_number(participants), nonce=ctx.rng(ROUND_NONCE_BYTES),
            now=ctx.clock(), release=selection.study_release(study, STATISTICS))

    async def complete(self, ctx: RoundContext, rnd: ActiveRound, aggregator: Aggregator,
                       job: None) -> RoundResult:
        run = ctx.study
        return await release_round.complete(
            rnd, aggregator, run=run, settings=ctx.settings, store=ctx.store,
            metrics=ctx.metrics, clock=ctx.clock, observer=ctx.observer,
            keep=None if run is None else partial(keep_statistics, run))


register_round_kind(StatisticsRound())
