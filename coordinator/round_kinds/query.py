"""An approved query the operator put in the inbox (`coordinator.queries`), run as a
release round of its own (`common.releases.plugins.query`) in place of the study's next
round, with the participants selected for that round: before its first round or between
two. A query round that cannot complete (sites declined it, too few survived) fails
alone, recorded for the operator: never the study, and never retried (the sites that
released already paid for it). Once the study completes, no query can run: what waits
in the inbox is failed with why, and `medfed query run` reads the same reason."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Final

from common.core.errors import StateError
from common.protocol.secagg.params import ROUND_NONCE_BYTES
from common.releases.seam import DecodedSum, DpRelease
from common.rounds.announcement import Announcement
from coordinator import queries, release_round, selection
from coordinator.aggregation import Aggregator
from coordinator.phases import ActiveRound
from coordinator.queries import PendingQuery
from coordinator.round_kind import Due, RoundContext, RoundKind, register_round_kind
from coordinator.training_round import RoundResult

log = logging.getLogger("medfed.coordinator")

STUDY_DONE_FOR_QUERIES: Final = (
    "the study has finished: a query runs as a round before one of the study's rounds "
    "and none is left (run it while a study still has rounds to go)")
"""Why a finished study fails the queries in its inbox (`queries.close`)."""


def keep_answer(state: Path, release: DpRelease, decoded: DecodedSum,
                round_number: int) -> None:
    """The query's answer for the operator (`medfed query run`), with the noisy sum and
    noise it was decoded from (`queries.keep_answer`)."""
    queries.keep_answer(state, release, decoded.total, noise_sigmas=decoded.noise_sigmas,
                        contributors=decoded.contributors, round_number=round_number,
                        answer=decoded.value)


class QueryRound(RoundKind[PendingQuery]):
    name = "query"
    rank = 40
    in_place_of_study_round = True

    async def due(self, ctx: RoundContext) -> Due[PendingQuery] | None:
        if ctx.study is None:
            return None
        query = await asyncio.to_thread(queries.pending, ctx.settings.state, ctx.study.study)
        return None if query is None else Due(self, query)

    def announce(self, ctx: RoundContext, participants: list[str],
                 job: PendingQuery) -> Announcement:
        study = ctx.study
        if study is None:
            raise StateError("a query round runs for a study, and none is run")
        log.info("running query %s (sha256 %s...) with %s", job.name, job.sha256[:12],
                 ", ".join(participants), extra={"event": "query_round",
                                                 "query_sha256": job.sha256})
        return selection.release_announcement(
            ctx.settings, participants, study=study,
            number=ctx.next_round_number(participants), nonce=ctx.rng(ROUND_NONCE_BYTES),
            now=ctx.clock(), release=job.release, payload=job.payload)

    async def complete(self, ctx: RoundContext, rnd: ActiveRound, aggregator: Aggregator,
                       job: PendingQuery) -> RoundResult:
        state = ctx.settings.state
        return await release_round.complete(
            rnd, aggregator, run=ctx.study, settings=ctx.settings, store=ctx.store,
            metrics=ctx.metrics, clock=ctx.clock, observer=ctx.observer,
            keep=lambda release, decoded, number: keep_answer(state, release, decoded,
                                                              number))

    def after(self, ctx: RoundContext, rnd: ActiveRound, job: PendingQuery, *,
              completed: bool) -> None:
        """No answer written: the query failed, with who declined it and why."""
        state = ctx.settings.state
        if not queries.answer_path(state, job.sha256).exists():
            declined = "; ".join(f"{site}: {reason}" for site, reason in
                                 sorted(rnd.declined_for_good.items()))
            queries.fail(state, job.sha256, f"round {rnd.number} did not complete"
                         + (f" (declined: {declined})" if declined else ""),
                         round_number=rnd.number)

    def opening(self, ctx: RoundContext) -> None:
        """The study's rounds run (again): queries may wait for the next one."""
        queries.reopen(ctx.settings.state)

    def closing(self, ctx: RoundContext) -> None:
        """No query can run any more: fail what waits (the study itself did finish, so a
        folder that cannot be written is logged, not raised)."""
        try:
            queries.close(ctx.settings.state, STUDY_DONE_FOR_QUERIES)
        except (OSError, StateError) as exc:
            log.warning("could not close the query inbox: %s", exc,
                        extra={"event": "query_inbox_unwritable", "reason": str(exc)})


register_round_kind(QueryRound())
