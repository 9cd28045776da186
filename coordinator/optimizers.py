"""Server optimizers: how the coordinator turns the federation's mean update into a model.

Reddi et al. 2021, "Adaptive Federated Optimization" (ICLR), Algorithm 2: the mean
client delta is treated as a pseudo-gradient (negated) and fed to a server optimizer.
FedAvg is the special case "SGD with server learning rate 1".

The coordinator never sees one site's delta or size: `weighted_mean` takes the
SECURELY SUMMED weighted deltas (sum_k n_k * delta_k) and the securely summed weights
(sum_k n_k), so FedAvg weighting reveals no site's sample count.

numpy only: the coordinator does not need torch. State is plain numpy arrays so that
checkpoints need no pickle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from common.core.config import SERVER_OPTIMIZERS, OptimizerSection
from common.core.errors import ConfigError, StateError, ValidationError


def weighted_mean(summed_delta: np.ndarray, summed_weight: float) -> np.ndarray:
    """sum_k n_k delta_k / sum_k n_k, from the two securely summed quantities."""
    if not np.isfinite(summed_weight) or summed_weight <= 0:
        raise ValidationError(f"summed weight must be positive, got {summed_weight}")
    total = np.asarray(summed_delta, dtype=np.float64)
    if not np.all(np.isfinite(total)):
        raise ValidationError("summed delta contains NaN or infinity")
    return (total / float(summed_weight)).astype(np.float32)


def _check_shapes(global_flat: np.ndarray, mean_delta: np.ndarray) -> None:
    if global_flat.shape != mean_delta.shape or global_flat.ndim != 1:
        raise ValidationError(
            f"model {global_flat.shape} and delta {mean_delta.shape} must be equal 1-D shapes"
        )


class ServerOptimizer(Protocol):
    """One server step from the current global model and the federation's mean delta.

    `elementwise` optimizers (stateless, each element's step depends on that element
    only) may be stepped window by window in place, keeping coordinator memory near one
    model; the others step on the whole vector."""

    elementwise: bool

    def step(self, global_flat: np.ndarray, mean_delta: np.ndarray) -> np.ndarray: ...

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...


class FedAvg:
    """x <- x + server_lr * mean_delta (McMahan et al. 2017 when server_lr = 1)."""

    elementwise = True

    def __init__(self, server_lr: float = 1.0) -> None:
        if server_lr <= 0:
            raise ConfigError("server_lr", "must be positive")
        self.server_lr = server_lr

    def step(self, global_flat: np.ndarray, mean_delta: np.ndarray) -> np.ndarray:
        _check_shapes(global_flat, mean_delta)
        return (global_flat + self.server_lr * mean_delta).astype(np.float32)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if state:
            raise StateError("FedAvg has no state to restore")


class _AdaptiveServerOptimizer:
    """Shared first/second-moment machinery of FedAdam and FedYogi (Reddi et al., Alg. 2)."""

    elementwise = False  # whole-vector moments

    def __init__(self, *, lr: float, beta1: float, beta2: float, tau: float) -> None:
        if lr <= 0:
            raise ConfigError("lr", "must be positive")
        if not 0.0 <= beta1 < 1.0:
            raise ConfigError("beta1", "must be in [0, 1)")
        if not 0.0 <= beta2 < 1.0:
            raise ConfigError("beta2", "must be in [0, 1)")
        if tau <= 0:
            raise ConfigError("tau", "must be positive (it keeps the update finite)")
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau
        self.m: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def step(self, global_flat: np.ndarray, mean_delta: np.ndarray) -> np.ndarray:
        _check_shapes(global_flat, mean_delta)
        delta = mean_delta.astype(np.float64)
        if self.m is None or self.v is None:
            # Algorithm 2 initialises m_{-1} = 0 and v_{-1} >= tau^2; we take v = tau^2.
            self.m = np.zeros_like(delta)
            self.v = np.full_like(delta, self.tau**2)
        if self.m.shape != delta.shape:
            raise StateError("optimizer state does not match the model size")
        self.m = self.beta1 * self.m + (1.0 - self.beta1) * delta
        self.v = self._second_moment(self.v, delta * delta)
        update = self.lr * self.m / (np.sqrt(self.v) + self.tau)
        new_global: np.ndarray = (global_flat.astype(np.float64) + update).astype(np.float32)
        return new_global

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.m is None or self.v is None:
            return {}
        return {"m": self.m.copy(), "v": self.v.copy()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if not state:
            self.m = self.v = None
            return
        if set(state) != {"m", "v"} or state["m"].shape != state["v"].shape:
            raise StateError("optimizer state must hold arrays 'm' and 'v' of equal shape")
        self.m = np.asarray(state["m"], dtype=np.float64).copy()
        self.v = np.asarray(state["v"], dtype=np.float64).copy()


class FedAdam(_AdaptiveServerOptimizer):
    """Adam on the server: v <- beta2 v + (1 - beta2) delta^2."""

    def __init__(
        self, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ) -> None:
        super().__init__(lr=lr, beta1=beta1, beta2=beta2, tau=tau)

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        updated: np.ndarray = self.beta2 * v + (1.0 - self.beta2) * delta_sq
        return updated


class FedYogi(_AdaptiveServerOptimizer):
    """Yogi on the server: v <- v - (1 - beta2) delta^2 sign(v - delta^2).

    The additive update lets v grow or shrink slowly, avoiding Adam's fast decay of
    the effective learning rate (Zaheer et al. 2018).
    """

    def __init__(
        self, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ) -> None:
        super().__init__(lr=lr, beta1=beta1, beta2=beta2, tau=tau)

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        updated: np.ndarray = v - (1.0 - self.beta2) * delta_sq * np.sign(v - delta_sq)
        return updated


BUILDERS: dict[str, Callable[[OptimizerSection], ServerOptimizer]] = {
    "fedavg": lambda cfg: FedAvg(server_lr=cfg.server_lr),
    "fedadam": lambda cfg: FedAdam(lr=cfg.server_lr, beta1=cfg.beta1, beta2=cfg.beta2,
                                   tau=cfg.tau),
    "fedyogi": lambda cfg: FedYogi(lr=cfg.server_lr, beta1=cfg.beta1, beta2=cfg.beta2,
                                   tau=cfg.tau),
}
"""One builder per name in `common.core.config.SERVER_OPTIMIZERS` (the names a study and the
coordinator config accept)."""


def build_optimizer(cfg: OptimizerSection) -> ServerOptimizer:
    """The configured server optimizer."""
    builder = BUILDERS.get(cfg.name)
    if builder is None:
        raise ConfigError("optimizer.name",
                          f"unknown optimizer {cfg.name!r}; one of {', '.join(SERVER_OPTIMIZERS)}")
    return builder(cfg)


def apply_step(
    optimizer: ServerOptimizer, global_flat: np.ndarray, mean_delta: np.ndarray, *, window: int
) -> np.ndarray:
    """One server step. Elementwise optimizers step in place, `window` elements at a
    time (the caller guarantees nobody reads `global_flat` meanwhile); the result is
    the same bit for bit as one whole-vector step."""
    if not optimizer.elementwise:
        return optimizer.step(global_flat, mean_delta)
    _check_shapes(global_flat, mean_delta)
    for start in range(0, global_flat.size, window):
        stop = min(start + window, global_flat.size)
        global_flat[start:stop] = optimizer.step(global_flat[start:stop], mean_delta[start:stop])
    return global_flat
