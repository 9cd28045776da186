"""What a test or benchmark may watch in a round, and nothing more: the seam through
which `bench.instrumented` writes the coordinator's unmasked sum and a site's update
before masking (for exact-sum checks), and pauses a site after a phase (for fault
tests).

The product passes `NoObserver` and has no setting, flag or environment variable that
changes it: a hospital's configuration cannot make its site write a plaintext update
anywhere. Another observer is plugged in by code, the way a training double is
(`site_agent.cli.register(observer_factory=...)`,
`coordinator.cli.register(observer_factory=...)`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

PHASES = ("advertise_keys", "share_keys", "upload", "masked_input", "consistency_check")
"""The points of a site's SecAgg+ round `RoundObserver.after_phase` is called at
(`upload`: mid-stream, once the masked input's first chunk was sent)."""


class RoundObserver(Protocol):
    """Called by the services at fixed points of a round. An observer must not keep or
    change the arrays it is shown: they are the round's own buffers."""

    def after_phase(self, round_number: int, phase: str, *, stop: threading.Event) -> None:
        """A site finished `phase` (one of PHASES) of round `round_number`; `stop` is
        set when the agent is told to stop (an observer that waits waits on it)."""

    def update_before_masking(self, round_number: int, vector: np.ndarray) -> None:
        """The ring vector a site is about to release in round `round_number`, before
        its SecAgg+ masks (a round without secure aggregation has none)."""

    def aggregate_unmasked(
        self, round_number: int, aggregate: np.ndarray, survivors: tuple[str, ...]
    ) -> None:
        """The coordinator's unmasked ring sum of round `round_number` and the sites
        it sums, before it is decoded (in place, right after this call)."""


class NoObserver:
    """The product's observer: watches nothing."""

    def after_phase(self, round_number: int, phase: str, *, stop: threading.Event) -> None:
        return None

    def update_before_masking(self, round_number: int, vector: np.ndarray) -> None:
        return None

    def aggregate_unmasked(
        self, round_number: int, aggregate: np.ndarray, survivors: tuple[str, ...]
    ) -> None:
        return None


ObserverFactory = Callable[[Path], RoundObserver]
"""How a plug-in builds its observer from the service's state folder."""
