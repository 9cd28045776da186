"""Long-poll bookkeeping of `coordinator.sessions` through a real engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.instrumented import flat_model
from common.core.config import CoordinatorSettings, load_settings
from common.core.errors import Unavailable
from common.privacy.budget import BudgetReport
from coordinator.engine import RoundEngine
from coordinator.metrics import CoordinatorMetrics
from coordinator.store import CoordinatorStore
from tests.coordinator.conftest import refuse_identity


async def _poll_until_waiting(engine: RoundEngine, sites: tuple[str, ...]
                              ) -> list[asyncio.Task[object]]:
    for site in sites:
        engine.sites.enroll(site, b"", serial="1", version="t", device="cpu", budget=BudgetReport())
    polls: list[asyncio.Task[object]] = [
        asyncio.create_task(engine.sites.wait_for_round(site, after_round=0, wait_seconds=30,
                                                  budget=None))
        for site in sites
    ]
    while len(engine.sessions.waiting_ids()) < len(sites):
        await asyncio.sleep(0)  # let the polls register (no wall-clock wait)
    return polls


def test_a_cancelled_long_poll_no_longer_counts_as_waiting(engine: RoundEngine) -> None:
    """gRPC cancels the handler when a site hangs up: that site must not stay eligible
    for selection (it would be put in a round it can never join)."""

    async def scenario() -> tuple[list[str], list[str]]:
        polls = await _poll_until_waiting(engine, ("alpha", "beta"))
        during = engine.sessions.waiting_ids()
        polls[0].cancel()  # alpha's RPC is cancelled
        await asyncio.gather(polls[0], return_exceptions=True)
        after = engine.sessions.waiting_ids()
        polls[1].cancel()
        await asyncio.gather(polls[1], return_exceptions=True)
        return during, after

    during, after = asyncio.run(scenario())
    assert during == ["alpha", "beta"]
    assert after == ["beta"]


def test_a_failed_engine_answers_polls_unavailable_never_finished(
    engine: RoundEngine,
) -> None:
    """Waiting sites, and sites that poll afterwards, hear UNAVAILABLE (they retry);
    the federation is not marked finished."""

    async def scenario() -> tuple[list[object], BaseException | None]:
        polls = await _poll_until_waiting(engine, ("alpha", "beta"))
        engine.sessions.close(failure=Unavailable("coordinator round engine failed: disk"))
        answers = await asyncio.gather(*polls, return_exceptions=True)
        try:
            await engine.sites.wait_for_round("alpha", after_round=0, wait_seconds=1, budget=None)
        except Unavailable as exc:
            return answers, exc
        return answers, None

    answers, later = asyncio.run(scenario())
    assert all(isinstance(a, Unavailable) for a in answers), answers
    assert isinstance(later, Unavailable)
    assert not engine.finished.is_set()
    assert not engine.sessions.finished


def test_a_completed_study_answers_waiting_polls_with_no_round(engine: RoundEngine) -> None:
    async def scenario() -> list[object]:
        polls = await _poll_until_waiting(engine, ("alpha",))
        engine.sessions.close(failure=None)
        return list(await asyncio.gather(*polls))

    assert asyncio.run(scenario()) == [None]
    assert engine.sessions.finished


def test_unknown_site_must_enroll_first(engine: RoundEngine) -> None:
    from common.core.errors import StateError

    with pytest.raises(StateError, match="has not enrolled"):
        asyncio.run(
            engine.sites.wait_for_round("ghost", after_round=0, wait_seconds=1, budget=None)
        )


def test_a_site_that_enrolls_and_never_polls_shows_enrolled_not_waiting(
    engine: RoundEngine,
) -> None:
    """A site that refused the study stops right after Enroll (the protocol has no
    message for the refusal): `medfed status` shows it `enrolled`, not `waiting`; a
    site that polled shows `waiting`; enrolling again (a restart) resets the flag."""

    async def scenario() -> tuple[dict[str, str], dict[str, str]]:
        polls = await _poll_until_waiting(engine, ("beta",))
        engine.sites.enroll("alpha", b"", serial="2", version="t", device="cpu",
                            budget=BudgetReport())
        during = {s.site_id: s.state for s in engine.status().sites}
        polls[0].cancel()
        await asyncio.gather(polls[0], return_exceptions=True)
        engine.sites.enroll("beta", b"", serial="1", version="t", device="cpu",
                            budget=BudgetReport())
        after = {s.site_id: s.state for s in engine.status().sites}
        return during, after

    during, after = asyncio.run(scenario())
    assert during == {"alpha": "enrolled", "beta": "waiting"}
    assert after == {"alpha": "enrolled", "beta": "enrolled"}


@pytest.mark.parametrize("steps_before_cancel", range(6))
def test_selection_ends_when_cancelled_as_a_site_enrolls(
    engine: RoundEngine, steps_before_cancel: int
) -> None:
    """Stopping the coordinator cancels the engine while it waits for `min_sites`; a site
    enrolling in the same instant (its wake-up already queued) must not swallow that
    cancellation, or the engine would wait out `round_start_timeout_seconds` first."""

    async def scenario() -> bool:
        selecting = asyncio.create_task(engine.select_participants())
        for _ in range(3):
            await asyncio.sleep(0)  # selection is waiting for sites to change
        engine.sites.enroll("alpha", b"", serial="1", version="t", device="cpu",
                            budget=BudgetReport())
        for _ in range(steps_before_cancel):
            await asyncio.sleep(0)
        selecting.cancel()
        for _ in range(20):  # loop iterations, no wall-clock wait
            if selecting.done():
                break
            await asyncio.sleep(0)
        ended = selecting.done()
        if not ended:
            selecting.cancel()
        await asyncio.gather(selecting, return_exceptions=True)
        return ended and selecting.cancelled()

    assert asyncio.run(scenario()), "selection kept waiting after it was cancelled"


def test_a_waiting_site_that_stopped_beating_is_not_selectable(tmp_path: Path) -> None:
    """A long-poll stays open while its process is frozen: once the site sent nothing
    for more than `heartbeat_misses` (3) of the intervals it promised, selection leaves
    it out; its next heartbeat makes it selectable again."""
    now = [1_000.0]
    settings = load_settings(
        CoordinatorSettings,
        overrides={"pki": tmp_path, "state": tmp_path, "min_sites": 2},
    )
    store = CoordinatorStore(f"sqlite:///{tmp_path / 'coordinator.db'}")
    engine = RoundEngine(settings, store, identity=refuse_identity,
                         metrics=CoordinatorMetrics(), clock=lambda: now[0],
                         model_without_study=flat_model(8))

    def beat(site: str) -> None:
        engine.sessions.touch(site)  # what the servicer notes for every call
        engine.sites.heartbeat(site, 0)

    async def scenario() -> list[list[str]]:
        for site in ("alpha", "beta"):
            engine.sites.enroll(site, b"", serial="1", version="t", device="cpu",
                                budget=BudgetReport())
        polls = [asyncio.create_task(engine.sites.wait_for_round(
            site, after_round=0, wait_seconds=30, budget=None, beat_seconds=1.0))
            for site in ("alpha", "beta")]
        while len(engine.sessions.waiting_ids()) < 2:
            await asyncio.sleep(0)  # let the polls register (no wall-clock wait)
        seen = []
        now[0] += 2.5  # both silent 2.5 intervals: not yet left out
        beat("alpha")
        seen.append(engine.sessions.waiting_ids())
        now[0] += 1.0  # beta silent 3.5 intervals, alpha 1
        seen.append(engine.sessions.waiting_ids())
        beat("beta")
        seen.append(engine.sessions.waiting_ids())
        for poll in polls:
            poll.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        return seen

    try:
        assert asyncio.run(scenario()) == [["alpha", "beta"], ["alpha"], ["alpha", "beta"]]
    finally:
        store.close()


def test_each_sites_last_contact_is_the_operators_liveness_series(tmp_path: Path) -> None:
    """`medfed_coordinator_site_last_contact_timestamp_seconds{site}`: set at enrolment
    and by every later call of that site; a site that never enrolled has no series."""
    settings = load_settings(
        CoordinatorSettings,
        overrides={"pki": tmp_path, "state": tmp_path, "min_sites": 2},
    )
    now = [1_000.0]
    metrics = CoordinatorMetrics()
    store = CoordinatorStore(f"sqlite:///{tmp_path / 'coordinator.db'}")
    try:
        engine = RoundEngine(settings, store, identity=refuse_identity, metrics=metrics,
                             clock=lambda: now[0], model_without_study=flat_model(8))

        def last_contact(site: str) -> float | None:
            return metrics.registry.get_sample_value(
                "medfed_coordinator_site_last_contact_timestamp_seconds", {"site": site})

        engine.sites.enroll("alpha", b"", serial="1", version="t", device="cpu",
                            budget=BudgetReport())
        assert last_contact("alpha") == 1_000.0
        now[0] = 1_060.0
        engine.sessions.touch("alpha")
        engine.sessions.touch("beta")  # not enrolled: nothing to say about it
        assert last_contact("alpha") == 1_060.0
        assert last_contact("beta") is None
    finally:
        store.close()
