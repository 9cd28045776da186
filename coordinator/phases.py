"""One round's life cycle on the coordinator: phases, their legal transitions, and the
one loop that drives a round through them.

RPC handlers call `require_phase`, hand their message to the round's aggregator and
then `await wait_closed(phase)`. A phase closes when every site still expected has sent
its message, or when its deadline passes (the missing sites are dropped for the round
and SecAgg+ recovers their masks). Keys come first: sites advertise and share keys as
soon as they hear of a round, then download and train, so uploads overlap other sites'
training and only ConsistencyCheck and Unmask follow the last upload.

Liveness: from the moment a site hears of a round until its masked input is uploaded
(while it streams that upload too) it sends a heartbeat every `Liveness.interval`
seconds; every upload chunk received also counts. A site expected in one of those
phases that has been silent (no heartbeat, no message) for `Liveness.misses` intervals
is dropped from it at once, exactly as the deadline would drop it later, so a frozen
or cut-off site holds the round a few heartbeats, not until `train_seconds` passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.core.errors import AbortReason, ProtocolAbort, StateError
from common.rounds.announcement import Announcement


class RoundPhase(enum.Enum):
    ANNOUNCED = "announced"  # participants were told; the first phase opens next
    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    CONSISTENCY_CHECK = "consistency_check"
    UNMASK = "unmask"
    UPDATING = "updating"  # the sum is being applied; the round's model is not served
    FINISHED = "finished"
    ABORTED = "aborted"


SECURE_PHASES = (
    RoundPhase.ADVERTISE_KEYS,
    RoundPhase.SHARE_KEYS,
    RoundPhase.MASKED_INPUT,
    RoundPhase.CONSISTENCY_CHECK,
    RoundPhase.UNMASK,
)
PLAIN_PHASES = (RoundPhase.MASKED_INPUT,)
HEARTBEAT_PHASES = frozenset(
    {RoundPhase.ADVERTISE_KEYS, RoundPhase.SHARE_KEYS, RoundPhase.MASKED_INPUT}
)
"""Phases during which sites heartbeat (until their masked input is uploaded); later
phases follow within moments of the upload and keep their deadline only."""

SILENT_AFTER_INTERVALS = 1.5
"""`ActiveRound.is_silent`: a beat due once per interval, allowed half an interval late."""

_P = RoundPhase
TRANSITIONS: dict[RoundPhase, frozenset[RoundPhase]] = {
    _P.ANNOUNCED: frozenset({_P.ADVERTISE_KEYS, _P.MASKED_INPUT, _P.ABORTED}),
    _P.ADVERTISE_KEYS: frozenset({_P.SHARE_KEYS, _P.ABORTED}),
    _P.SHARE_KEYS: frozenset({_P.MASKED_INPUT, _P.ABORTED}),
    _P.MASKED_INPUT: frozenset({_P.CONSISTENCY_CHECK, _P.UPDATING, _P.ABORTED}),
    _P.CONSISTENCY_CHECK: frozenset({_P.UNMASK, _P.ABORTED}),
    _P.UNMASK: frozenset({_P.UPDATING, _P.ABORTED}),
    _P.UPDATING: frozenset({_P.FINISHED, _P.ABORTED}),
    _P.FINISHED: frozenset(),
    _P.ABORTED: frozenset(),
}
SERVING_MODEL = frozenset(
    {_P.ANNOUNCED, _P.ADVERTISE_KEYS, _P.SHARE_KEYS, _P.MASKED_INPUT,
     _P.CONSISTENCY_CHECK, _P.UNMASK}
)


@dataclass(frozen=True)
class Liveness:
    """How often sites heartbeat, and how many missed beats drop one."""

    interval: float  # seconds
    misses: int

    @property
    def silence_limit(self) -> float:
        return self.interval * self.misses


@dataclass
class PhaseState:
    expected: set[str]
    opened_at: float = field(default_factory=time.monotonic)
    arrived: set[str] = field(default_factory=set)
    all_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    output: Any = None
    first_arrival: float | None = None  # perf_counter of the first accepted message
    last_arrival: float | None = None  # perf_counter of the latest accepted message
    _dropped: dict[str, asyncio.Event] = field(default_factory=dict)

    def mark(self, site_id: str) -> None:
        self.arrived.add(site_id)
        self.last_arrival = time.perf_counter()
        if self.first_arrival is None:
            self.first_arrival = self.last_arrival
        self.check_complete()

    def drop(self, site_id: str) -> None:
        """Stop waiting for `site_id` in this phase (declined, silent, or its upload
        stalled); an upload it is still streaming is cut (`dropped_event`)."""
        self.expected.discard(site_id)
        event = self._dropped.get(site_id)
        if event is not None:
            event.set()
        self.check_complete()

    def dropped_event(self, site_id: str) -> asyncio.Event:
        """Set when `site_id` is dropped from this phase (an upload stream waits on it)."""
        event = self._dropped.setdefault(site_id, asyncio.Event())
        if site_id not in self.expected:
            event.set()
        return event

    def check_complete(self) -> None:
        if self.expected <= self.arrived:
            self.all_arrived.set()


@dataclass(frozen=True)
class PhaseClosed:
    """What happened when a phase closed, for logs and metrics."""

    phase: RoundPhase
    missing: tuple[str, ...]  # expected sites dropped: deadline passed, or silent
    seconds: float
    silent: tuple[str, ...] = ()  # those of `missing` dropped for missed heartbeats


class ActiveRound:
    """Long-poll bookkeeping of the round in flight."""

    def __init__(
        self,
        announcement: Announcement,
        model_bytes: bytes | memoryview,
        *,
        liveness: Liveness | None = None,
        started: float | None = None,
    ) -> None:
        self.announcement = announcement
        # perf_counter of the round's start: `timeline` is measured from it.
        self.started = time.perf_counter() if started is None else started
        self.timeline: dict[str, float] = {}
        self.liveness = liveness  # None: only deadlines drop sites
        # time.monotonic() of the latest heartbeat or message of each participant.
        self.last_heard: dict[str, float] = {}
        # Read-only bytes of the round's model; may be a view of the engine's float32
        # vector (no serialized copy), which is not mutated while the model is served.
        self.model_bytes = model_bytes
        self.phase = RoundPhase.ANNOUNCED
        self.phases: dict[RoundPhase, PhaseState] = {}
        self.declined: set[str] = set()
        # Sites that declined for a reason that cannot change (DeclineRound's budget,
        # evaluations used, statistics released): site id -> the reason, as logged.
        self.declined_for_good: dict[str, str] = {}
        self.dropped_after_input: set[str] = set()
        self.uploading: set[str] = set()  # sites with an upload stream in progress
        self.abort: ProtocolAbort | None = None
        self.finished = asyncio.Event()
        # Time spent after a phase's last accepted message waiting for its deadline
        # (i.e. waiting for sites that had dropped): benchmarks subtract it.
        self.deadline_wait_seconds = 0.0

    @property
    def number(self) -> int:
        return self.announcement.round_number

    def mark(self, step: str, when: float | None = None, *, idle: float | None = None) -> None:
        """Record when `step` happened (perf_counter `when`, default now) as seconds
        since the round started less the deadline waits before it (`idle`, default all
        so far): the round's timeline as if dropped sites were detected at once."""
        when = time.perf_counter() if when is None else when
        idle = self.deadline_wait_seconds if idle is None else idle
        self.timeline[step] = when - self.started - idle

    def heard_from(self, site_id: str) -> None:
        """`site_id` is alive now (a heartbeat or any message of this round)."""
        self.last_heard[site_id] = time.monotonic()

    def is_silent(self, site_id: str, now: float) -> bool:
        """`site_id` is expected in the heartbeat phase in flight but has not been heard
        from (heartbeat, chunk or message) for more than SILENT_AFTER_INTERVALS
        intervals at `now` (time.monotonic()): it missed a beat, late by half an
        interval or more."""
        state = self.phases.get(self.phase)
        if self.liveness is None or state is None or self.phase not in HEARTBEAT_PHASES:
            return False
        if site_id not in state.expected or site_id in state.arrived:
            return False
        heard = max(self.last_heard.get(site_id, state.opened_at), state.opened_at)
        return now - heard > SILENT_AFTER_INTERVALS * self.liveness.interval

    def dropped_sites(self, survivors: Sequence[str]) -> tuple[str, ...]:
        """Participants whose input is not in the sum and who did not decline, whatever
        the phase they were dropped in."""
        gone = set(self.announcement.participants) - set(survivors) - self.declined
        return tuple(sorted(gone))

    @property
    def first_phase(self) -> RoundPhase:
        """The phase a selected site's first message belongs to."""
        return (SECURE_PHASES if self.announcement.secure_aggregation else PLAIN_PHASES)[0]

    @property
    def serves_model(self) -> bool:
        return self.phase in SERVING_MODEL

    def move_to(self, phase: RoundPhase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise StateError(
                f"round {self.number}: no transition from {self.phase.value} to {phase.value}"
            )
        self.phase = phase

    def open_phase(self, phase: RoundPhase, expected: set[str]) -> PhaseState:
        self.move_to(phase)
        state = PhaseState(expected=set(expected))
        state.check_complete()
        self.phases[phase] = state
        return state

    def advance(
        self, current: PhaseState, output: object, nxt: RoundPhase, expected: set[str]
    ) -> PhaseState | None:
        """Publish a phase's output; open the next phase BEFORE waking the long-polls,
        so a fast site's next message always finds its phase open."""
        current.output = output
        new_state = None
        if nxt in SERVING_MODEL:
            new_state = self.open_phase(nxt, expected)
        else:
            self.move_to(nxt)
        current.closed.set()
        return new_state

    def end(self, *, abort: ProtocolAbort | None) -> None:
        """FINISHED, or ABORTED with `abort` as what every waiting handler raises."""
        self.abort = abort
        self.move_to(RoundPhase.ABORTED if abort is not None else RoundPhase.FINISHED)
        self.finished.set()

    def can_rejoin(self, site_id: str) -> bool:
        """A site that reconnects while the round it was chosen for is still in its first
        phase (and has not sent anything yet) may still join it."""
        first = self.phases.get(self.first_phase)
        return (
            first is not None
            and self.phase is self.first_phase
            and site_id in first.expected
            and site_id not in first.arrived
        )

    def decline(self, site_id: str, *, lasting_reason: str | None = None) -> None:
        """`lasting_reason`: why the site can never take part in a round like this one
        (None: it may take part in the next)."""
        self.declined.add(site_id)
        if lasting_reason is not None:
            self.declined_for_good[site_id] = lasting_reason
        for state in self.phases.values():
            if not state.closed.is_set():
                state.drop(site_id)

    def require_phase(self, phase: RoundPhase, site_id: str) -> PhaseState:
        """The phase state if `site_id` may send its `phase` message now."""
        if self.abort is not None:
            raise self.abort
        if site_id not in self.announcement.participants:
            raise StateError(f"site {site_id} is not a participant of round {self.number}")
        state = self.phases.get(phase)
        if state is None or self.phase is not phase:
            raise ProtocolAbort(
                AbortReason.UNEXPECTED_MESSAGE,
                f"round {self.number} is in phase {self.phase.value}, not {phase.value}",
            )
        if site_id not in state.expected:
            raise StateError(f"site {site_id} was dropped from round {self.number} earlier")
        if site_id in state.arrived:
            raise StateError(f"duplicate {phase.value} message from {site_id} (replay?)")
        return state

    async def wait_closed(self, phase: RoundPhase) -> Any:
        state = self.phases[phase]
        closed = asyncio.ensure_future(state.closed.wait())
        finished = asyncio.ensure_future(self.finished.wait())
        try:
            await asyncio.wait({closed, finished}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            finished.cancel()
        if state.closed.is_set():
            return state.output
        raise self.abort or ProtocolAbort(AbortReason.ROUND_ABANDONED, "round ended")

    async def wait_recorded(self) -> None:
        """Until the round ended; returns only when it ended recorded as completed
        (FINISHED: its sum decoded and stored), else raises its abort. A site learns
        that its round is done from this alone: a coordinator that dies between the
        sum and its record answers nothing, so no site reports that round as done."""
        await self.finished.wait()
        if self.abort is not None:
            raise self.abort

    async def wait_ready(self, state: PhaseState, timeout: float) -> PhaseClosed:
        """Until every expected site arrived (or was dropped for silence), or `timeout`
        seconds passed."""
        started = time.perf_counter()
        deadline = time.monotonic() + max(timeout, 0.0)
        silent: list[str] = []
        timed_out = False
        while not state.all_arrived.is_set():
            now = time.monotonic()
            wake = deadline
            if self.liveness is not None and self.phase in HEARTBEAT_PHASES:
                wake = min(wake, now + self.liveness.interval,
                           self._drop_silent(state, now, into=silent))
            if state.all_arrived.is_set():
                break
            if now >= deadline:
                timed_out = True
                break
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that arrives as the event is set, and the engine would run on after a stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wake - now, 0.0)):
                    await state.all_arrived.wait()
        if timed_out or silent:
            last = state.last_arrival if state.last_arrival is not None else started
            self.deadline_wait_seconds += time.perf_counter() - max(last, started)
        missing = tuple(sorted({*(state.expected - state.arrived), *silent}))
        return PhaseClosed(self.phase, missing, time.perf_counter() - started, tuple(silent))

    def _drop_silent(self, state: PhaseState, now: float, *, into: list[str]) -> float:
        """Drop the pending sites silent for `liveness.misses` intervals since the phase
        opened (appending them to `into`); the time the next one would be due.

        A site streaming its upload is no exception: it keeps beating while it streams
        and each chunk received counts as hearing from it, so only a frozen or cut-off
        uploader goes silent; dropping it cuts its stream."""
        if self.liveness is None:
            return float("inf")
        limit = self.liveness.silence_limit
        due = float("inf")
        for site_id in sorted(state.expected - state.arrived):
            heard = max(self.last_heard.get(site_id, state.opened_at), state.opened_at)
            if now - heard >= limit:
                state.drop(site_id)
                into.append(site_id)
            else:
                due = min(due, heard + limit)
        return due


