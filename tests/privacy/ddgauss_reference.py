"""The discrete Gaussian N_Z(0, sigma^2) computed directly (its pmf and exact variance):
the reference the sampler (`common.privacy.ddgauss.sample_discrete_gaussian`) and the
DDGauss mechanism's noise are checked against (Canonne, Kamath & Steinke 2020)."""

from __future__ import annotations

import math

import numpy as np

POISSON_SUMMATION_SIGMA = 10.0
"""Above this sigma, the normaliser and variance of N_Z(0, sigma^2) equal the continuous
ones to relative 1e-800 (Poisson summation: the corrections are O(exp(-2 pi^2 sigma^2)))."""


def _tail(sigma: float) -> int:
    """Support half-width beyond which the pmf mass is below 1e-300."""
    return math.ceil(38 * sigma) + 2


def discrete_gaussian_pmf(values: np.ndarray, *, sigma: float) -> np.ndarray:
    """P(Y = y) of N_Z(0, sigma^2) at integer `values`."""
    if sigma > POISSON_SUMMATION_SIGMA:
        norm = sigma * math.sqrt(2 * math.pi)
    else:
        support = np.arange(-_tail(sigma), _tail(sigma) + 1, dtype=np.float64)
        norm = float(np.exp(-(support**2) / (2 * sigma * sigma)).sum())
    y = np.asarray(values, np.float64)
    result: np.ndarray = np.exp(-(y**2) / (2 * sigma * sigma)) / norm
    return result


def discrete_gaussian_variance(sigma: float) -> float:
    """The exact variance of N_Z(0, sigma^2): slightly below sigma^2 for small sigma."""
    if sigma > POISSON_SUMMATION_SIGMA:
        return sigma * sigma
    support = np.arange(-_tail(sigma), _tail(sigma) + 1, dtype=np.float64)
    weights = np.exp(-(support**2) / (2 * sigma * sigma))
    return float((support**2 * weights).sum() / weights.sum())
