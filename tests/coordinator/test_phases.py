"""The phase table and the table-driven loop of `coordinator.phases`."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from common.core.config import LimitsSection
from common.core.errors import AbortReason, ProtocolAbort, StateError
from common.core.modelfile import flat_layout
from common.rounds.announcement import Announcement
from coordinator.aggregation import PlainAggregator
from coordinator.metrics import CoordinatorMetrics
from coordinator.phases import (
    PLAIN_PHASES,
    SECURE_PHASES,
    TRANSITIONS,
    ActiveRound,
    Liveness,
    PhaseClosed,
    PhaseState,
    RoundPhase,
    drive,
)
from coordinator.store import CoordinatorStore
from coordinator.uploads import Transfers

SITES = ("alpha", "beta", "gamma")


def announcement(*, secure: bool = True) -> Announcement:
    return Announcement(
        round_number=1, round_nonce=bytes(16), participants=SITES, threshold=2,
        neighbours=0, vector_length=13, quantization_bits=20, clip=1.0, histogram_bins=2,
        secure_aggregation=secure, model_layout=flat_layout(8), model_sha256=bytes(32),
        model_bytes=32, local_epochs=1, learning_rate=0.1, fedprox_mu=0.0, planned_rounds=3,
        train_deadline_ms=0, phase_timeout_ms=1000, weight_cap=100,
    )


def test_every_phase_can_abort_and_terminal_phases_are_final() -> None:
    for phase, targets in TRANSITIONS.items():
        if phase in (RoundPhase.FINISHED, RoundPhase.ABORTED):
            assert targets == frozenset()
        else:
            assert RoundPhase.ABORTED in targets


def test_secure_phases_follow_the_table_in_order() -> None:
    chain = (RoundPhase.ANNOUNCED, *SECURE_PHASES, RoundPhase.UPDATING, RoundPhase.FINISHED)
    for before, after in itertools.pairwise(chain):
        assert after in TRANSITIONS[before]


def test_an_illegal_transition_is_refused() -> None:
    rnd = ActiveRound(announcement(), b"")
    with pytest.raises(StateError, match="no transition"):
        rnd.move_to(RoundPhase.UNMASK)


def test_drive_runs_each_phase_and_stops_serving_the_model() -> None:
    """Each closer sees its phase with every expected site arrived; the next phase is
    open before the previous one reports closed; the round ends UPDATING."""
    rnd = ActiveRound(announcement(), b"model")
    seen: list[tuple[RoundPhase, frozenset[str]]] = []
    closed: list[PhaseClosed] = []

    async def close(phase: RoundPhase, state: PhaseState) -> tuple[object, set[str]]:
        seen.append((phase, frozenset(state.arrived)))
        return phase.value, set(SITES) - {"gamma"} if phase is RoundPhase.MASKED_INPUT \
            else set(state.expected)

    async def sites() -> None:
        for phase in SECURE_PHASES:
            while rnd.phase is not phase:
                await asyncio.sleep(0)
            state = rnd.phases[phase]
            for site in sorted(state.expected):
                rnd.require_phase(phase, site)
                state.mark(site)

    async def scenario() -> None:
        assert rnd.serves_model
        await asyncio.gather(
            drive(rnd, SECURE_PHASES, timeout_for=lambda _p: 30.0, close=close,
                  lock=asyncio.Lock(), on_closed=lambda _r, c: closed.append(c)),
            sites(),
        )

    asyncio.run(scenario())
    assert [p for p, _ in seen] == list(SECURE_PHASES)
    assert seen[0][1] == frozenset(SITES)
    assert seen[-1][1] == frozenset({"alpha", "beta"})  # gamma dropped after MaskedInput
    assert all(not c.missing for c in closed)
    assert rnd.phase is RoundPhase.UPDATING and not rnd.serves_model
    assert rnd.phases[RoundPhase.UNMASK].output == "unmask"
    # The timeline (bench round's breakdown): every phase's first and last message
    # and its close, in order.
    steps = [f"{p.value}.{step}" for p in SECURE_PHASES for step in ("first", "last", "closed")]
    assert list(rnd.timeline) == steps
    times = [rnd.timeline[step] for step in steps]
    assert times == sorted(times) and times[0] >= 0


def test_a_deadline_drops_the_missing_sites() -> None:
    rnd = ActiveRound(announcement(secure=False), b"")
    closed: list[PhaseClosed] = []

    async def close(phase: RoundPhase, state: PhaseState) -> tuple[object, set[str]]:
        return sorted(state.arrived), set()

    async def scenario() -> None:
        task = asyncio.create_task(
            drive(rnd, PLAIN_PHASES, timeout_for=lambda _p: 0.0, close=close,
                  lock=asyncio.Lock(), on_closed=lambda _r, c: closed.append(c))
        )
        await task

    asyncio.run(scenario())
    assert closed[0].missing == SITES
    assert rnd.phases[RoundPhase.MASKED_INPUT].output == []
    # Nobody sent anything: only the close is on the timeline.
    assert list(rnd.timeline) == ["masked_input.closed"]


def test_waiters_of_an_aborted_round_hear_the_abort() -> None:
    rnd = ActiveRound(announcement(), b"")

    async def scenario() -> BaseException | None:
        rnd.open_phase(RoundPhase.ADVERTISE_KEYS, set(SITES))
        waiter = asyncio.create_task(rnd.wait_closed(RoundPhase.ADVERTISE_KEYS))
        await asyncio.sleep(0)
        rnd.end(abort=ProtocolAbort(AbortReason.TOO_FEW_PARTICIPANTS, "test"))
        try:
            await waiter
        except ProtocolAbort as exc:
            return exc
        return None

    caught = asyncio.run(scenario())
    assert isinstance(caught, ProtocolAbort)
    assert caught.reason is AbortReason.TOO_FEW_PARTICIPANTS
    assert rnd.phase is RoundPhase.ABORTED


def test_a_silent_site_is_dropped_and_a_beating_one_is_waited_for() -> None:
    """Liveness: with a phase deadline far away, the site that never beats is dropped
    after `misses` intervals; the one that keeps beating is waited for until it sends
    its message, however long that takes."""
    interval = 0.05
    rnd = ActiveRound(announcement(secure=False), b"", liveness=Liveness(interval, 3))
    closed: list[PhaseClosed] = []

    async def close(phase: RoundPhase, state: PhaseState) -> tuple[object, set[str]]:
        return sorted(state.arrived), set()

    async def sites() -> None:
        state = rnd.phases[RoundPhase.MASKED_INPUT]
        state.mark("alpha")
        # beta trains for twice the silence limit, beating all along, then uploads.
        for _ in range(6):
            rnd.heard_from("beta")
            await asyncio.sleep(interval)  # the site's beat cadence, not a synchronisation
        with pytest.raises(StateError, match="dropped"):  # gamma went silent
            rnd.require_phase(RoundPhase.MASKED_INPUT, "gamma")
        rnd.require_phase(RoundPhase.MASKED_INPUT, "beta")
        state.mark("beta")

    async def scenario() -> None:
        await asyncio.gather(
            drive(rnd, PLAIN_PHASES, timeout_for=lambda _p: 600.0, close=close,
                  lock=asyncio.Lock(), on_closed=lambda _r, c: closed.append(c)),
            sites(),
        )

    asyncio.run(scenario())
    assert closed[0].silent == ("gamma",)
    assert closed[0].missing == ("gamma",)
    assert rnd.phases[RoundPhase.MASKED_INPUT].output == ["alpha", "beta"]


def test_a_frozen_uploader_is_dropped_within_the_silence_limit_and_a_slow_one_kept(
    tmp_path: Path,
) -> None:
    """Liveness covers uploads too: alpha sends one chunk of its upload and freezes (no
    chunk, no heartbeat), beta streams slowly, beating and sending a chunk per interval
    for twice the silence limit, gamma uploads at once. With the upload idle cut and
    the phase deadline both far away, alpha is dropped after `misses` silent intervals
    and its stream cut; beta's upload is kept and summed."""
    interval, misses = 0.05, 3
    rnd = ActiveRound(announcement(secure=False), b"", liveness=Liveness(interval, misses))
    transfers = Transfers(LimitsSection(upload_idle_seconds=600.0, max_concurrent_uploads=3),
                          tmp_path, metrics=CoordinatorMetrics())
    length = rnd.announcement.vector_length
    transfers.prepare(length)
    aggregator = PlainAggregator(rnd)
    lock = asyncio.Lock()
    closed: list[PhaseClosed] = []
    frozen = asyncio.Event()  # never set: alpha's process is stopped
    vectors = {site: np.full(length, n + 1, dtype="<u4") for n, site in enumerate(SITES)}

    async def close(phase: RoundPhase, state: PhaseState) -> tuple[object, set[str]]:
        return sorted(state.arrived), set()

    async def frozen_stream() -> AsyncIterator[tuple[int, bytes]]:
        yield 0, vectors["alpha"][:4].tobytes()
        await frozen.wait()

    async def slow_stream() -> AsyncIterator[tuple[int, bytes]]:
        data = vectors["beta"].tobytes()
        pieces = 2 * misses
        step = -(-len(data) // pieces // 4) * 4
        for offset in range(0, len(data), step):
            rnd.heard_from("beta")  # its heartbeat thread beats on while it streams
            await asyncio.sleep(interval)  # a slow link's pace, not a synchronisation
            yield offset, data[offset:offset + step]

    async def upload(site: str, stream: AsyncIterator[tuple[int, bytes]]) -> None:
        await transfers.receive(rnd, site, length, stream, into=aggregator, lock=lock)

    async def scenario() -> BaseException | None:
        driving = asyncio.ensure_future(
            drive(rnd, PLAIN_PHASES, timeout_for=lambda _p: 600.0, close=close, lock=lock,
                  on_closed=lambda _r, c: closed.append(c)))
        await asyncio.sleep(0)  # let drive open MaskedInput
        results = await asyncio.gather(
            upload("alpha", frozen_stream()), upload("beta", slow_stream()),
            upload("gamma", (lambda: _one(vectors["gamma"]))()), return_exceptions=True)
        await driving
        return results[0] if isinstance(results[0], BaseException) else None

    alpha_error = asyncio.run(scenario())
    assert isinstance(alpha_error, StateError)
    assert "dropped" in str(alpha_error)
    assert closed[0].silent == ("alpha",)
    assert rnd.phases[RoundPhase.MASKED_INPUT].output == ["beta", "gamma"]
    np.testing.assert_array_equal(aggregator.total, vectors["beta"] + vectors["gamma"])
    assert rnd.uploading == set()


async def _one(vector: np.ndarray) -> AsyncIterator[tuple[int, bytes]]:
    yield 0, vector.tobytes()


def test_dropped_counts_every_phase_but_not_declines() -> None:
    rnd = ActiveRound(announcement(), b"")
    rnd.decline("gamma")
    assert rnd.dropped_sites(["alpha"]) == ("beta",)
    assert rnd.dropped_sites(["alpha", "beta"]) == ()


def test_the_intent_to_unmask_is_recorded_before_the_sum_exists(tmp_path: Path) -> None:
    """A coordinator killed while Unmask closes may hold the sum in the clear: the
    state database must say "unmasked" before that close starts, or a restart would
    report the round as "nothing unmasked" (a real SQLite state, read from inside the
    closer that computes the sum)."""
    store = CoordinatorStore(f"sqlite:///{tmp_path / 'coordinator.db'}")
    rnd = ActiveRound(announcement(), b"model")
    store.begin_round(rnd.number, list(SITES), now=1.0)
    status_at_close: dict[RoundPhase, str | None] = {}

    async def close(phase: RoundPhase, state: PhaseState) -> tuple[object, set[str]]:
        status_at_close[phase] = store.round_status(rnd.number)
        return phase.value, set(state.expected)

    async def sites() -> None:
        for phase in SECURE_PHASES:
            while rnd.phase is not phase:
                await asyncio.sleep(0)
            state = rnd.phases[phase]
            for site in sorted(state.expected):
                state.mark(site)

    async def scenario() -> None:
        await asyncio.gather(
            drive(rnd, SECURE_PHASES, timeout_for=lambda _p: 30.0, close=close,
                  lock=asyncio.Lock(), on_closed=lambda _r, _c: None,
                  before_sum=lambda: store.mark_unmasked(rnd.number)),
            sites(),
        )

    try:
        asyncio.run(scenario())
        assert status_at_close[RoundPhase.UNMASK] == "unmasked"
        assert all(status_at_close[p] == "in_flight" for p in SECURE_PHASES[:-1])
        abandoned = store.abandon_in_flight(now=2.0)
        assert [(a.round_number, a.unmasked) for a in abandoned] == [(rnd.number, True)]
    finally:
        store.close()
