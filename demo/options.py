"""What `medfed demo` runs: its options, their checks and the demo's constants."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.core.errors import ConfigError

HISTOGRAM_BINS = 50
HELD_OUT_FRACTION = 0.2
"""The demo's sites keep the default `data.holdout_fraction`; the baselines and the final
model's exact metrics hold out the same patients."""
AGGREGATION_CLIP = 0.5
WAIT_NOTE_SECONDS = 30.0
"""With no round event for this long, the demo prints what it is waiting for."""


@dataclass
class DemoOptions:
    out: Path = Path("demo-run")
    sites: int = 5
    rounds: int = 4
    patients_per_site: int = 100_000
    seed: int = 7
    budget_epsilon: float = 8.0
    delta: float = 1e-5
    kill_round: int = 2
    data: Path | None = None
    label_column: str = "sepsis"
    patient_column: str | None = "patient_id"
    local_epochs: int = 1
    learning_rate: float = 0.5
    batch_size: int = 2048
    phase_seconds: float = 30.0
    quiet: bool = False
    # "hospital": hospital-level DP on the model updates, no DP-SGD beneath.
    privacy_unit: str = "auto"
    update_clip_norm: float = 1.0
    # v per hospital, or "auto" (the adaptive rule of Jiang et al. 2023); the study carries it.
    intermediaries: int | str = 1
    audit: bool = True


@dataclass
class RoundRow:
    round: int
    participants: list[str]
    dropped: list[str]
    secure_aggregation: bool
    auc: float | None
    evaluation_only: bool
    epsilon: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    intermediaries: int | None = None  # v of a hospital-level round



def validate_options(o: DemoOptions) -> None:
    if not 3 <= o.sites <= 20:
        raise ConfigError("--sites", "the demo runs 3 to 20 sites")
    if o.rounds < 1:
        raise ConfigError("--rounds", "must be >= 1")
    if o.kill_round < 0 or o.kill_round > o.rounds:
        raise ConfigError("--kill-round", f"must be between 0 and --rounds ({o.rounds})")
    if o.intermediaries != 1 and o.privacy_unit != "hospital":
        raise ConfigError("--intermediaries", "needs --privacy-unit hospital")
    if o.data is not None and not o.data.is_dir():
        raise ConfigError("--data", f"{o.data} is not a folder")

