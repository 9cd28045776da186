"""A round that carries one DP release alone (`common.releases.seam`), such as the study's
statistics round once per study before training, or an approved query: the noisy secure
sum of every site's contribution (distributed discrete Gaussian, Kairouz, Liu & Steinke,
ICML 2021) is decoded by the release (`common.releases.seam.read_sum`) and kept by the
round's kind (`coordinator.round_kinds`: the statistics become the GlobalStatistics
every site then preprocesses with, a query's answer is written for the operator); any
other release's value is written as JSON under STATE/releases/ (`keep_json`). Such a
round updates no model and writes no checkpoint."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from common.core.config import CoordinatorSettings
from common.core.errors import AbortReason, ProtocolAbort
from common.core.fileio import atomic_write
from common.core.observer import NoObserver, RoundObserver
from common.releases.seam import (
    DecodedSum,
    DpRelease,
    build_release,
    read_sum,
    release_for_round,
    study_noise_sites,
)
from coordinator.aggregation import Aggregator
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import ActiveRound
from coordinator.store import CoordinatorStore
from coordinator.study_run import StudyRun
from coordinator.training_round import RoundResult

RELEASES_DIR = "releases"

Keeper = Callable[[DpRelease, DecodedSum, int], None]
"""What the coordinator does with a release round's decoded sum (the release, what was
read of its sum, the round number): its round kind's, else `keep_json`."""


def keep_json(state: Path, release: DpRelease, decoded: Any, round_number: int) -> Path:
    """A release's decoded value as JSON (`DpRelease.to_json`), written atomically to
    STATE/releases/<name>-round-<n>.json."""
    path = state / RELEASES_DIR / f"{release.name}-round-{round_number:06d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(
        {"release": release.name, "round": round_number, "value": release.to_json(decoded)},
        indent=2, sort_keys=True).encode())
    return path


def decode(
    rnd: ActiveRound, aggregator: Aggregator, *, run: StudyRun | None,
    settings: CoordinatorSettings, observer: RoundObserver | None = None,
    keep: Keeper | None = None,
) -> RoundResult:
    """Decode the release and keep it (worker thread): `keep`, else as JSON under
    STATE (`keep_json`); `observer` is shown the unmasked sum first
    (`common.core.observer`)."""
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
    # The study's pinned terms: the n_noise every member sized its noise share by.
    decoded = read_sum(
        release, aggregate, contributors=len(aggregator.survivors),
        noise_sites=study_noise_sites(run.study), round_number=ann.round_number,
    )
    if keep is not None:
        keep(release, decoded, ann.round_number)
    else:
        keep_json(settings.state, release, decoded.value, ann.round_number)
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
    keep: Keeper | None = None,
) -> RoundResult:
    """Decode and keep (worker thread), then record the release round."""
    result = await asyncio.to_thread(decode, rnd, aggregator, run=run, settings=settings,
                                     observer=observer, keep=keep)
    record(result, kind=rnd.announcement.release, store=store, metrics=metrics, now=clock())
    return result
