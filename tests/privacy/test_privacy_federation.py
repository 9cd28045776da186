"""The coordinator's federation budget view on a real SQLite file, fed by real ledgers."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path

import pytest

from common.core.errors import ConfigError, StateError
from common.privacy.accountant import Segment
from common.privacy.budget import BudgetReport
from common.privacy.federation import FederationBudgetView, has_budget_left
from common.privacy.ledger import PrivacyLedger
from tests.privacy.conftest import Pki

T0 = datetime(2026, 3, 1, tzinfo=UTC)
ROUND = [Segment(1.0, 0.01, 100)]


def report(site_id: str, *, spent: float, budget: float = 4.0, entries: int = 1) -> BudgetReport:
    return BudgetReport(
        site_id=site_id,
        budget_epsilon=budget,
        delta=1e-5,
        spent_epsilon=spent,
        last_round=entries - 1 if entries else None,
        exhausted=spent >= budget,
        ledger_entries=entries,
        ledger_head="ab" * 32,
    )


def test_view_persists_and_selects_only_sites_with_budget(tmp_path: Path) -> None:
    db = tmp_path / "federation.db"
    view = FederationBudgetView.sqlite(db)
    view.update_site("a", report("a", spent=1.0), now=T0)
    view.update_site("b", report("b", spent=3.9), now=T0)
    view.update_site("c", report("c", spent=4.0), now=T0)  # exhausted
    reopened = FederationBudgetView.sqlite(db)
    rows = {row.site_id: row for row in reopened.snapshot()}
    assert [row.site_id for row in reopened.snapshot()] == ["a", "b", "c"]
    assert rows["c"].status == "exhausted" and rows["a"].status == "active"
    assert rows["b"].remaining_epsilon == pytest.approx(0.1)
    assert rows["a"].updated_at == T0.isoformat()
    reported = ["c", "b", "a"]
    assert [s for s in reported if has_budget_left(rows[s], min_remaining=0.0)] == ["b", "a"]
    assert [s for s in reported if has_budget_left(rows[s], min_remaining=0.5)] == ["a"]


def test_spend_reported_by_a_site_can_only_grow(tmp_path: Path) -> None:
    view = FederationBudgetView.sqlite(tmp_path / "federation.db")
    view.update_site("a", report("a", spent=2.0, entries=3), now=T0)
    with pytest.raises(StateError, match="cannot shrink"):
        view.update_site("a", report("a", spent=1.0, entries=3), now=T0)
    with pytest.raises(StateError, match="ledger entries"):
        view.update_site("a", report("a", spent=2.5, entries=2), now=T0)
    with pytest.raises(ConfigError) as info:
        view.update_site("b", report("a", spent=2.5), now=T0)
    assert info.value.field == "site_id"
    bad = dataclasses.replace(report("a", spent=2.5, entries=4), spent_epsilon=float("nan"))
    with pytest.raises(ConfigError) as info:
        view.update_site("a", bad, now=T0)
    assert info.value.field == "spent_epsilon"
    row = view.get("a")
    assert row is not None and row.spent_epsilon == 2.0


def test_view_follows_a_real_ledger_until_it_is_exhausted(
    tmp_path: Path, pki_material: Pki
) -> None:
    ledger = PrivacyLedger(tmp_path / "site.ledger", site_id="hospital-a", budget_epsilon=1.0,
                           delta=1e-5, signer=pki_material.signer_a)
    view = FederationBudgetView.sqlite(tmp_path / "federation.db")
    first = view.update_site("hospital-a", ledger.status(ROUND), now=T0)
    assert has_budget_left(first, min_remaining=0.0)
    ledger.reserve(0, ROUND, now=T0)
    ledger.reserve(1, ROUND, now=T0)
    # A third identical round would exceed 1.0: the site reports itself exhausted.
    status = ledger.status(ROUND)
    assert status.exhausted
    row = view.update_site("hospital-a", status, now=T0)
    assert row.ledger_head == ledger.head_hash() and row.ledger_entries == 2
    assert row.spent_epsilon == pytest.approx(ledger.spent())
    assert not has_budget_left(row, min_remaining=0.0)
