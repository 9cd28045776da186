"""`medfed status` arithmetic: each site's state word and the ETA (coordinator/status.py).
The RPC itself is exercised over real mTLS in tests/e2e/test_study_lifecycle.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from common.commands.status import render
from common.privacy.budget import BudgetReport
from common.releases.seam import KIND_STATISTICS, KIND_TRAINING
from coordinator.phases import ActiveRound, Liveness, RoundPhase
from coordinator.sessions import SiteSession
from coordinator.status import (
    DISCONNECTED_AFTER_SECONDS,
    REPOLL_GRACE_SECONDS,
    StudyStatus,
    eta_seconds,
    site_state,
    study_status,
)
from coordinator.store import RoundRecord
from tests.coordinator.test_phases import announcement

NOW = 1_000_000.0


def record(number: int, status: str, started: float, finished: float | None) -> RoundRecord:
    return RoundRecord(round_number=number, status=status, started_at=started,
                       finished_at=finished, participants=("a",), survivors=(), dropped=(),
                       detail="", metrics={})


def session(**fields: object) -> SiteSession:
    s = SiteSession("a", b"")
    s.polled = True  # a site that has long-polled since it enrolled, unless told
    for key, value in fields.items():
        setattr(s, key, value)
    return s


def test_site_states_between_rounds() -> None:
    assert site_state(session(last_contact=NOW - 5), None, now=NOW) == "waiting"
    silent = NOW - DISCONNECTED_AFTER_SECONDS - 1
    assert site_state(session(last_contact=silent), None, now=NOW) == "disconnected"
    assert site_state(session(last_contact=None), None, now=NOW) == "disconnected"
    assert site_state(session(last_contact=NOW, declined_round=4), None, now=NOW) == "declined"
    spent = BudgetReport(budget_epsilon=4.0, spent_epsilon=4.0)
    assert site_state(session(last_contact=NOW, budget=spent), None, now=NOW) == "exhausted"


def test_a_site_that_stopped_polling_is_gone_not_waiting() -> None:
    """An agent run with `--once` exits after its round: no poll open, no call since."""
    assert site_state(session(last_contact=NOW - 1), None, now=NOW) == "waiting"
    left = NOW - REPOLL_GRACE_SECONDS - 1
    assert site_state(session(last_contact=left), None, now=NOW) == "gone"


def test_a_silent_participant_is_shown_silent_and_a_beating_one_in_round() -> None:
    """In a heartbeat phase, a participant not heard for 1.5 intervals is
    `silent` (frozen or cut off), one that beats is `in_round`; one that has sent its
    phase's message is `in_round` whatever it does next."""
    interval = 5.0
    rnd = ActiveRound(announcement(secure=False), b"", liveness=Liveness(interval, 3))
    state = rnd.open_phase(RoundPhase.MASKED_INPUT, set(rnd.announcement.participants))
    now = time.monotonic()
    state.opened_at = now - 3 * interval  # the phase has been open three intervals
    rnd.last_heard["alpha"] = now  # beating
    state.mark("gamma")  # uploaded, then went quiet: its phase is done
    states = {site: site_state(session(site_id=site, last_contact=NOW), rnd, now=NOW)
              for site in ("alpha", "beta", "gamma")}
    assert states == {"alpha": "in_round", "beta": "silent", "gamma": "in_round"}


def test_eta_is_unknown_before_a_round_completes_then_median_based() -> None:
    assert eta_seconds([], total_rounds=3, rnd=None, round_started=None, now=NOW) is None
    done = [record(1, "completed", 0, 10), record(2, "aborted", 10, 11),
            record(3, "completed", 20, 50), record(4, "completed", 50, 70)]
    # Median of 10, 30, 20 s = 20 s per round; 2 of 5 rounds remain.
    assert eta_seconds(done, total_rounds=5, rnd=None, round_started=None, now=NOW) == 40
    assert eta_seconds(done, total_rounds=3, rnd=None, round_started=None, now=NOW) == 0


def test_study_status_counts_rounds_and_reports_finished() -> None:
    records = [record(1, "completed", 0, 10), record(2, "aborted", 10, 12),
               record(3, "completed", 12, 20)]
    status = study_status([session(last_contact=NOW)], records, rnd=None, training_rounds=2,
                          evaluation_round=False, statistics_pending=False, finished=True,
                          now=NOW)
    assert (status.completed_rounds, status.aborted_rounds) == (2, 1)
    assert status.phase == "finished" and status.finished and status.eta_seconds == 0
    assert [s.state for s in status.sites] == ["waiting"]
    selecting = study_status([], records[:1], rnd=None, training_rounds=2,
                             evaluation_round=False, statistics_pending=False, finished=False,
                             now=NOW)
    assert selecting.phase == "selecting" and selecting.current_round == 0
    assert selecting.eta_seconds == 10


