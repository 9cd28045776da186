"""Recovery at start: a coordinator restarted on its state abandons the round that was
in flight when it stopped (or when the engine lost its state database), and says
truthfully whether that round's sum may already have been unmasked."""

from __future__ import annotations

import logging

from common.privacy.federation import FederationBudgetView
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import CoordinatorStore

log = logging.getLogger("medfed.coordinator")


def recover(
    store: CoordinatorStore,
    budget_view: FederationBudgetView,
    metrics: CoordinatorMetrics,
    *,
    now: float,
    cause: str = "a crash",
) -> int:
    """Abandon rounds left in flight and restore the budget gauges; returns the number
    of the last round the state records (0 for a fresh state)."""
    for rnd in store.abandon_in_flight(now=now):
        if rnd.unmasked:
            log.warning("round %d was abandoned at %s after its sum was or may have "
                        "been unmasked: the coordinator may have seen that sum; no model "
                        "was built from it", rnd.round_number, cause)
        else:
            log.warning("round %d was in flight at %s: abandoned", rnd.round_number, cause)
        metrics.rounds_total.labels(outcome="abandoned").inc()
    # Budget gauges show the persisted federation view before any site reports again.
    for row in budget_view.snapshot():
        metrics.observe_budget(row.site_id, row.spent_epsilon, row.budget_epsilon)
    return store.next_round_number() - 1
