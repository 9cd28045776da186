"""What a round tells the operator: a log line and metrics when a phase closes, when
the round completes and when it aborts. The demo and the soak read these events, so
their fields are part of the coordinator's interface."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from common.releases.evaluation_interval import interval_text
from common.rounds.announcement import Announcement
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import ActiveRound, PhaseClosed
from coordinator.store import CoordinatorStore

log = logging.getLogger("medfed.coordinator")


def phase_closed(
    rnd: ActiveRound, closed: PhaseClosed, *, metrics: CoordinatorMetrics, heartbeat_misses: int
) -> None:
    """Log the sites a phase dropped (silent or late) and record its duration."""
    name = closed.phase.value
    if closed.silent:
        log.info(
            "round %d %s: dropping %s (no heartbeat for %d intervals)", rnd.number, name,
            list(closed.silent), heartbeat_misses,
            extra={"event": "sites_silent", "round_number": rnd.number, "phase": name,
                   "sites": ",".join(closed.silent)},
        )
    late = sorted(set(closed.missing) - set(closed.silent))
    if late:
        log.info("round %d %s deadline: dropping %s", rnd.number, name, late)
    if closed.missing:
        metrics.dropouts_total.labels(phase=name).inc(len(closed.missing))
    metrics.phase_seconds.labels(phase=name).observe(closed.seconds)
    log.debug("round %d %s closed after %.4f s", rnd.number, name, closed.seconds)


def round_opened(ann: Announcement) -> None:
    log.info(
        "round %d open: %d sites, threshold %d, neighbours %d, secure=%s",
        ann.round_number, len(ann.participants), ann.threshold, ann.neighbours,
        ann.secure_aggregation,
    )


def round_aborted(
    ann: Announcement, reason: str, *, store: CoordinatorStore, metrics: CoordinatorMetrics,
    now: float,
) -> None:
    """Log the abort, record the round as aborted and count it."""
    log.warning(
        "round %d aborted: %s", ann.round_number, reason,
        extra={"event": "round_aborted", "round_number": ann.round_number,
               "participants": ",".join(ann.participants), "reason": reason},
    )
    store.finish_round(ann.round_number, status="aborted", now=now, detail=reason)
    metrics.rounds_total.labels(outcome="aborted").inc()


def round_completed(
    rnd: ActiveRound,
    *,
    survivors: Sequence[str],
    dropped: Sequence[str],
    metrics: dict[str, float],
    seconds: float,
    cpu_seconds: float,
    statistics: bool,
) -> None:
    ann = rnd.announcement
    extra: dict[str, Any] = {
        "event": "round_completed",
        "round_number": ann.round_number,
        "participants": ",".join(ann.participants),
        "survivors": ",".join(survivors),
        "dropped": ",".join(dropped),
        "dropped_after_input": ",".join(sorted(rnd.dropped_after_input)),
        "kind": (ann.release or "statistics") if statistics else "training",
        "evaluation_only": ann.local_epochs == 0,
        **metrics,
        "secure": ann.secure_aggregation,
        "round_seconds": round(seconds, 6),
        # Idle time after a phase's last message until its deadline dropped
        # the missing sites (see ActiveRound.deadline_wait_seconds).
        "deadline_wait_seconds": round(rnd.deadline_wait_seconds, 6),
        # The coordinator process's CPU time over the round (all threads).
        "cpu_seconds": round(cpu_seconds, 6),
        # When each step happened, as if dropped sites were detected at once
        # (ActiveRound.mark): "<phase>.first"/".last" message accepted, ".closed".
        **{f"t_{step}": round(seconds, 6) for step, seconds in rnd.timeline.items()},
    }
    auc = metrics.get("auc")
    evaluation = "no DP evaluation" if auc is None else "DP-evaluated AUC " + (
        interval_text(auc, metrics["auc_interval_low"], metrics["auc_interval_high"])
        if "auc_interval_low" in metrics and "auc_interval_high" in metrics
        else f"{auc:.3f}")
    if auc is not None and "auc_noise_std" in metrics:
        # common.releases.evaluation.denoised_histogram: how far the DP noise lets the AUC be
        # trusted.
        evaluation += (
            f" (noise std {metrics['auc_noise_std']:.3g} per count"
            + (f", {int(metrics['auc_buckets'])} buckets" if "auc_buckets" in metrics else "")
            + (", noise-dominated)" if metrics.get("auc_noise_dominated") else ")")
        )
    log.info(
        "round %d completed: %d contributors, %d dropped, %.2f s, %s",
        ann.round_number, len(survivors), len(dropped), seconds, evaluation,
        extra=extra,
    )
