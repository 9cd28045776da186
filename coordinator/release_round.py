"""A round that carries one DP release alone (`common.releases.seam`), such as the study's
statistics round once per study before training: the noisy secure sum of every site's
contribution (distributed discrete Gaussian, Kairouz, Liu & Steinke, ICML 2021) is
decoded by the release (`common.releases.seam.decode_sum`) and kept: the statistics become
the GlobalStatistics every site then preprocesses with, any other release's value is
written as JSON under STATE/releases/. Such a round
updates no model and writes no checkpoint."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from common.core.config import CoordinatorSettings
from common.core.errors import AbortReason, ProtocolAbort
from common.core.fileio import atomic_write
from common.core.observer import NoObserver, RoundObserver
from common.releases.egress import STATISTICS
from common.releases.seam import (
    DpRelease,
    build_release,
    decode_sum,
    release_for_round,
    study_noise_sites,
    sum_noise_sigmas,
)
from coordinator import queries
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


def keep_json(state: Path, release: DpRelease, decoded: Any, round_number: int) -> Path:
    """Any other release: its decoded value as JSON (`DpRelease.to_json`), written
    atomically to STATE/releases/<name>-round-<n>.json."""
    path = state / RELEASES_DIR / f"{release.name}-round-{round_number:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(
        {"release": release.name, "round": round_number, "value": release.to_json(decoded)},
        indent=2, sort_keys=True).encode())
    return path


KEEPERS: dict[str, Callable[[StudyRun, Any, int], None]] = {STATISTICS: keep_statistics}
"""What the coordinator does with a round release's decoded value, where it does more
than keep it as JSON (`keep_json`)."""
RELEASES_DIR = "releases"


def decode(
    rnd: ActiveRound, aggregator: Aggregator, *, run: StudyRun | None,
    settings: CoordinatorSettings, observer: RoundObserver | None = None,
) -> RoundResult:
    """Decode the release and keep it (worker thread); `observer` is shown the unmasked
    sum first (`common.core.observer`)."""
    ann = rnd.announcement
    aggregate = aggregator.result
    if aggregate is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, "no aggregate for this round")
    kind = release_for_round(ann.kind, ann.release_name)
    if kind is None or (kind.build is None and kind.build_payload is None):
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, f"round kind {ann.kind!r} has no release")
    if run is None:
        raise ProtocolAbort(AbortReason.ROUND_ABANDONED, f"{kind.name} round without a study")
    (observer or NoObserver()).aggregate_unmasked(
        ann.round_number, aggregate, aggregator.survivors)
    release = build_release(kind, run.study, ann.release_payload)
    contributors = len(aggregator.survivors)
    # The study's pinned terms: the n_noise every member sized its noise share by.
    noise_sites = study_noise_sites(run.study)
    decoded = decode_sum(
        release, aggregate, contributors=contributors, noise_sites=noise_sites,
        round_number=ann.round_number,
    )
    keep = KEEPERS.get(kind.name)
    if kind.build_payload is not None:
        # An approved query: its answer for the operator (`medfed query run`), with the
        # noisy sum and noise it was decoded from.
        queries.keep_answer(
            settings.state, release,
            release.manifest().decode_integers(aggregate)[release.name],
            noise_sigmas=sum_noise_sigmas(release, contributors=contributors,
                                          noise_sites=noise_sites),
            contributors=contributors, round_number=ann.round_number, answer=decoded)
    elif keep is not None:
        keep(run, decoded, ann.round_number)
    else:
        keep_json(settings.state, release, decoded, ann.round_number)
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
    clock: Callable[[], float], observer: RoundObserver | None = None,
) -> RoundResult:
    """Decode (worker thread), then record the release round."""
    result = await asyncio.to_thread(decode, rnd, aggregator, run=run, settings=settings,
                                     observer=observer)
    record(result, kind=rnd.announcement.release, store=store, metrics=metrics, now=clock())
    return result
