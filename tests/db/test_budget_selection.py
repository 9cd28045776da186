"""The coordinator's federation budget view decides who is selected: exhausted sites
are never asked again.

Engine level on SQLite and PostgreSQL (every kind of report, one selection), then the
whole federation over real mTLS sockets with real site ledgers: a site whose ledger
refuses a round declines it, reports itself exhausted and is never selected again.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench.instrumented import flat_model
from bench.transport_site import DeterministicTestHook
from common.core.config import SiteSettings
from common.core.errors import StateError, ValidationError
from common.privacy.accountant import Segment
from common.privacy.budget import BudgetReport
from common.privacy.federation import FederationBudgetView
from common.privacy.ledger import LedgerSigner, PrivacyLedger, verify_ledger
from common.proto.medfed.v1 import federation_pb2 as pb
from common.protocol import pki
from common.rounds.announcement import RoundPlan
from common.rounds.wire import budget_from_pb
from coordinator.engine import RoundEngine
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import CoordinatorStore
from site_agent.agent import SiteAgent
from site_agent.dp_release import evaluation_mechanism
from site_agent.metrics import SiteMetrics
from tests.network.conftest import (
    MODEL_DIM,
    InProcessCoordinator,
    PkiLayout,
    coordinator_settings,
)

HEAD = "ab" * 32


def _refuse_identity(site_id: str, certificate_der: bytes) -> object:
    raise AssertionError("no secure phase runs in this test")


def _ledger_budget(spent: float, budget: float, *, entries: int, exhausted: bool = False
                   ) -> BudgetReport:
    return BudgetReport(
        budget_epsilon=budget, spent_epsilon=spent, delta=1e-5, privacy_unit="record",
        exhausted=exhausted, ledger_entries=entries, ledger_head=HEAD,
        last_round=entries,
    )


def test_selection_follows_the_federation_view(
    pki_layout: PkiLayout, tmp_path: Path, database_url: str
) -> None:
    settings = coordinator_settings(
        pki_layout, tmp_path / "state", database_url=database_url, min_sites=2,
        deadlines={"selection_seconds": 5.0},
    )
    store = CoordinatorStore(database_url)
    metrics = CoordinatorMetrics()
    reports = {
        "fresh": _ledger_budget(1.0, 8.0, entries=1),
        "spent": _ledger_budget(8.0, 8.0, entries=4),
        "sliver": _ledger_budget(4.0 - 5e-7, 4.0, entries=3),  # remaining <= 1e-6
        "declined": _ledger_budget(2.0, 8.0, entries=2, exhausted=True),
        "nodp": BudgetReport(privacy_unit="none"),  # keeps no ledger: not in the view
        "reset": _ledger_budget(4.0, 4.0, entries=5),
    }

    async def scenario() -> list[str]:
        engine = RoundEngine(
            settings, store, identity=_refuse_identity,  # type: ignore[arg-type]
            metrics=metrics, model_without_study=flat_model(MODEL_DIM),
        )
        for site_id, budget in reports.items():
            engine.sites.enroll(site_id, b"", serial="1", version="t", device="cpu", budget=budget)
        # "reset" comes back with an empty ledger: the view refuses to lower its spend,
        # so a wiped ledger does not buy the site a fresh budget.
        waits = [
            asyncio.ensure_future(
                engine.sites.wait_for_round(
                    site_id, after_round=0, wait_seconds=30,
                    budget=BudgetReport(4.0, 0.0, 1e-5, "record") if site_id == "reset" else None,
                )
            )
            for site_id in reports
        ]
        try:
            return await asyncio.wait_for(engine.select_participants(), timeout=30)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    chosen = asyncio.run(scenario())
    assert chosen == ["fresh", "nodp"]
    spent = metrics.registry.get_sample_value(
        "medfed_coordinator_site_epsilon_spent", {"site": "reset"}
    )
    assert spent == 4.0  # the recorded spend, not the refused report of 0
    store.close()

    view = FederationBudgetView.open(database_url)  # persisted in the state database
    rows = {row.site_id: row for row in view.snapshot()}
    assert sorted(rows) == ["declined", "fresh", "reset", "sliver", "spent"]
    assert rows["declined"].status == "exhausted" and rows["spent"].status == "exhausted"
    assert rows["reset"].spent_epsilon == 4.0 and rows["reset"].ledger_entries == 5
    with pytest.raises(StateError):
        view.update_site("reset", BudgetReport(4.0, 0.0, 1e-5, site_id="reset"),
                         now=datetime.now(UTC))
    view.close()

    # A restarted coordinator shows the persisted figures before any site reports again.
    restarted_store, restarted_metrics = CoordinatorStore(database_url), CoordinatorMetrics()
    RoundEngine(
        settings, restarted_store, identity=_refuse_identity,  # type: ignore[arg-type]
        metrics=restarted_metrics, model_without_study=flat_model(MODEL_DIM),
    ).recover()
    for site_id, spent_epsilon, budget_epsilon in (("spent", 8.0, 8.0), ("fresh", 1.0, 8.0)):
        labels = {"site": site_id}
        assert restarted_metrics.registry.get_sample_value(
            "medfed_coordinator_site_epsilon_spent", labels
        ) == spent_epsilon
        assert restarted_metrics.registry.get_sample_value(
            "medfed_coordinator_site_epsilon_budget", labels
        ) == budget_epsilon
    restarted_store.close()


def test_budget_reports_from_the_wire_are_checked() -> None:
    ok = pb.BudgetStatus(
        epsilon_budget=8.0, epsilon_spent=1.5, delta=1e-5, privacy_unit="patient",
        exhausted=True, ledger_entries=3, ledger_head=HEAD, ledger_last_round=7,
    )
    budget = budget_from_pb(ok)
    assert budget == BudgetReport(
        8.0, 1.5, 1e-5, "patient", exhausted=True, ledger_entries=3,
        ledger_head=HEAD, last_round=7,
    )
    assert budget.exhausted  # reported exhausted although 6.5 epsilon is "left"
    no_entries = budget_from_pb(pb.BudgetStatus(epsilon_budget=8.0, ledger_last_round=5))
    assert no_entries is not None and no_entries.last_round is None
    for bad in (
        pb.BudgetStatus(epsilon_budget=8.0, ledger_head="not hex"),
        pb.BudgetStatus(epsilon_budget=8.0, ledger_head="AB" * 32),  # upper case
        pb.BudgetStatus(epsilon_budget=8.0, ledger_head="ab" * 33),
        pb.BudgetStatus(epsilon_budget=8.0, ledger_entries=1 << 63),
        pb.BudgetStatus(epsilon_budget=float("nan")),
    ):
        with pytest.raises(ValidationError):
            budget_from_pb(bad)


# ------------------------------------------------------------- whole federation

ROUND_COST = [Segment(noise_multiplier=1.0, sample_rate=0.05, steps=20)]
"""What each round costs a site with a ledger (about 2.0 epsilon for the first round and
2.5 for two at delta 1e-5 with PRV), as if it had trained with DP-SGD."""

# Every round also releases a DP evaluation histogram (a ledger entry): with the
# coordinator's defaults (20 bins, noise std 10) planned for the floor of 3 sites minus
# T = 1 colluder, i.e. 2 noise contributors.
ROUND_EVALUATION = evaluation_mechanism(noise_std=10.0, n_noise=2, bins=20)


def tight_budget(tmp_path: Path, signer: LedgerSigner) -> float:
    """A budget that one round (training + evaluation) fits and a second does not."""
    probe = PrivacyLedger(tmp_path / "probe.ledger", site_id="e", budget_epsilon=100.0,
                          delta=1e-5, signer=signer)
    # As the site's ledger holds a round: a training entry and an evaluation entry.
    evaluation = ("evaluation", [ROUND_EVALUATION])
    one = probe.preview(1, ROUND_COST, also=[evaluation])
    two = probe.preview(1, ROUND_COST, also=[evaluation, ("training", ROUND_COST), evaluation])
    return (one + two) / 2


class LedgerTestHook(DeterministicTestHook):
    """TEST ONLY: the deterministic update, with a fixed privacy cost per round so the
    site's real ledger is consulted, written and eventually exhausted."""

    privacy_unit = "record"

    def planned_segments(self, plan: RoundPlan, *, evaluation: object = ()) -> list[Segment]:
        return list(ROUND_COST)


