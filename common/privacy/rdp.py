"""Renyi DP of the Poisson-subsampled Gaussian mechanism, and its conversion to (eps, delta).

Pure numpy/scipy (no torch, no Opacus): every process that reports an epsilon (a site,
`medfed ledger show`, `medfed status`) imports this, and importing Opacus costs seconds
of CPU for torch alone.

* RDP of one step of the sampled Gaussian mechanism (noise multiplier sigma, Poisson
  sampling rate q) at order alpha: Mironov, Talwar & Zhang, "Renyi Differential Privacy
  of the Sampled Gaussian Mechanism", arXiv:1908.10530 (2019), Section 3.3:
  ``RDP(alpha) = log(A_alpha) / (alpha - 1)``, with A_alpha the binomial series (3.3.1)
  for integer alpha and the two-sided erfc series (3.3.2) for fractional alpha. With
  q = 1 it is the Gaussian mechanism's alpha / (2 sigma^2) (Mironov, "Renyi Differential
  Privacy", CSF 2017, Proposition 7).
* RDP composes additively over mechanisms (Mironov 2017, Proposition 1).
* Conversion to (eps, delta)-DP: Balle, Barthe, Gaboardi, Hsu & Sato, "Hypothesis
  Testing Interpretations and Renyi Differential Privacy", AISTATS 2020, Theorem 21:
  ``eps = rdp(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)``,
  minimised over the orders.

The series are evaluated exactly as the reference implementation in TF Privacy and
Opacus does (same terms, same stopping rule), vectorised per order; the figures agree
with Opacus's `compute_rdp` / `get_privacy_spent` to float rounding, never below it
(tests/privacy/test_accountant_against_opacus.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["epsilon_from_rdp", "sampled_gaussian_rdp"]

# Fractional-order series: terms are summed until both tails fall below exp(-30)
# (the reference implementations' stopping rule), in blocks of this many terms.
_SERIES_BLOCK = 64
_SERIES_MAX_TERMS = 1_000_000
_SERIES_CUTOFF = -30.0
_LOG_HALF = math.log(0.5)
# Rounding allowance added to every one-step figure with q < 1. The series sum up to a
# thousand terms; the summation order (here vectorised, in the reference sequential in
# log space) moves the last bits, by up to ~3e-11 relative and ~1e-13 absolute on the
# grid the tests pin. This allowance keeps the figure at or above the reference's
# whatever the order, so the accountant never reports less than it: an upper bound
# stays an upper bound, at a cost far below any printed digit.
RDP_ROUNDING_RELATIVE = 1e-10
RDP_ROUNDING_ABSOLUTE = 1e-12
_LOG_TWO = math.log(2)


def _log_sum(log_terms: np.ndarray) -> float:
    """log(sum_i exp(log_terms_i)), the largest term factored out and the rest added with
    log1p, so a sum within rounding of one keeps its small part (RDP of little noise or
    small q is the log of such a sum)."""
    top_index = int(np.argmax(log_terms))
    top = float(log_terms[top_index])
    if top == -math.inf:
        return -math.inf
    rest = np.delete(log_terms, top_index)
    return top + math.log1p(float(np.sum(np.exp(rest - top))))


def _log_sum_signed(log_terms: np.ndarray, signs: np.ndarray) -> float:
    """log(sum_i signs_i * exp(log_terms_i)); the sum must be positive."""
    finite = np.isfinite(log_terms)
    if not finite.any():
        return -math.inf
    terms, term_signs = log_terms[finite], signs[finite]
    top_index = int(np.argmax(terms))
    top = float(terms[top_index])
    if term_signs[top_index] < 0:
        raise ArithmeticError("sampled-Gaussian RDP series summed to a non-positive value")
    rest = float(np.sum(np.delete(term_signs * np.exp(terms - top), top_index)))
    if rest <= -1:
        raise ArithmeticError("sampled-Gaussian RDP series summed to a non-positive value")
    return top + math.log1p(rest)


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log(A_alpha) for integer alpha (Mironov, Talwar & Zhang 2019, Section 3.3):
    A_alpha = sum_{i=0}^{alpha} C(alpha, i) q^i (1 - q)^(alpha - i) exp((i^2 - i) / (2 sigma^2))."""
    # scipy: loaded only when an epsilon is composed, not by every importer of the ledger
    from scipy import special  # type: ignore[import-untyped]
    i = np.arange(alpha + 1, dtype=np.float64)
    with np.errstate(over="ignore"):
        log_binom = np.log(special.binom(alpha, i))
    overflowed = ~np.isfinite(log_binom)
    if overflowed.any():  # orders beyond ~1030: C(alpha, i) overflows a double
        log_binom[overflowed] = (special.gammaln(alpha + 1) - special.gammaln(i + 1)
                                 - special.gammaln(alpha - i + 1))[overflowed]
    log_terms = (log_binom + i * math.log(q) + (alpha - i) * math.log(1 - q)
                 + (i * i - i) / (2 * sigma**2))
    return _log_sum(log_terms)


