"""Recovery after a crash (`coordinator.recovery`), on a real SQLite state database."""

from __future__ import annotations

import logging

import pytest

from coordinator.engine import RoundEngine
from coordinator.recovery import recover


def test_recovery_says_which_abandoned_rounds_were_unmasked(
    engine: RoundEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinator killed between unmasking and the checkpoint held that round's sum
    in the clear: the restart must say so, not claim nothing was unmasked."""
    store = engine.store
    store.begin_round(1, ["alpha", "beta"], now=1.0)
    store.mark_unmasked(1)  # killed during or after Unmask, before the checkpoint
    store.begin_round(2, ["alpha", "beta"], now=2.0)  # killed mid-round
    with caplog.at_level(logging.WARNING, logger="medfed.coordinator"):
        last = recover(store, engine.budget_view, engine.metrics, now=3.0)
    messages = [r.getMessage() for r in caplog.records]
    unmasked = "round 1 was abandoned at a crash after its sum was or may have been unmasked"
    assert any(m.startswith(unmasked) for m in messages), messages
    assert "round 2 was in flight at a crash: abandoned" in messages
    details = {r.round_number: (r.status, r.detail) for r in store.rounds()}
    assert details[1] == (
        "abandoned", "coordinator restarted after its sum was or may have been unmasked"
    )
    assert details[2] == ("abandoned", "coordinator restarted")
    assert last == 2
    assert engine.metrics.registry.get_sample_value(
        "medfed_coordinator_rounds_total", {"outcome": "abandoned"}
    ) == 2.0


def test_unmasked_marks_only_a_round_in_flight(engine: RoundEngine) -> None:
    store = engine.store
    store.begin_round(1, ["alpha"], now=1.0)
    store.finish_round(1, status="completed", now=2.0)
    store.mark_unmasked(1)
    assert store.round_status(1) == "completed"
    assert store.abandon_in_flight(now=3.0) == []