def phase_timeout(ann: Announcement, phase: RoundPhase, *, now: float,
                  phase_seconds: float) -> float:
    """Seconds a phase stays open: MaskedInput waits out local training too."""
    if phase is not RoundPhase.MASKED_INPUT:
        return phase_seconds
    return max(ann.train_deadline_ms / 1000 - now, 0.0) + phase_seconds


CloseFn = Callable[[RoundPhase, PhaseState], Awaitable[tuple[object, set[str]]]]


async def drive(
    rnd: ActiveRound,
    phases: Sequence[RoundPhase],
    *,
    timeout_for: Callable[[RoundPhase], float],
    close: CloseFn,
    lock: asyncio.Lock,
    on_closed: Callable[[ActiveRound, PhaseClosed], None],
    before_sum: Callable[[], None] | None = None,
) -> None:
    """Run `phases` in order: wait for each to be ready, let `close` compute its output
    and the sites expected next (under `lock`, so no upload lands mid-close), publish
    it and open the next phase; after the last one the round is UPDATING.

    `before_sum` runs (and must have returned) before the last phase's close, the one
    that produces the sum in the clear: the state records the intent to unmask first,
    so a crash during or after unmasking is never reported as "nothing unmasked"."""
    state: PhaseState | None = rnd.open_phase(phases[0], set(rnd.announcement.participants))
    for index, phase in enumerate(phases):
        if state is None:
            raise StateError(f"round {rnd.number}: phase {phase.value} was not opened")
        idle_before = rnd.deadline_wait_seconds
        on_closed(rnd, await rnd.wait_ready(state, timeout_for(phase)))
        for step, when in (("first", state.first_arrival), ("last", state.last_arrival)):
            if when is not None:
                rnd.mark(f"{phase.value}.{step}", when, idle=idle_before)
        nxt = phases[index + 1] if index + 1 < len(phases) else RoundPhase.UPDATING
        if nxt is RoundPhase.UPDATING and before_sum is not None:
            before_sum()
        async with lock:
            output, expected = await close(phase, state)
            state = rnd.advance(state, output, nxt, expected)
        rnd.mark(f"{phase.value}.closed")
