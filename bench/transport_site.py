"""A site agent for the transport benchmarks and tests: its "training" is
`DeterministicTestHook`, an update derived from (site, round) with no data and no
privacy cost, so rounds cost transport and SecAgg+ only and a test can check the
coordinator's unmasked sum exactly.

It is not a setting of the product's site agent (`medfed site run` always trains on its
data): it is this command, the product's `site` command with the double plugged in,

    python -m bench.transport_site site run --pki PKI --site S --coordinator HOST:PORT ...

taking every flag of `medfed site run` and the instrumentation flags of
`bench.instrumented` (`--debug-write-updates`, `--debug-pause-after`).
`MEDFED_TRANSPORT_TRAIN_SECONDS` makes each round's "training" take that long (liveness
tests freeze or cut off a site meanwhile).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import instrumented
from common.core.config import SiteSettings
from common.core.errors import ConfigError, RoundFailed
from common.privacy.accountant import Segment
from common.privacy.mechanisms import Mechanism
from common.releases.statistics import statistics_length
from common.rounds.announcement import RoundPlan
from common.study import GlobalStatistics, Study
from site_agent.site_training import LocalUpdate

TRAIN_SECONDS_ENV = "MEDFED_TRANSPORT_TRAIN_SECONDS"


class DeterministicTestHook:
    """An update derived from (site, round), no data, no privacy cost: lets transport
    and fault tests check the coordinator's unmasked sum exactly."""

    privacy_unit = "none"
    device = "cpu"

    def __init__(self, site_id: str, *, scale: float = 0.5, samples: int = 100,
                 train_seconds: float = 0.0) -> None:
        self.site_id = site_id
        self.scale = scale
        self.samples = samples
        # Liveness tests freeze or cut off a site while it "trains": give them a window.
        self.train_seconds = train_seconds
        self.study: Study | None = None

    def join_study(self, study: Study | None, policy: Any) -> None:
        self.study = study

    def statistics_release(self) -> np.ndarray:
        if self.study is None:
            raise RoundFailed("a statistics round needs a study")
        return np.zeros(statistics_length(self.study), dtype=np.int64)

    def set_statistics(self, statistics: GlobalStatistics) -> None:
        return None

    @property
    def table(self) -> None:
        """No data: a query round is refused (`QueryRelease.query`)."""
        return None

    def planned_segments(
        self, plan: RoundPlan, *, evaluation: Sequence[Mechanism] = ()
    ) -> list[Segment]:
        return []

    def train(self, plan: RoundPlan, global_flat: np.ndarray) -> LocalUpdate:
        if self.train_seconds:
            time.sleep(self.train_seconds)
        seed = hashlib.sha256(f"{self.site_id}/{plan.round_number}".encode()).digest()
        gen = np.random.Generator(np.random.PCG64(int.from_bytes(seed[:8], "big")))
        # Drawn as float32 and scaled in place: one model-sized vector, like a real
        # trainer's update (a float64 draw would add two models to the site's peak).
        delta = gen.random(global_flat.size, dtype=np.float32)
        delta *= np.float32(2 * self.scale)
        delta -= np.float32(self.scale)
        hist = gen.integers(0, 5, size=2 * plan.histogram_bins).astype(np.int64)
        return LocalUpdate(delta, self.samples, hist, 0.0)


def deterministic_hook(settings: SiteSettings) -> DeterministicTestHook:
    """The double for `settings.site`, "training" for `MEDFED_TRANSPORT_TRAIN_SECONDS`."""
    text = os.environ.get(TRAIN_SECONDS_ENV, "0")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ConfigError(TRAIN_SECONDS_ENV, f"must be a number of seconds >= 0, got {text!r}")
    return DeterministicTestHook(settings.site, train_seconds=seconds)


def main(argv: Sequence[str] | None = None) -> int:
    """`bench.instrumented` (the product's `site` and `coordinator` commands with the
    test instrumentation flags) with the deterministic double as every site's training."""
    return instrumented.main(argv, hook_factory=deterministic_hook)


if __name__ == "__main__":
    sys.exit(main())
