"""The study as operators see it (`medfed status`, the Monitor/Status RPC): the
statistics round, training round k of N and the final evaluation round, each named for
what it is; the phase, each site's state and reported budget, and an ETA.

Read-only and computed on demand from what the coordinator already holds (sessions,
the round in flight, the state database): asking for status never changes a round.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from common.commands.status import FAILED_PHASE_PREFIX
from coordinator.phases import SILENT_AFTER_INTERVALS, ActiveRound
from coordinator.sessions import SiteSession
from coordinator.store import RoundRecord

DISCONNECTED_AFTER_SECONDS = 90.0
"""A site silent for longer than this counts as disconnected: agents re-poll at least
every 60 s (the server's long-poll cap) plus RPC slack."""

REPOLL_GRACE_SECONDS = 35.0
"""A site that neither waits in a long-poll nor called for this long has stopped asking
for rounds (`gone`: it exited, say after `--once`): an agent polls again at once after
a round or an answer, and within its reconnect backoff (30 s at most by default) after
an error."""

ETA_WINDOW = 5
"""Completed rounds the ETA's median round duration is taken over (recent rounds
reflect the current sites and network)."""

SITE_STATES = ("waiting", "enrolled", "in_round", "silent", "declined", "exhausted", "gone",
               "disconnected")
"""`silent`: selected for the round in flight and expected in its phase, but no heartbeat
or message for 1.5 heartbeat intervals (frozen or cut off: it is dropped after
`heartbeat_misses` intervals); or between rounds, holding a long-poll (or one that
just timed out, which a live agent renews at once) whose heartbeats stopped for 1.5
intervals, until it counts as `disconnected`. `gone`: it took part, then stopped asking
for rounds (not polling, no call for REPOLL_GRACE_SECONDS), e.g. an agent that exited
after `--once`.
`enrolled`: enrolled but has not asked for a round since. A site that refuses the
study (a data error, or a study asking more epsilon than its policy allows) stops right
after enrolling and says nothing more (the protocol has no message for it; the reason
is in the site's own log), so it shows as `enrolled`, then `disconnected`; a site
restarted in a loop by its container runtime stays `enrolled`."""
STATISTICS_STATES = ("none", "pending", "completed")

ROUND_KINDS = ("statistics", "training", "evaluation")


@dataclass(frozen=True)
class SiteView:
    site_id: str
    state: str  # one of SITE_STATES
    last_contact: float | None  # unix seconds
    epsilon_spent: float
    epsilon_budget: float
    privacy_unit: str


@dataclass(frozen=True)
class AucReading:
    """A round's DP AUC with its 95% interval (common.releases.evaluation_interval.auc_interval; the
    interval NaN for a round recorded without one)."""

    round_number: int
    auc: float
    low: float
    high: float


def last_auc(records: Sequence[RoundRecord]) -> AucReading | None:
    """The DP AUC of the last completed round that evaluated, from its stored metrics."""
    for record in reversed(records):
        auc = record.metrics.get("auc") if record.status == "completed" else None
        if isinstance(auc, int | float) and math.isfinite(auc):
            low, high = (record.metrics.get(k) for k in ("auc_interval_low", "auc_interval_high"))
            return AucReading(
                record.round_number, float(auc),
                float(low) if isinstance(low, int | float) else math.nan,
                float(high) if isinstance(high, int | float) else math.nan,
            )
    return None


@dataclass(frozen=True)
class StudyStatus:
    """`total_rounds` = `training_rounds` + the evaluation round (if any); the statistics
    round is apart (`statistics_round`), in neither total nor `completed_rounds`."""

    total_rounds: int
    completed_rounds: int
    aborted_rounds: int
    current_round: int  # 0: no round in flight
    phase: str
    finished: bool
    sites: tuple[SiteView, ...]
    eta_seconds: float | None
    now: float
    training_rounds: int = 0
    evaluation_round: bool = False
    statistics_round: str = "none"  # one of STATISTICS_STATES
    current_kind: str = ""  # one of ROUND_KINDS while a round is in flight
    auc: AucReading | None = None  # the last completed round's DP AUC, if any


def stopped_beating(session: SiteSession, *, now: float) -> bool:
    """Between rounds: the site's long-poll is open (or just timed out) and promised
    heartbeats, and nothing came from the site for SILENT_AFTER_INTERVALS intervals."""
    return session.stopped_beating(now=now, intervals=SILENT_AFTER_INTERVALS)


def site_state(session: SiteSession, rnd: ActiveRound | None, *, now: float) -> str:
    """One word for what a site is doing (see SITE_STATES; `rnd`: the round in flight,
    if any); the first rule that applies wins."""
    if rnd is not None and session.site_id in rnd.announcement.participants:
        if session.site_id in rnd.declined:
            return "declined"
        return "silent" if rnd.is_silent(session.site_id, time.monotonic()) else "in_round"
    if session.budget.out_of_budget:
        return "exhausted"
    if stopped_beating(session, now=now):
        disconnected = now - (session.last_contact or 0.0) > DISCONNECTED_AFTER_SECONDS
        return "disconnected" if disconnected else "silent"
    if session.is_waiting:
        return "waiting"
    if session.last_contact is None or now - session.last_contact > DISCONNECTED_AFTER_SECONDS:
        return "disconnected"
    if not session.polled:
        return "enrolled"
    if session.declined_round is not None:
        return "declined"
    if now - session.last_contact > REPOLL_GRACE_SECONDS:
        return "gone"  # no poll open and none for longer than an agent waits to re-poll
    return "waiting"  # between two long-polls


def eta_seconds(
    records: Sequence[RoundRecord], *, total_rounds: int, rnd: ActiveRound | None,
    round_started: float | None, now: float,
) -> float | None:
    """Remaining rounds times the median duration of the latest completed rounds, less
    the time the round in flight has already run; None before any round completed."""
    done = [r for r in records if r.status == "completed" and r.finished_at is not None]
    remaining = total_rounds - len(done)
    if remaining <= 0:
        return 0.0
    if not done:
        return None
    recent = [r.finished_at - r.started_at for r in done[-ETA_WINDOW:] if r.finished_at]
    per_round = statistics.median(recent)
    elapsed = now - round_started if (rnd is not None and round_started is not None) else 0.0
    return max(remaining * per_round - min(elapsed, per_round), 0.0)


def study_status(
    sessions: Sequence[SiteSession], records: Sequence[RoundRecord], *,
    rnd: ActiveRound | None, training_rounds: int, evaluation_round: bool,
    statistics_pending: bool, finished: bool, now: float, failure: str | None = None,
) -> StudyStatus:
    """`statistics_pending`: the study still needs its statistics round (a completed one
    is read from `records`, status "statistics"). `failure`: why the study ended
    unfinished; the phase then reads ``failed: <why>`` (FAILED_PHASE_PREFIX)."""
    total_rounds = training_rounds + (1 if evaluation_round else 0)
    completed = sum(1 for r in records if r.status == "completed")
    aborted = sum(1 for r in records if r.status == "aborted")
    statistics = (
        "completed" if any(r.status == "statistics" for r in records)
        else "pending" if statistics_pending else "none"
    )
    in_flight = rnd is not None and rnd.phase.value not in ("finished", "aborted")
    kind = ""
    if in_flight and rnd is not None:
        # A release round is named by its release ("statistics", ...).
        kind = rnd.announcement.release or (
            "training" if completed < training_rounds else "evaluation")
    started = None
    if rnd is not None:
        started = next((r.started_at for r in records if r.round_number == rnd.number), None)
    if finished:
        phase = "finished"
    elif failure is not None:
        phase = FAILED_PHASE_PREFIX + failure
    elif in_flight and rnd is not None:
        phase = rnd.phase.value
    else:
        phase = "selecting"
    sites = tuple(
        SiteView(
            site_id=s.site_id,
            state=site_state(s, rnd if in_flight else None, now=now),
            last_contact=s.last_contact,
            epsilon_spent=s.budget.spent_epsilon,
            epsilon_budget=s.budget.budget_epsilon,
            privacy_unit=s.budget.privacy_unit,
        )
        for s in sorted(sessions, key=lambda s: s.site_id)
    )
    return StudyStatus(
        total_rounds=total_rounds,
        completed_rounds=completed,
        aborted_rounds=aborted,
        current_round=rnd.number if (in_flight and rnd is not None) else 0,
        phase=phase,
        finished=finished,
        sites=sites,
        # A pending statistics round is one more round to wait for.
        eta_seconds=0.0 if finished else None if failure is not None else eta_seconds(
            records, total_rounds=total_rounds + (statistics == "pending"),
            rnd=rnd if in_flight else None, round_started=started, now=now,
        ),
        now=now,
        training_rounds=training_rounds,
        evaluation_round=evaluation_round,
        statistics_round=statistics,
        current_kind=kind,
        auc=last_auc(records),
    )
