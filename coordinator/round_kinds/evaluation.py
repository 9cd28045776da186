"""The study's final evaluation round (``training.final_evaluation``): after the
planned training rounds, one round that serves the final model and trains nothing
(local_epochs 0, no privacy spend but the DP score histogram), so every site may join
it whatever budget it has left; its sum is read as a model round's."""

from __future__ import annotations

from coordinator.round_kind import Due, RoundContext, register_round_kind
from coordinator.round_kinds.training import TrainingRound


class EvaluationRound(TrainingRound):
    name = "evaluation"
    rank = 30
    spends_budget = False
    evaluates_only = True

    async def due(self, ctx: RoundContext) -> Due[None] | None:
        if ctx.settings.rounds <= ctx.store.completed_rounds() < ctx.total_rounds:
            return Due(self, None)
        return None

    def title(self, ctx: RoundContext) -> str:
        return "the final evaluation round"


register_round_kind(EvaluationRound())
