"""The study's training rounds: `rounds` of them, each serving the global model; the
sites train it under DP-SGD (or hospital-level DP) and the unmasked sum steps it
(`coordinator.training_round`), then the round is checkpointed, recorded and bundled."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import ClassVar

from common.core.codec import digest
from common.protocol.secagg.params import ROUND_NONCE_BYTES
from common.rounds.announcement import Announcement
from coordinator import hospital_sum, selection, training_round
from coordinator.aggregation import Aggregator
from coordinator.ledger_gate import evaluation_noise_std
from coordinator.phases import ActiveRound
from coordinator.round_kind import Due, RoundContext, StudyRound, register_round_kind
from coordinator.training_round import RoundResult


class TrainingRound(StudyRound):
    name = "training"
    rank = 20
    evaluates_only: ClassVar[bool] = False
    """The round trains nothing: it measures the served model (the final evaluation)."""

    async def due(self, ctx: RoundContext) -> Due[None] | None:
        if ctx.store.completed_rounds() < ctx.settings.rounds:
            return Due(self, None)
        return None

    def announce(self, ctx: RoundContext, participants: list[str], job: None) -> Announcement:
        payload = ctx.model.payload()
        return selection.study_announcement(
            ctx.settings, participants, study=ctx.study,
            number=ctx.next_round_number(participants), nonce=ctx.rng(ROUND_NONCE_BYTES),
            layout=ctx.model.layout, model_sha256=digest(payload), model_bytes=len(payload),
            evaluation_round=self.evaluates_only, intermediaries=ctx.model.intermediaries,
            now=ctx.clock(), histogram_edges=ctx.model.histogram_edges,
        )

    def serve(self, ctx: RoundContext) -> bytes | memoryview:
        return ctx.model.payload()

    async def complete(self, ctx: RoundContext, rnd: ActiveRound, aggregator: Aggregator,
                       job: None) -> RoundResult:
        """Step the model with the round's sum (worker thread), then record the round."""
        study = ctx.study.study if ctx.study is not None else None
        result = await asyncio.to_thread(
            training_round.apply_update, rnd, aggregator, model=ctx.model,
            settings=ctx.settings, hospital_terms=hospital_sum.terms_for(
                study, ctx.settings.aggregation),
            evaluation_noise_std=evaluation_noise_std(
                ctx.ledgers.replica, aggregator.survivors, round_number=rnd.number),
            study=study, observer=ctx.observer,
        )
        rnd.mark("updated")
        training_round.record_and_bundle(
            result, model=ctx.model, settings=ctx.settings, store=ctx.store,
            metrics=ctx.metrics, now=ctx.clock(), run=ctx.study,
            budgets=ctx.budget_view.snapshot, secagg=ctx.last_secagg,
            final=lambda: ctx.store.completed_rounds() >= ctx.total_rounds,
            hospital_epsilons=partial(hospital_sum.replica_epsilons, ctx.ledgers.replica),
        )
        ctx.last_result = result
        return result

    def title(self, ctx: RoundContext) -> str:
        return (f"training round {ctx.store.completed_rounds() + 1} of "
                f"{ctx.settings.rounds}")


register_round_kind(TrainingRound())
