"""Pure selection decisions (`coordinator.selection`) and round numbering."""

from __future__ import annotations

import pytest

from common.config import AggregationSection
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