def _log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    """log(A_alpha) for fractional alpha (Mironov, Talwar & Zhang 2019, Section 3.3):
    the integrals over (-inf, z0] and [z0, inf), z0 = sigma^2 log(1/q - 1) + 1/2, each a
    series in C(alpha, i) (signs alternate past alpha) times a Gaussian tail (erfc)."""
    # scipy: loaded only when an epsilon is composed, not by every importer of the ledger
    from scipy import special  # type: ignore[import-untyped]
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log_1q = math.log(q), math.log(1 - q)
    parts0: list[np.ndarray] = []
    parts1: list[np.ndarray] = []
    signs: list[np.ndarray] = []
    start = 0
    while True:
        i = np.arange(start, start + _SERIES_BLOCK, dtype=np.float64)
        coef = special.binom(alpha, i)
        log_coef = np.log(np.abs(coef))
        j = alpha - i
        log_t0 = log_coef + i * log_q + j * log_1q
        log_t1 = log_coef + j * log_q + i * log_1q
        # log(erfc(x)) = log 2 + log_ndtr(-x sqrt 2), accurate far into the tail.
        log_e0 = _LOG_HALF + _LOG_TWO + special.log_ndtr(-(i - z0) / (math.sqrt(2) * sigma)
                                                         * math.sqrt(2))
        log_e1 = _LOG_HALF + _LOG_TWO + special.log_ndtr(-(z0 - j) / (math.sqrt(2) * sigma)
                                                         * math.sqrt(2))
        log_s0 = log_t0 + (i * i - i) / (2 * sigma**2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma**2) + log_e1
        small = np.flatnonzero(np.maximum(log_s0, log_s1) < _SERIES_CUTOFF)
        stop = int(small[0]) + 1 if small.size else _SERIES_BLOCK  # the last term counts
        parts0.append(log_s0[:stop])
        parts1.append(log_s1[:stop])
        signs.append(np.where(coef[:stop] > 0, 1.0, -1.0))
        if small.size:
            break
        start += _SERIES_BLOCK
        if start >= _SERIES_MAX_TERMS:
            raise ArithmeticError(
                f"sampled-Gaussian RDP series for q={q}, sigma={sigma}, alpha={alpha} "
                "did not converge")
    sign = np.concatenate(signs)
    log_a0 = _log_sum_signed(np.concatenate(parts0), sign)
    log_a1 = _log_sum_signed(np.concatenate(parts1), sign)
    return float(np.logaddexp(log_a0, log_a1))


def sampled_gaussian_rdp(*, q: float, sigma: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of ONE step of the Poisson-subsampled Gaussian at every order in `orders`
    (Mironov, Talwar & Zhang 2019); `steps` steps cost `steps` times this (Mironov 2017,
    Proposition 1). Entries may be inf (no noise). Series figures (0 < q < 1) carry the
    rounding allowance RDP_ROUNDING_RELATIVE / RDP_ROUNDING_ABSOLUTE."""
    out = np.empty(len(orders), dtype=np.float64)
    for index, alpha in enumerate(orders):
        alpha = float(alpha)
        if q == 0:
            out[index] = 0.0
        elif sigma == 0:
            out[index] = math.inf
        elif q == 1.0:
            out[index] = alpha / (2 * sigma**2)
        elif math.isinf(alpha):
            out[index] = math.inf
        elif alpha.is_integer():
            out[index] = _with_allowance(_log_a_integer(q, sigma, int(alpha)) / (alpha - 1))
        else:
            out[index] = _with_allowance(_log_a_fractional(q, sigma, alpha) / (alpha - 1))
    return out


def _with_allowance(value: float) -> float:
    return value + abs(value) * RDP_ROUNDING_RELATIVE + RDP_ROUNDING_ABSOLUTE


def epsilon_from_rdp(
    *, orders: Sequence[float], rdp: Sequence[float] | np.ndarray, delta: float
) -> tuple[float, float]:
    """(epsilon, optimal order) for an RDP curve at `delta` (Balle et al. 2020, Theorem
    21). Orders whose bound is undefined (nan) are skipped; (inf, nan) if all are."""
    orders_vec = np.atleast_1d(np.asarray(orders, dtype=np.float64))
    rdp_vec = np.atleast_1d(np.asarray(rdp, dtype=np.float64))
    if orders_vec.shape != rdp_vec.shape:
        raise ValueError(f"{len(orders_vec)} orders but {len(rdp_vec)} RDP values")
    with np.errstate(invalid="ignore", divide="ignore"):
        eps = (rdp_vec - (np.log(delta) + np.log(orders_vec)) / (orders_vec - 1)
               + np.log((orders_vec - 1) / orders_vec))
    if np.isnan(eps).all():
        return math.inf, math.nan
    best = int(np.nanargmin(eps))
    return float(eps[best]), float(orders_vec[best])
