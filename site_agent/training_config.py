"""How a site trains locally (`TrainingConfig`) and what one local round produced
(`TrainResult`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from common.core.errors import ConfigError
from common.models import Task, output_units
from common.privacy.accountant import Segment

PrivacyUnit = Literal["patient", "record", "none"]


@dataclass(frozen=True)
class TrainingConfig:
    """How a site trains locally. `batch_size` is the EXPECTED logical batch, in units."""

    batch_size: int = 256
    max_physical_batch_size: int = 1024
    # Bytes one step may use ("default": the device's safe default); when set, the
    # physical batch is the most that fits (`site_agent.memory_budget`), at most
    # `max_physical_batch_size`. None: `max_physical_batch_size` as given.
    memory_budget: int | Literal["default"] | None = None
    local_epochs: int = 1
    lr: float = 0.1
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = 0.0
    max_grad_norm: float = 1.0
    target_epsilon: float = 8.0
    delta: float = 1e-5
    planned_rounds: int = 10
    fedprox_mu: float = 0.0
    accountant: str = "prv"
    dp: bool = True
    privacy_unit: Literal["auto", "patient", "record"] = "auto"
    grad_sample_mode: Literal["ghost", "hooks", "auto"] = "auto"
    device: str = "auto"
    # The DP count of units (sample rate and steps come from it, never from N)
    # and the noise multiplier the site planned from its ledger (None: plan here).
    released_units: int | None = None
    noise_multiplier: float | None = None
    task: Task = "binary"
    num_classes: int = 2

    def __post_init__(self) -> None:
        positive_ints = ("batch_size", "max_physical_batch_size", "local_epochs", "planned_rounds")
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if isinstance(self.memory_budget, int) and self.memory_budget < 1:
            raise ConfigError("memory_budget", "must be positive")
        for name in ("lr", "max_grad_norm", "target_epsilon"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be positive")
        if not 0.0 < self.delta < 1.0:
            raise ConfigError("delta", "must be in (0, 1)")
        if self.fedprox_mu < 0 or self.momentum < 0:
            raise ConfigError("fedprox_mu", "fedprox_mu and momentum must be >= 0")
        if self.optimizer not in ("sgd", "adam"):
            raise ConfigError("optimizer", "must be 'sgd' or 'adam'")
        if self.privacy_unit not in ("auto", "patient", "record"):
            raise ConfigError("privacy_unit", "must be 'auto', 'patient' or 'record'")
        if self.grad_sample_mode not in ("ghost", "hooks", "auto"):
            raise ConfigError("grad_sample_mode", "must be 'ghost', 'hooks' or 'auto'")
        output_units(task=self.task, num_classes=self.num_classes)  # raises ConfigError


@dataclass(frozen=True)
class TrainResult:
    """What one local round produced; `delta_flat` = new - global, float32."""

    delta_flat: np.ndarray
    num_samples: int
    segments: list[Segment]
    seconds: float
    device: str
    privacy_unit: PrivacyUnit
    mean_loss: float