def _agent(
    pki_layout: PkiLayout, address: str, site: str, state: Path, *,
    ledger: PrivacyLedger | None, stop: threading.Event,
) -> SiteAgent:
    settings = SiteSettings(
        pki=pki_layout.root, site=site, coordinator=address, metrics_listen="127.0.0.1:0",
        state=state,
        reconnect={"initial_backoff_seconds": 0.1, "max_backoff_seconds": 0.5},
    )
    hook = LedgerTestHook(site) if ledger is not None else DeterministicTestHook(site)
    return SiteAgent(settings, hook, metrics=SiteMetrics(site), ledger=ledger, stop=stop)


def test_site_with_exhausted_ledger_is_never_selected_again(
    pki_layout: PkiLayout, tmp_path: Path, coordinator: Callable[..., InProcessCoordinator]
) -> None:
    e_signer = LedgerSigner.from_files(*pki.site_paths(pki_layout.root, "e"))
    budget = tight_budget(tmp_path, e_signer)
    ledgers = {
        "d": PrivacyLedger(tmp_path / "d.ledger", site_id="d", budget_epsilon=100.0,
                           delta=1e-5,
                           signer=LedgerSigner.from_files(*pki.site_paths(pki_layout.root, "d"))),
        "e": PrivacyLedger(tmp_path / "e.ledger", site_id="e", budget_epsilon=budget,
                           delta=1e-5, signer=e_signer),
    }
    # The premise: one round fits e's budget, two do not (also warms up the accountant).
    evaluation = ("evaluation", [ROUND_EVALUATION])
    assert ledgers["e"].preview(1, ROUND_COST, also=[evaluation]) < budget
    assert ledgers["e"].preview(
        1, ROUND_COST, also=[evaluation, ("training", ROUND_COST), evaluation]) > budget

    coord = coordinator(
        rounds=4, min_sites=4,
        deadlines={"selection_seconds": 5.0, "train_seconds": 20.0},
    )
    stop = threading.Event()
    threads = []
    codes: dict[str, int] = {}
    for site in ("a", "b", "c", "d", "e"):
        agent = _agent(pki_layout, coord.address, site, tmp_path / f"site-{site}",
                       ledger=ledgers.get(site), stop=stop)

        def run(agent: SiteAgent = agent, site: str = site) -> None:
            codes[site] = agent.run()

        threads.append(threading.Thread(target=run, name=f"site-{site}", daemon=True))
    for thread in threads:
        thread.start()
    try:
        coord.wait_engine_done(180)
    finally:
        for thread in threads:
            thread.join(30)
        stop.set()
    assert codes == dict.fromkeys("abcde", 0)

    rounds = coord.engine.store.rounds()
    assert [r.status for r in rounds] == ["completed"] * 4
    e_trained = [r.round_number for r in rounds if "e" in r.survivors]
    e_declined = [r.round_number for r in rounds
                  if "e" in r.participants and "e" not in r.survivors]
    # e trained once, was asked once more, declined (its ledger refused), and no later
    # round selected it although four other sites kept going.
    assert len(e_trained) == 1 and len(e_declined) == 1
    assert e_declined[0] > e_trained[0]
    later = [r for r in rounds if r.round_number > e_declined[0]]
    assert later and all("e" not in r.participants for r in later)
    assert all(set(r.survivors) >= {"a", "b", "c", "d"} for r in later)

    e_ledger = ledgers["e"]
    # written once (its training and its evaluation entry carry that round's number)
    assert sorted({entry.round for entry in e_ledger.entries()}) == e_trained
    assert verify_ledger(e_ledger.path).ok
    view = coord.engine.budget_view
    e_row, d_row = view.get("e"), view.get("d")
    assert e_row is not None and d_row is not None
    assert e_row.status == "exhausted"
    assert e_row.spent_epsilon == pytest.approx(e_ledger.spent())
    assert e_row.ledger_entries == len(e_ledger.entries()) == 2  # training + evaluation
    assert e_row.ledger_head == e_ledger.head_hash()
    d_trained = [r.round_number for r in rounds if "d" in r.survivors]
    assert d_row.status == "active" and len(d_trained) >= 3
    # one training and one evaluation entry per round d trained in
    assert d_row.ledger_entries == len(ledgers["d"].entries()) == 2 * len(d_trained)
    assert view.get("a") is None  # no ledger, no row
    registry = coord.engine.metrics.registry
    assert registry.get_sample_value(
        "medfed_coordinator_site_epsilon_spent", {"site": "e"}
    ) == pytest.approx(e_ledger.spent())
    assert registry.get_sample_value(
        "medfed_coordinator_site_epsilon_budget", {"site": "e"}
    ) == budget


