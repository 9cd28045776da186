"""A round that carries one DP release alone (`common.release`), such as the study's
statistics round once per study before training: the noisy secure sum of every site's
contribution (distributed discrete Gaussian, Kairouz, Liu & Steinke, ICML 2021) is
decoded by the release (`common.release.decode_sum`) and kept by its keeper; the
statistics become the GlobalStatistics every site then preprocesses with. Such a round
updates no model and writes no checkpoint."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from common.config import CoordinatorSettings
from common.egress import STATISTICS
from common.errors import AbortReason, ProtocolAbort
from common.release import decode_sum, release_for_round
from coordinator import checkpoints
from coordinator.aggregation import Aggregator
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import ActiveRound
from coordinator.store import CoordinatorStore
from coordinator.study_run import StudyRun
from coordinator.training_round import RoundResult

log = logging.getLogger("medfed.coordinator")


def keep_statistics(run: StudyRun, stats: Any, round_number: int) -> None:
    """Keep the statistics under STATE (StudyRun.save_statistics), from where every
    later announcement carries them; each noise warning is logged."""
    for warning in stats.warnings:
        log.warning("statistics round %d: %s", round_number, warning,
                    extra={"event": "statistics_noise_dominated",
                           "round_number": round_number})
    run.save_statistics(stats, round_number)


KEEPERS: dict[str, Callable[[StudyRun, Any, int], None]] = {STATISTICS: keep_statistics}
"""What the coordinator does with each round release's decoded value."""


def decode(
    rnd: ActiveRound, aggregator: Aggregator, *, run: StudyRun | None,
    settings: CoordinatorSettings,
) -> RoundResult:
    """Decode the release and keep it (worker thread)."""
    ann = rnd.announcement
    aggregate = aggregator.result
    if aggregate is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, "no aggregate for this round")
    kind = release_for_round(ann.kind, ann.release_name)
    if kind is None or kind.build is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, f"round kind {ann.kind!r} has no release")
    if run is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, f"{kind.name} round without a study")
    keep = KEEPERS.get(kind.name)
    if keep is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, f"nothing keeps the {kind.name} release")
    if settings.debug_write_aggregates:
        checkpoints.write_debug_aggregate(
            settings.state, ann.round_number, aggregate, aggregator.survivors
        )
    decoded = decode_sum(
        kind.build(run.study), aggregate, contributors=len(aggregator.survivors),
        max_colluding_sites=settings.aggregation.max_colluding_sites,
        round_number=ann.round_number,
    )
    keep(run, decoded, ann.round_number)
    return RoundResult(
        ann.round_number, aggregator.survivors, aggregator.dropped,
        np.zeros(0, dtype=np.float32),
        {"contributors": float(len(aggregator.survivors))}, statistics=True,
    )


def record(
    result: RoundResult, *, kind: str, store: CoordinatorStore, metrics: CoordinatorMetrics,
    now: float,
) -> None:
    """Not a training round: recorded under its release's name (the statistics round as
    "statistics"), not counted in completed_rounds."""
    store.finish_round(
        result.round_number, status=kind, now=now,
        survivors=result.survivors, dropped=result.dropped, metrics=result.metrics,
    )
    metrics.rounds_total.labels(outcome="completed").inc()


async def complete(
    rnd: ActiveRound, aggregator: Aggregator, *, run: StudyRun | None,
    settings: CoordinatorSettings, store: CoordinatorStore, metrics: CoordinatorMetrics,
    clock: Callable[[], float],
) -> RoundResult:
    """Decode (worker thread), then record the release round."""
    result = await asyncio.to_thread(decode, rnd, aggregator, run=run, settings=settings)
    record(result, kind=rnd.announcement.release, store=store, metrics=metrics, now=clock())
    return result
