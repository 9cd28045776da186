"""The centralized reference fit (common.models.logistic_reference): Newton's method reaches
the optimum
of the penalised mean log-loss, and recovers the weights that generated the labels."""

from __future__ import annotations

import numpy as np

from common.models.logistic_reference import RIDGE, fit_logistic


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.column_stack([np.ones(n), rng.normal(size=(n, 3))])
    truth = np.array([-0.5, 1.5, -1.0, 0.0])
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(x @ truth)))).astype(np.float64)
    return x, y, truth


def test_the_fit_is_the_optimum_of_the_penalised_log_loss() -> None:
    x, y, _ = _data(2000, 1)
    w = fit_logistic(x, y)
    p = 1.0 / (1.0 + np.exp(-(x @ w)))
    penalty = np.full(w.size, RIDGE)
    penalty[0] = 0.0  # the intercept is free
    gradient = x.T @ (p - y) / len(y) + penalty * w
    assert float(np.max(np.abs(gradient))) < 1e-9


def test_the_generating_weights_are_recovered() -> None:
    x, y, truth = _data(50_000, 2)
    np.testing.assert_allclose(fit_logistic(x, y), truth, atol=0.05)
