"""The study's statistics round, once per study before training: the noisy secure sum
of every site's statistics contribution (distributed discrete Gaussian, Kairouz, Liu &
Steinke, ICML 2021; common/statistics.py) becomes the GlobalStatistics every site
then preprocesses with. It updates no model and writes no checkpoint."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from common.config import CoordinatorSettings
from common.errors import AbortReason, ProtocolAbort
from common.statistics import decode_release, release_noise_sigma, ring_to_signed
from coordinator import checkpoints
from coordinator.aggregation import Aggregator
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import ActiveRound
from coordinator.store import CoordinatorStore
from coordinator.study_run import StudyRun
from coordinator.training_round import RoundResult

log = logging.getLogger("medfed.coordinator")


def decode(
    rnd: ActiveRound, aggregator: Aggregator, *, run: StudyRun | None,
    settings: CoordinatorSettings,
) -> RoundResult:
    """Decode the release and keep it under STATE (StudyRun.save_statistics), from where
    every later announcement carries it (worker thread)."""
    ann = rnd.announcement
    aggregate = aggregator.result
    if aggregate is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, "no aggregate for this round")
    if run is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, "statistics round without a study")
    if settings.debug_write_aggregates:
        checkpoints.write_debug_aggregate(
            settings.state, ann.round_number, aggregate, aggregator.survivors
        )
    privacy = run.study.privacy
    source = (
        f"federated DP release, round {ann.round_number}: {len(aggregator.survivors)} "
        f"sites, epsilon {privacy.statistics_epsilon:g}, delta {privacy.delta:g} "
        "(distributed discrete Gaussian)"
    )
    sigma = release_noise_sigma(
        run.study, contributors=len(aggregator.survivors),
        max_colluding_sites=run.study.privacy.max_colluding_sites,
    )
    stats = decode_release(ring_to_signed(aggregate), run.study, source=source,
                           noise_sigma=sigma)
    for warning in stats.warnings:
        log.warning("statistics round %d: %s", ann.round_number, warning,
                    extra={"event": "statistics_noise_dominated",
                           "round_number": ann.round_number})
    run.save_statistics(stats, ann.round_number)
    return RoundResult(
        ann.round_number, aggregator.survivors, aggregator.dropped,
        np.zeros(0, dtype=np.float32),
        {"contributors": float(len(aggregator.survivors))}, statistics=True,
    )


def record(
    result: RoundResult, *, store: CoordinatorStore, metrics: CoordinatorMetrics, now: float
) -> None:
    """Not a training round: recorded as "statistics", not counted in completed_rounds."""
    store.finish_round(
        result.round_number, status="statistics", now=now,
        survivors=result.survivors, dropped=result.dropped, metrics=result.metrics,
    )
    metrics.rounds_total.labels(outcome="completed").inc()


async def complete(
    rnd: ActiveRound, aggregator: Aggregator, *, run: StudyRun | None,
    settings: CoordinatorSettings, store: CoordinatorStore, metrics: CoordinatorMetrics,
    clock: Callable[[], float],
) -> RoundResult:
    """Decode (worker thread), then record the statistics round."""
    result = await asyncio.to_thread(decode, rnd, aggregator, run=run, settings=settings)
    record(result, store=store, metrics=metrics, now=clock())
    return result
