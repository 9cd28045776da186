"""Non-private logistic regression fitted to convergence: the centralized reference a
tabular model is judged against (the pooled training rows, then the exact AUC on the
held-out patients). numpy only, so the benchmarks and the demo use one fit without
importing torch."""

from __future__ import annotations

import numpy as np

RIDGE = 1e-4
"""L2 penalty of the centralized logistic regression (on the mean log-loss; the
intercept is not penalised): small enough not to bias it, large enough to keep one-hot
columns beside the intercept well-posed."""


def fit_logistic(x: np.ndarray, y: np.ndarray, *, ridge: float = RIDGE,
                 iterations: int = 50, tolerance: float = 1e-10) -> np.ndarray:
    """Weights minimising mean log-loss + ridge/2 |w|^2 (intercept, column 0, free),
    by Newton's method; stops when the step is below `tolerance`."""
    n, d = x.shape
    penalty = np.full(d, ridge)
    penalty[0] = 0.0
    w = np.zeros(d)
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        gradient = x.T @ (p - y) / n + penalty * w
        hessian = (x.T * (p * (1 - p))) @ x / n + np.diag(penalty) + 1e-12 * np.eye(d)
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if float(np.max(np.abs(step))) < tolerance:
            break
    return w
