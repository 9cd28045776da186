"""The SecAgg+ phase enum and its transition table, shared by client and server, and
the check that a message comes from a site the current phase expects."""

from __future__ import annotations

import enum
from collections.abc import Container
from dataclasses import dataclass

from common.core.errors import AbortReason, ProtocolAbort, ValidationError


class Phase(enum.Enum):
    """Protocol phases of Bonawitz et al. 2017 (sec. 4, Fig. 4), in order."""

    ADVERTISE_KEYS = "advertise_keys"
    SHARE_KEYS = "share_keys"
    MASKED_INPUT = "masked_input"
    CONSISTENCY_CHECK = "consistency_check"
    UNMASK = "unmask"
    COMPLETED = "completed"
    ABORTED = "aborted"


TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.ADVERTISE_KEYS: frozenset({Phase.SHARE_KEYS, Phase.ABORTED}),
    Phase.SHARE_KEYS: frozenset({Phase.MASKED_INPUT, Phase.ABORTED}),
    Phase.MASKED_INPUT: frozenset({Phase.CONSISTENCY_CHECK, Phase.ABORTED}),
    Phase.CONSISTENCY_CHECK: frozenset({Phase.UNMASK, Phase.ABORTED}),
    Phase.UNMASK: frozenset({Phase.COMPLETED, Phase.ABORTED}),
    Phase.COMPLETED: frozenset(),
    Phase.ABORTED: frozenset(),
}
"""Allowed moves; everything else is a programming or protocol error."""

TERMINAL_PHASES = frozenset({Phase.COMPLETED, Phase.ABORTED})


@dataclass
class PhaseTracker:
    """Current phase plus the only two operations on it: require and advance."""

    phase: Phase = Phase.ADVERTISE_KEYS
    aborted_in: Phase | None = None
    """The phase the abort happened in (ADVERTISE_KEYS: at the roster, before any
    share left), for logs and for tests that assert how early an attack is stopped."""

    def require(self, expected: Phase, what: str) -> None:
        """Raise UNEXPECTED_MESSAGE unless we are in `expected` (out-of-order input)."""
        if self.phase is not expected:
            raise ProtocolAbort(
                AbortReason.UNEXPECTED_MESSAGE,
                f"{what} is only accepted in phase {expected.value}, not {self.phase.value}",
            )

    def advance(self, to: Phase) -> None:
        if to not in TRANSITIONS[self.phase]:
            raise ProtocolAbort(
                AbortReason.UNEXPECTED_MESSAGE,
                f"no transition from {self.phase.value} to {to.value}",
            )
        self.phase = to

    def abort(self) -> None:
        """Enter ABORTED from anywhere that is not already terminal."""
        if self.phase not in TERMINAL_PHASES:
            self.aborted_in = self.phase
            self.phase = Phase.ABORTED


def require_sender(site_id: str, allowed: Container[str], what: str) -> None:
    """ValidationError unless `site_id` is one of `allowed` (`what` names the set): a
    message from a site this phase does not expect is refused for that site only."""
    if not isinstance(site_id, str) or site_id not in allowed:
        raise ValidationError(f"{site_id!r} is not {what}")
