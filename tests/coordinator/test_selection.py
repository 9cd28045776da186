"""Pure selection decisions (`coordinator.selection`) and round numbering."""

from __future__ import annotations

import pytest

from common.core.config import AggregationSection
from common.privacy.budget import BudgetReport
from coordinator import selection
from coordinator.engine import RoundEngine


def test_round_numbers_continue_after_the_sites_ledgers_on_a_fresh_coordinator(
    engine: RoundEngine,
) -> None:
    """A coordinator started on empty (or restored, older) state must not reuse round
    numbers its sites have already spent budget on: they would refuse those rounds."""
    assert engine.next_round_number(["alpha", "beta"]) == 1
    engine.sites.enroll("alpha", b"", serial="1", version="t", device="cpu",
                        budget=BudgetReport(budget_epsilon=8, spent_epsilon=3,
                                            ledger_entries=7, last_round=7))
    engine.sites.enroll("beta", b"", serial="2", version="t", device="cpu",
                        budget=BudgetReport(budget_epsilon=8, spent_epsilon=1,
                                            ledger_entries=2, last_round=2))
    assert engine.next_round_number(["alpha", "beta"]) == 8
    assert engine.next_round_number(["beta"]) == 3
    engine.store.begin_round(11, ["alpha", "beta"], now=0.0)
    assert engine.next_round_number(["alpha", "beta"]) == 12  # the store's own record


def test_next_round_number_is_pure() -> None:
    assert selection.next_round_number(recorded_next=1, ledger_last_rounds=[]) == 1
    assert selection.next_round_number(recorded_next=4, ledger_last_rounds=[None, 9]) == 10
    assert selection.next_round_number(recorded_next=12, ledger_last_rounds=[3]) == 12


def _row(site: str, *, spent: float, budget: float) -> BudgetReport:
    return BudgetReport(budget, spent, 1e-5, "record", exhausted=spent >= budget,
                        ledger_entries=1, ledger_head="ab" * 32, last_round=1, site_id=site)


def test_with_budget_keeps_order_and_skips_exhausted_reports() -> None:
    reports = {
        "a": BudgetReport(),
        "b": BudgetReport(exhausted=True),
        "c": BudgetReport(budget_epsilon=4.0, spent_epsilon=4.0),
        "d": BudgetReport(),
    }
    chosen = selection.with_budget(["d", "a", "b", "c"], reports=reports, view={},
                                   evaluation_round=False)
    assert chosen == ["d", "a"]
    everyone = selection.with_budget(["d", "a", "b", "c"], reports=reports, view={},
                                     evaluation_round=True)
    assert everyone == ["d", "a", "b", "c"]  # the evaluation round spends no budget


def test_with_budget_follows_the_federation_view() -> None:
    """A recorded spend governs even when the site's own report looks fresh."""
    view = {"a": _row("a", spent=8.0, budget=8.0), "b": _row("b", spent=1.0, budget=8.0)}
    reports = {"a": BudgetReport(), "b": BudgetReport(), "c": BudgetReport()}
    assert selection.with_budget(["a", "b", "c"], reports=reports, view=view,
                                 evaluation_round=False) == ["b", "c"]


@pytest.mark.parametrize("n_sites", [3, 5, 10, 40])
def test_round_parameters_follow_the_threat_model(n_sites: int) -> None:
    threshold, neighbours = selection.round_parameters(n_sites, AggregationSection())
    assert 2 <= threshold <= n_sites
    assert neighbours == 0 or neighbours < n_sites
    assert selection.round_parameters(
        n_sites, AggregationSection(secure_aggregation=False)
    ) == (0, 0)


