"""Both phase tables, every (from, to) pair: the SecAgg+ protocol phases
(`common.protocol.secagg.phases`, moved by `PhaseTracker.advance`) and the coordinator's round
phases (`coordinator.phases`, moved by `ActiveRound.move_to`). An allowed move lands in
the new phase; any other raises the documented error and leaves the phase as it was."""

from __future__ import annotations

import itertools

import pytest

from common.core.errors import AbortReason, ProtocolAbort, StateError
from common.protocol.secagg.phases import TERMINAL_PHASES, TRANSITIONS, Phase, PhaseTracker
from coordinator import phases as round_phases
from coordinator.phases import ActiveRound, RoundPhase
from tests.coordinator.test_phases import announcement

SECAGG_PAIRS = list(itertools.product(Phase, Phase))
ROUND_PAIRS = list(itertools.product(RoundPhase, RoundPhase))


def test_the_tables_name_every_phase() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert set(round_phases.TRANSITIONS) == set(RoundPhase)


@pytest.mark.parametrize(("origin", "target"), SECAGG_PAIRS,
                         ids=[f"{a.value}->{b.value}" for a, b in SECAGG_PAIRS])
def test_secagg_phase_pair(origin: Phase, target: Phase) -> None:
    tracker = PhaseTracker(phase=origin)
    if target in TRANSITIONS[origin]:
        tracker.advance(target)
        assert tracker.phase is target
        return
    with pytest.raises(ProtocolAbort) as info:
        tracker.advance(target)
    assert info.value.reason is AbortReason.UNEXPECTED_MESSAGE
    assert f"no transition from {origin.value} to {target.value}" in str(info.value)
    assert tracker.phase is origin


@pytest.mark.parametrize(("origin", "target"), ROUND_PAIRS,
                         ids=[f"{a.value}->{b.value}" for a, b in ROUND_PAIRS])
def test_round_phase_pair(origin: RoundPhase, target: RoundPhase) -> None:
    rnd = ActiveRound(announcement(), b"")
    rnd.phase = origin  # the pair's starting point; move_to is what is under test
    if target in round_phases.TRANSITIONS[origin]:
        rnd.move_to(target)
        assert rnd.phase is target
        return
    with pytest.raises(StateError) as info:
        rnd.move_to(target)
    assert f"no transition from {origin.value} to {target.value}" in str(info.value)
    assert rnd.phase is origin


def test_secagg_abort_is_allowed_from_every_live_phase_and_only_there() -> None:
    for phase in Phase:
        tracker = PhaseTracker(phase=phase)
        tracker.abort()
        assert tracker.phase is (phase if phase in TERMINAL_PHASES else Phase.ABORTED)
        assert tracker.aborted_in is (None if phase in TERMINAL_PHASES else phase)
