"""Regression tests for coordinator-engine fixes from the product review.

A real RoundEngine over a real SQLite state database; no sockets are needed because the
behaviour under test is the engine's long-poll bookkeeping.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from common.config import CoordinatorSettings, load_settings
from common.crypto.signing import VerifyingKey
from common.errors import CryptoError
from coordinator.engine import RoundEngine, SiteBudget
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import CoordinatorStore


def refuse_identity(site_id: str, certificate_der: bytes) -> VerifyingKey:
    raise CryptoError("no identities in this test")


def make_engine(tmp_path: Path) -> RoundEngine:
    settings = load_settings(
        CoordinatorSettings,
        overrides={"pki": tmp_path, "state": tmp_path, "model": {"dim": 8}, "min_sites": 2},
    )
    store = CoordinatorStore(f"sqlite:///{tmp_path / 'coordinator.db'}")
    return RoundEngine(settings, store, identity=refuse_identity, metrics=CoordinatorMetrics())


def test_a_cancelled_long_poll_no_longer_counts_as_waiting(tmp_path: Path) -> None:
    """gRPC cancels the handler when a site hangs up: that site must not stay eligible
    for selection (it would be put in a round it can never join)."""
    engine = make_engine(tmp_path)

    async def scenario() -> tuple[list[str], list[str]]:
        for site in ("alpha", "beta"):
            engine.enroll(site, b"", serial="1", version="t", device="cpu", budget=SiteBudget())
        polls = [
            asyncio.create_task(
                engine.wait_for_round(site, after_round=0, wait_seconds=30, budget=None)
            )
            for site in ("alpha", "beta")
        ]
        while len(engine._eligible_waiting()) < 2:
            await asyncio.sleep(0)  # let both polls register (no wall-clock wait)
        during = engine._eligible_waiting()
        polls[0].cancel()  # alpha's RPC is cancelled
        await asyncio.gather(polls[0], return_exceptions=True)
        after = engine._eligible_waiting()
        polls[1].cancel()
        await asyncio.gather(polls[1], return_exceptions=True)
        return during, after

    try:
        during, after = asyncio.run(scenario())
    finally:
        engine.store.close()
    assert during == ["alpha", "beta"]
    assert after == ["beta"]


def test_round_numbers_continue_after_the_sites_ledgers_on_a_fresh_coordinator(
    tmp_path: Path,
) -> None:
    """A coordinator started on empty (or restored, older) state must not reuse round
    numbers its sites have already spent budget on: they would refuse those rounds."""
    engine = make_engine(tmp_path)
    try:
        assert engine.next_round_number(["alpha", "beta"]) == 1
        engine.enroll("alpha", b"", serial="1", version="t", device="cpu",
                      budget=SiteBudget(epsilon_budget=8, epsilon_spent=3,
                                        ledger_entries=7, ledger_last_round=7))
        engine.enroll("beta", b"", serial="2", version="t", device="cpu",
                      budget=SiteBudget(epsilon_budget=8, epsilon_spent=1,
                                        ledger_entries=2, ledger_last_round=2))
        assert engine.next_round_number(["alpha", "beta"]) == 8
        assert engine.next_round_number(["beta"]) == 3
        engine.store.begin_round(11, ["alpha", "beta"], now=0.0)
        assert engine.next_round_number(["alpha", "beta"]) == 12  # the store's own record
    finally:
        engine.store.close()