def test_one_sites_report_moves_the_numbering_only_within_the_window() -> None:
    """`round_ceiling`: a report up to ROUND_WINDOW past the record is followed alone;
    beyond it only when `quorum` sites report that far, and never further than the
    quorum-th largest report. A report of a round the coordinator ran itself moves
    nothing."""
    from coordinator.store import ROUND_WINDOW

    def ceiling(reports: dict[str, int | None], *, ran: frozenset[int] = frozenset(),
                quorum: int = 2) -> tuple[int, dict[str, int]]:
        return selection.round_ceiling(recorded_next=11, reports=reports, ran=ran,
                                       window=ROUND_WINDOW, quorum=quorum)

    limit = 10 + ROUND_WINDOW
    assert ceiling({"a": 7, "b": None, "c": limit}) == (limit, {})
    lie = 2**53 - 2
    assert ceiling({"a": 7, "liar": lie}) == (limit, {"liar": lie})
    assert ceiling({"a": limit + 1}) == (limit, {"a": limit + 1})
    # A coordinator restored from an old backup: every site that trained since is
    # ahead; two agree, so the numbering follows them (the liar still does not count).
    assert ceiling({"a": 5000, "b": 5000, "c": 4990, "liar": lie}) == (5000, {"liar": lie})
    # Two liars against a quorum of three (max_colluding_sites = 2): refused.
    assert ceiling({"x": lie, "y": lie, "a": 9}, quorum=3) == (limit, {"x": lie, "y": lie})
    assert ceiling({"a": 2**40}, ran=frozenset({2**40})) == (limit, {})
    assert selection.next_round_number(
        recorded_next=11, ledger_last_rounds=[7, lie, None], ceiling=limit) == 11
    assert selection.next_round_number(
        recorded_next=11, ledger_last_rounds=[7, 500], ceiling=limit) == 501


def test_recorded_next_round_skips_an_old_lie_and_keeps_a_recorded_jump() -> None:
    from coordinator.store import recorded_next_round

    assert recorded_next_round([], floor=0, window=1000) == 1
    assert recorded_next_round([1, 2, 3, 700, 701], floor=0, window=1000) == 702
    # Round 2^53 - 1 after round 3: numbered after one site's lie, before reports were
    # bounded; numbering resumes after round 3 (above it every number stays used).
    assert recorded_next_round([1, 2, 3, 2**53 - 1], floor=0, window=1000) == 4
    assert recorded_next_round([1, 2, 2**40, 2**40 + 1], floor=0, window=1000) == 3
    # A corroborated jump is recorded as the floor: kept, and what follows it too.
    assert recorded_next_round([1, 2, 5001, 5002], floor=5001, window=1000) == 5003
    assert recorded_next_round([1, 2], floor=5001, window=1000) == 5002


def test_engine_follows_corroborated_reports_and_refuses_a_lone_liar(
    engine: RoundEngine,
) -> None:
    """Over the real store: a lone report far ahead is refused (StateError, the site's
    FAILED_PRECONDITION) and not followed; once a second site reports as far, both are
    accepted, the round is numbered after them and the jump survives a reopened store."""
    from common.core.errors import StateError
    from coordinator.store import ROUND_FLOOR_KEY, CoordinatorStore

    def enroll(site: str, last_round: int) -> None:
        engine.sites.enroll(site, b"", serial=site, version="t", device="cpu",
                            budget=BudgetReport(budget_epsilon=8, spent_epsilon=1,
                                                ledger_entries=3, last_round=last_round))

    engine.store.begin_round(1, ["alpha", "beta"], now=0.0)
    with pytest.raises(StateError, match="ledger_last_round 5000 is more than 1000 rounds"):
        enroll("alpha", 5000)
    assert engine.eligible(["alpha"], kind="training") == []
    assert engine.next_round_number(["alpha"]) == 2
    enroll("beta", 5000)  # corroborates alpha's ledger: accepted
    engine.sessions.refuse_outlier("alpha")  # and alpha's next call is served
    assert engine.eligible(["alpha", "beta"], kind="training") == ["alpha", "beta"]
    assert engine.next_round_number(["alpha", "beta"]) == 5001
    engine.store.begin_round(5001, ["alpha", "beta"], now=1.0)
    assert engine.store.get_meta(ROUND_FLOOR_KEY) == "5001"
    reopened = CoordinatorStore(engine.store.url)
    try:
        assert reopened.next_round_number() == 5002
    finally:
        reopened.close()
