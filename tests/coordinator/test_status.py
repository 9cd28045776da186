"""`medfed status` arithmetic: each site's state word and the ETA (coordinator/status.py).
The RPC itself is exercised over real mTLS in tests/e2e/test_study_lifecycle.py."""

from __future__ import annotations

from common.round import SiteBudget
from coordinator.sessions import SiteSession
from coordinator.status import DISCONNECTED_AFTER_SECONDS, eta_seconds, site_state, study_status
from coordinator.store import RoundRecord

NOW = 1_000_000.0


def record(number: int, status: str, started: float, finished: float | None) -> RoundRecord:
    return RoundRecord(round_number=number, status=status, started_at=started,
                       finished_at=finished, participants=("a",), survivors=(), dropped=(),
                       detail="", metrics={})


def session(**fields: object) -> SiteSession:
    s = SiteSession("a", b"")
    for key, value in fields.items():
        setattr(s, key, value)
    return s


def test_site_states_between_rounds() -> None:
    assert site_state(session(last_contact=NOW - 5), None, now=NOW) == "waiting"
    silent = NOW - DISCONNECTED_AFTER_SECONDS - 1
    assert site_state(session(last_contact=silent), None, now=NOW) == "disconnected"
    assert site_state(session(last_contact=None), None, now=NOW) == "disconnected"
    assert site_state(session(last_contact=NOW, declined_round=4), None, now=NOW) == "declined"
    spent = SiteBudget(epsilon_budget=4.0, epsilon_spent=4.0)
    assert site_state(session(last_contact=NOW, budget=spent), None, now=NOW) == "exhausted"


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
    status = study_status([session(last_contact=NOW)], records, rnd=None, total_rounds=2,
                          finished=True, now=NOW)
    assert (status.completed_rounds, status.aborted_rounds) == (2, 1)
    assert status.phase == "finished" and status.finished and status.eta_seconds == 0
    assert [s.state for s in status.sites] == ["waiting"]
    selecting = study_status([], records[:1], rnd=None, total_rounds=2, finished=False,
                             now=NOW)
    assert selecting.phase == "selecting" and selecting.current_round == 0
    assert selecting.eta_seconds == 10