def _in_flight(number: int, *, statistics: bool = False) -> ActiveRound:
    ann = dataclasses.replace(announcement(), round_number=number,
                              kind=KIND_STATISTICS if statistics else KIND_TRAINING)
    rnd = ActiveRound(ann, b"")
    rnd.phase = RoundPhase.SHARE_KEYS
    return rnd


def _as_cli(status: StudyStatus) -> dict[str, Any]:
    """What `medfed status` renders: the RPC's fields, as `fetch_status` returns them."""
    return {"federation_id": "f", "finished": status.finished, "phase": status.phase,
            "current_round": status.current_round, "completed_rounds": status.completed_rounds,
            "aborted_rounds": status.aborted_rounds, "total_rounds": status.total_rounds,
            "training_rounds": status.training_rounds,
            "evaluation_round": status.evaluation_round,
            "statistics_round": status.statistics_round, "current_kind": status.current_kind,
            "eta_seconds": status.eta_seconds, "sites": []}


def test_status_names_the_statistics_training_and_evaluation_rounds() -> None:
    """A study of 2 training rounds and a final evaluation: the statistics round is
    named apart and never counted as a training round; "k of N" counts training only."""
    def status(records: list[RoundRecord], rnd: ActiveRound | None, *, pending: bool = False,
               finished: bool = False) -> StudyStatus:
        return study_status([], records, rnd=rnd, training_rounds=2, evaluation_round=True,
                            statistics_pending=pending, finished=finished, now=NOW)

    stats = status([], _in_flight(1, statistics=True), pending=True)
    assert (stats.current_kind, stats.statistics_round, stats.total_rounds) == (
        "statistics", "pending", 3)
    text = render(_as_cli(stats))
    assert "the statistics round in flight (round number 1" in text
    assert "statistics round to come, 0 of 2 training rounds completed, " \
        "final evaluation round to come" in text

    records = [record(1, "statistics", 0, 5), record(2, "completed", 5, 15)]
    training = status(records, _in_flight(3))
    assert (training.current_kind, training.statistics_round) == ("training", "completed")
    assert "training round 2 of 2 in flight (round number 3" in render(_as_cli(training))
    # Two rounds remain (training 2, evaluation); the statistics round is not one of them.
    assert training.eta_seconds == 20

    records += [record(3, "completed", 15, 25)]
    evaluation = status(records, _in_flight(4))
    assert evaluation.current_kind == "evaluation"
    assert "the final evaluation round in flight" in render(_as_cli(evaluation))

    records += [record(4, "completed", 25, 30)]
    done = status(records, None, finished=True)
    assert (done.completed_rounds, done.total_rounds, done.training_rounds) == (3, 3, 2)
    assert render(_as_cli(done)).splitlines()[0] == (
        "federation f: study finished: statistics round completed, 2 of 2 training rounds "
        "completed, final evaluation round completed")


def _site_row(state: str, *, budget: float = 0.0, spent: float = 0.0) -> dict[str, Any]:
    return {"site_id": "a", "state": state, "last_contact_seconds_ago": 12.0,
            "epsilon_spent": spent, "epsilon_budget": budget, "privacy_unit": "patient"}


def test_a_site_that_enrolled_but_never_polled_is_not_shown_waiting() -> None:
    """A site that refused the study (data error, epsilon above its policy) stops right
    after Enroll: the protocol carries no reason, so status must not call it
    `waiting` (review); it shows `enrolled`, its last contact, and what that means."""
    refused = session(last_contact=NOW - 5, polled=False)
    assert site_state(refused, None, now=NOW) == "enrolled"
    silent = NOW - DISCONNECTED_AFTER_SECONDS - 1
    assert site_state(session(last_contact=silent, polled=False), None, now=NOW) == (
        "disconnected")
    status = study_status([refused], [], rnd=None, training_rounds=2, evaluation_round=False,
                          statistics_pending=False, finished=False, now=NOW)
    assert [s.state for s in status.sites] == ["enrolled"]
    text = render({**_as_cli(status), "sites": [_site_row("enrolled")]})
    assert "enrolled" in text and "12s ago" in text
    assert "refuses the study" in text and "its own log says why" in text