def test_sites_that_decline_a_kind_of_round_for_good_are_left_out_of_it(
    pki_layout: PkiLayout, tmp_path: Path, database_url: str
) -> None:
    """A site that declined a round for a reason that cannot change is not selected for
    that kind of round again; when every participant of a round declined it so, the
    study fails naming the reason (coordinator/engine.py `leave_out_declined_for_good`)."""
    from dataclasses import replace

    from common.core.errors import StudyFailed
    from coordinator.phases import ActiveRound
    from tests.coordinator.test_phases import announcement

    settings = coordinator_settings(pki_layout, tmp_path / "state", database_url=database_url,
                                    min_sites=2)
    store = CoordinatorStore(database_url)
    engine = RoundEngine(settings, store, identity=_refuse_identity,  # type: ignore[arg-type]
                         metrics=CoordinatorMetrics(), model_without_study=flat_model(MODEL_DIM))
    sites = ["alpha", "beta", "gamma"]
    for site_id in sites:
        engine.sites.enroll(site_id, b"", serial="1", version="t", device="cpu",
                            budget=_ledger_budget(1.0, 8.0, entries=1))
    reason = "its policy.max_evaluations are used up on its ledger"
    first = ActiveRound(replace(announcement(), participants=tuple(sites)), b"")
    first.decline("gamma", lasting_reason=reason)
    first.decline("beta")  # not ready: may take part next time
    engine.leave_out_declined_for_good(first, kind="evaluation")
    assert engine.eligible(sites, kind="evaluation") == ["alpha", "beta"]
    assert engine.eligible(sites, kind="training") == sites  # another kind of round

    second = ActiveRound(replace(announcement(), participants=("alpha", "beta")), b"")
    second.decline("beta", lasting_reason=reason)
    engine.leave_out_declined_for_good(second, kind="evaluation")  # alpha may still run it
    assert engine.eligible(sites, kind="evaluation") == ["alpha"]

    third = ActiveRound(replace(announcement(), participants=("alpha",)), b"")
    third.decline("alpha", lasting_reason=reason)
    with pytest.raises(StudyFailed, match="the final evaluation round") as failed:
        engine.leave_out_declined_for_good(third, kind="evaluation")
    assert f"alpha: {reason}" in failed.value.reason
    assert "leaving 0 of min_sites=2" in failed.value.reason
    store.close()
