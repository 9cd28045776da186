"""One round's in-memory state on the coordinator: phases, deadlines, long-poll events.

The round engine (engine.py) owns the life cycle; RPC handlers call `submit_*` and
then `await wait_closed(phase)`. A phase closes when every site still expected has
sent its message, or when its deadline passes (the missing sites are dropped for the
round and SecAgg+ recovers their masks).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from common.errors import AbortReason, ProtocolAbort, StateError


class RoundPhase(enum.Enum):
    TRAINING = "training"  # sites download and train; closes with AdvertiseKeys
    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    CONSISTENCY_CHECK = "consistency_check"
    UNMASK = "unmask"
    FINISHED = "finished"


@dataclass(frozen=True)
class Announcement:
    """Everything a site needs to take part in a round (mirrors RoundAnnouncement)."""

    round_number: int
    round_nonce: bytes
    participants: tuple[str, ...]
    threshold: int
    neighbours: int
    vector_length: int
    quantization_bits: int
    clip: float
    histogram_bins: int
    secure_aggregation: bool
    model_layout: tuple[Any, ...]
    model_sha256: bytes
    model_bytes: int
    local_epochs: int
    learning_rate: float
    fedprox_mu: float
    planned_rounds: int
    train_deadline_ms: int
    phase_timeout_ms: int
    weight_cap: int
    max_chunk_bytes: int = 1 << 20


@dataclass
class PhaseState:
    expected: set[str]
    arrived: set[str] = field(default_factory=set)
    all_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    output: Any = None
    opened_at: float = field(default_factory=time.perf_counter)
    last_arrival: float | None = None  # perf_counter of the latest accepted message

    def mark(self, site_id: str) -> None:
        self.arrived.add(site_id)
        self.last_arrival = time.perf_counter()
        if self.expected <= self.arrived:
            self.all_arrived.set()


class ActiveRound:
    """Long-poll bookkeeping of the round in flight."""

    def __init__(self, announcement: Announcement, model_bytes: bytes | memoryview) -> None:
        self.announcement = announcement
        # Read-only bytes of the round's model; may be a view of the engine's float32
        # vector (no serialized copy), which the engine never mutates while served.
        self.model_bytes = model_bytes
        self.phase = RoundPhase.TRAINING
        self.phases: dict[RoundPhase, PhaseState] = {}
        self.declined: set[str] = set()
        self.dropped_after_input: set[str] = set()
        self.uploading: set[str] = set()  # sites with an upload stream in progress
        self.abort: ProtocolAbort | None = None
        self.finished = asyncio.Event()
        self.contributors = 0
        # Time spent after a phase's last accepted message waiting for its deadline
        # (i.e. waiting for sites that had dropped): benchmarks subtract it.
        self.deadline_wait_seconds = 0.0
        self.model_released = False  # set when the engine starts updating the model

    @property
    def first_phase(self) -> RoundPhase:
        """The phase a selected site's first message belongs to."""
        if self.announcement.secure_aggregation:
            return RoundPhase.ADVERTISE_KEYS
        return RoundPhase.MASKED_INPUT

    @property
    def number(self) -> int:
        return self.announcement.round_number

    def open_phase(self, phase: RoundPhase, expected: set[str]) -> PhaseState:
        state = PhaseState(expected=set(expected))
        if not state.expected:
            state.all_arrived.set()
        self.phases[phase] = state
        self.phase = phase
        return state

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
