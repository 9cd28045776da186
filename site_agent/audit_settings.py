"""What one privacy audit trains (`medfed privacy audit`, site_agent/audit.py): torch-free,
so the command line (site_agent/audit_cli.py) takes its defaults without loading the
training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.core.config import DEFAULT_COUNT_EPSILON
from common.core.errors import ConfigError
from common.privacy.audit import DEFAULT_CONFIDENCE

DEFAULT_CANARIES = 200
DEFAULT_EPOCHS = 60


@dataclass(frozen=True)
class AuditSettings:
    """What one audit trains. `epsilon` None = non-private training (the audit's control)."""

    canaries: int = DEFAULT_CANARIES
    epsilon: float | None = 8.0
    delta: float = 1e-5
    epochs: int = DEFAULT_EPOCHS
    batch_size: int = 128
    lr: float = 0.1
    optimizer: Literal["sgd", "adam"] = "sgd"
    max_grad_norm: float = 1.0
    canary_radius: float = 10.0
    canary_records: int = 4
    confidence: float = DEFAULT_CONFIDENCE
    accountant: str = "prv"
    # The DP count of units the training is sized from, as the site releases it.
    count_epsilon: float = DEFAULT_COUNT_EPSILON

    def __post_init__(self) -> None:
        if self.canaries < 10:
            raise ConfigError("canaries", "need at least 10")
        if self.epsilon is not None and not self.epsilon > 0:
            raise ConfigError("epsilon", "must be positive (or use --no-dp)")
        for name in ("epochs", "batch_size", "canary_records"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        for name in ("lr", "max_grad_norm", "canary_radius", "count_epsilon"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be positive")