def test_no_budget_reported_does_not_read_as_no_dp() -> None:
    """Before a site joins the study and opens its ledger it reports no budget: that is
    "nothing spent yet", not "no DP ledger" (which read as "this site does not use DP")."""
    status = study_status([], [], rnd=None, training_rounds=1, evaluation_round=False,
                          statistics_pending=False, finished=False, now=NOW)
    text = render({**_as_cli(status), "sites": [_site_row("waiting")]})
    assert "nothing spent yet" in text and "no DP" not in text
    spent = render({**_as_cli(status), "sites": [_site_row("waiting", budget=3, spent=0.5)]})
    assert "0.500 / 3 (patient)" in spent and "enrolled:" not in spent


def test_a_failed_study_says_why_instead_of_an_eta() -> None:
    records = [record(1, "completed", 0, 10), record(2, "aborted", 10, 12)]
    failed = study_status([session(last_contact=NOW)], records, rnd=None, training_rounds=1,
                          evaluation_round=True, statistics_pending=False, finished=False,
                          now=NOW, failure="the final evaluation round cannot run: why")
    assert failed.phase == "failed: the final evaluation round cannot run: why"
    assert not failed.finished and failed.eta_seconds is None
    head = render(_as_cli(failed)).splitlines()[0]
    assert head == (
        "federation f: study FAILED: the final evaluation round cannot run: why; 1 of 1 "
        "training rounds completed, final evaluation round to come")
    assert "ETA" not in head


def test_status_shows_the_last_dp_auc_with_its_interval() -> None:
    """The last completed round's DP AUC, with its 95% interval; "too noisy to read"
    when the interval is wider than 0.5; nothing before any evaluation."""
    def evaluated(number: int, auc: float, low: float, high: float) -> RoundRecord:
        return dataclasses.replace(
            record(number, "completed", number, number + 1),
            metrics={"auc": auc, "auc_interval_low": low, "auc_interval_high": high})

    def shown(records: list[RoundRecord]) -> tuple[StudyStatus, str]:
        status = study_status([], records, rnd=None, training_rounds=3,
                              evaluation_round=False, statistics_pending=False,
                              finished=False, now=NOW)
        reading = status.auc
        cli = {**_as_cli(status), "dp_auc": None if reading is None else {
            "round": reading.round_number, "auc": reading.auc,
            "interval_low": reading.low, "interval_high": reading.high}}
        return status, render(cli)

    status, text = shown([record(1, "completed", 0, 1)])
    assert status.auc is None and "DP-evaluated AUC" not in text
    status, text = shown([evaluated(1, 0.7, 0.1, 0.9), evaluated(2, 0.912, 0.85, 0.97),
                          record(3, "aborted", 3, 4)])
    assert status.auc is not None and status.auc.round_number == 2
    assert "DP-evaluated AUC after round 2: 0.912 (95% interval 0.850-0.970)" in text
    _, text = shown([evaluated(1, 0.437, 0.05, 0.93)])
    assert "DP-evaluated AUC after round 1: too noisy to read (DP estimate 0.44, " \
           "95% interval 0.05-0.93)" in text


def test_a_waiting_site_whose_heartbeats_stopped_is_silent_not_waiting() -> None:
    """Between rounds an agent beats every interval while its long-poll is open: one
    not heard for 1.5 intervals is frozen or cut off (`silent`), also once its poll timed
    out unrenewed, until it counts as disconnected; an agent that promised no beats
    stays `waiting`, and one whose poll was answered and that then left is `gone`."""
    loop = asyncio.new_event_loop()
    try:
        def polling(**fields: object) -> SiteSession:
            return session(waiting=loop.create_future(), **fields)

        beats = {"beat_seconds": 2.0}
        assert site_state(polling(last_contact=NOW - 2.9, **beats), None, now=NOW) == "waiting"
        assert site_state(polling(last_contact=NOW - 3.1, **beats), None, now=NOW) == "silent"
        assert site_state(polling(last_contact=NOW - 3.1), None, now=NOW) == "waiting"
        lapsed = {"poll_lapsed": True, **beats}
        assert site_state(session(last_contact=NOW - 3.1, **lapsed), None, now=NOW) == "silent"
        late = NOW - DISCONNECTED_AFTER_SECONDS - 1
        assert site_state(session(last_contact=late, **lapsed), None, now=NOW) == "disconnected"
        left = NOW - REPOLL_GRACE_SECONDS - 1
        assert site_state(session(last_contact=left, **beats), None, now=NOW) == "gone"
    finally:
        loop.close()
