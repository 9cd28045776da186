"""Numerical composition of privacy-loss random variables (PRVs), pure numpy/scipy.

Gopi, Lee & Wutschitz, "Numerical Composition of Differential Privacy", NeurIPS 2021
(arXiv:2106.02848). Each mechanism of a history, a Poisson-subsampled Gaussian (noise
multiplier sigma, sampling rate q; q = 1 is the plain Gaussian), is described by its
privacy-loss random variable Y. Composition adds independent PRVs, so the composed
density is the convolution of theirs:

1. Truncation (Remark 5.6): the domain [-L, L] with L from the RDP epsilon of the whole
   history at delta_error / 4 and of each mechanism once at delta_error / (8 k) (k the
   number of compositions), plus 3; the mesh is eps_error / sqrt(k log(12 / delta_error)
   / 2). The RDP figures are `common.privacy.rdp` (Mironov, Talwar & Zhang 2019, Balle
   et al. 2020) at the reference implementation's orders.
2. The PRV's CDF in closed form (Appendix B, Propositions B1 and B4): with
   z = log((e^t + q - 1) / q), for t > log(1 - q),
   ``F(t) = 1 - q erfc((2 z sigma^2 - 1) / (2 sqrt 2 sigma)) / 2
   - (1 - q) erfc((2 z sigma^2 + 1) / (2 sqrt 2 sigma)) / 2``, and 0 below.
3. Discretisation (Section 5): the truncated PRV's mass on each mesh cell, its grid then
   shifted so the discrete mean equals the continuous one (the mean-preserving
   discretisation the error analysis needs).
4. Composition: each mechanism composed with itself `steps` times by FFT
   (pmf -> rfft ** steps -> irfft), then the distinct mechanisms convolved pairwise.
5. Epsilon (Section 5): delta(eps) = E[(1 - e^(eps - Y))_+] from the composed pmf; the
   bound returned is the epsilon at delta - delta_error, plus eps_error (Theorem 5.5), an
   UPPER bound on the true epsilon (plus a rounding allowance of 1e-7 of it).

Steps 1-5 follow the authors' implementation (github.com/microsoft/prv_accountant) as
Opacus carries it (`opacus.accountants.PRVAccountant`): same domain, same grid, same
error parameters (delta_error = delta / 1000), same quadrature of the mean, so the
epsilons agree with Opacus's to ~1e-8 relative and, with the allowance, never fall below
them (tests/privacy/test_accountant_against_opacus.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.privacy.rdp import epsilon_from_rdp, sampled_gaussian_rdp

__all__ = ["PRV_RDP_ORDERS", "PrvDomainTooLarge", "prv_epsilon"]

# The reference implementation sizes the domain with these RDP orders.
PRV_RDP_ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)), *(float(a) for a in range(12, 64)),
)

_SQRT2 = math.sqrt(2)
# Rounding allowance on the returned epsilon. The FFTs and the convolution move the last
# digits (within ~1e-8 relative of the reference implementation, either side, on the
# grid the tests pin); the allowance keeps the figure at or above the reference's, so
# the bound never reports less than it. 1e-7 of epsilon is far below eps_error (0.01),
# any printed digit and the ledger's recomposition tolerance (1e-6).
PRV_ROUNDING_RELATIVE = 1e-7
class PrvDomainTooLarge(Exception):
    """The discretisation mesh for this history exceeds the point limit."""


@dataclass(frozen=True)
class _Domain:
    t_min: float
    t_max: float
    size: int
    shifts: float = 0.0

    @classmethod
    def aligned(cls, t_min: float, t_max: float, dt: float) -> _Domain:
        """[t_min, t_max] widened to multiples of dt, an even number of points."""
        t_min = float(np.floor(t_min / dt) * dt)
        t_max = float(np.ceil(t_max / dt) * dt)
        size = int(np.round((t_max - t_min) / dt)) + 1
        if size % 2 == 1:
            size += 1
            t_max += dt
        domain = cls(t_min, t_max, size)
        if abs(domain.dt - dt) / dt >= 1e-8:
            raise ArithmeticError("PRV mesh misaligned")
        return domain

    @property
    def dt(self) -> float:
        return (self.t_max - self.t_min) / (self.size - 1)

    @property
    def ts(self) -> np.ndarray:
        return np.linspace(self.t_min, self.t_max, self.size)

    def shifted(self, by: float) -> _Domain:
        return _Domain(self.t_min + by, self.t_max + by, self.size, self.shifts + by)


def _cdf(t: np.ndarray, *, q: float, sigma: float) -> np.ndarray:
    """CDF of the PRV of the Poisson-subsampled Gaussian (Gopi et al. 2021, Prop. B4)."""
    # scipy: loaded only when an epsilon is composed, not by every importer of the ledger
    from scipy import special  # type: ignore[import-untyped]

    t = np.asarray(t, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        floor = np.log(1 - q)
        inside = t > floor
        z = np.log(np.where(inside, (np.exp(t) + q - 1) / q, 1.0))
        value = (-q * special.erfc((2 * z * sigma**2 - 1) / (2 * _SQRT2 * sigma)) / 2
                 - (1 - q) * special.erfc((2 * z * sigma**2 + 1) / (2 * _SQRT2 * sigma)) / 2
                 + 1.0)
    return np.where(inside, value, 0.0)


class _TruncatedPrv:
    """The PRV conditioned on [t_min, t_max)."""

    def __init__(self, *, q: float, sigma: float, t_min: float, t_max: float) -> None:
        self.q, self.sigma, self.t_min, self.t_max = q, sigma, t_min, t_max
        self._low = float(_cdf(np.array(t_min), q=q, sigma=sigma))
        self._mass = float(_cdf(np.array(t_max), q=q, sigma=sigma)) - self._low

    def cdf(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        inner = (_cdf(t, q=self.q, sigma=self.sigma) - self._low) / self._mass
        return np.where(t < self.t_min, 0.0, np.where(t < self.t_max, inner, 1.0))

    def mean(self) -> float:
        """E[Y] = t_max F(t_max) - t_min F(t_min) - integral of F over [t_min, t_max]
        (integration by parts), on breakpoints dense near 0 where F varies fastest.

        Integrated by adaptive quadrature (QUADPACK's QAGS, scipy's `quad`, limit 500) on
        the reference implementation's breakpoints: its shift moves epsilon by up to
        ~1e-6 relative for small q and thousands of steps, and ledgers record epsilons
        the reference computed, which `verify` recomposes within 1e-6 relative."""
        # scipy: loaded only when an epsilon is composed, not by every importer of the ledger
        from scipy import integrate  # type: ignore[import-untyped]

        low_exp = int(np.log10(abs(self.t_min)))
        high_exp = int(np.log10(self.t_max))
        points = np.concatenate([
            [self.t_min], -np.logspace(low_exp, -5, num=10), [0.0],
            np.logspace(-5, high_exp, num=10), [self.t_max],
        ])
        mean = 0.0
        for left, right in itertools.pairwise(points):
            integral, _ = integrate.quad(self.cdf, left, right, limit=500)
            mean += (right * float(self.cdf(np.array(right)))
                     - left * float(self.cdf(np.array(left))) - integral)
        return mean


def _discretise(prv: _TruncatedPrv, domain: _Domain) -> tuple[np.ndarray, _Domain]:
    """Mass of each mesh cell, grid shifted to preserve the mean (Gopi et al. 2021, Sec. 5)."""
    ts = domain.ts
    # Each cell's mass as F(right) - F(left), both evaluated (not one F per shared edge):
    # the CDF's rounding near 1 leaves ~1e-16 of noise in tail cells, which the
    # e^t-weighted delta sum amplifies to ~1e-7 of epsilon, so the grid is evaluated
    # exactly as the reference does.
    pmf = prv.cdf(ts + domain.dt / 2) - prv.cdf(ts - domain.dt / 2)
    shift = prv.mean() - float(np.dot(ts, pmf))
    if abs(shift) >= domain.dt / 2:
        raise ArithmeticError("discrete PRV mean differs from the continuous mean by "
                              "half a mesh cell or more")
    return pmf, domain.shifted(shift)


def _self_compose(pmf: np.ndarray, domain: _Domain, times: int) -> tuple[np.ndarray, _Domain]:
    """pmf convolved with itself `times` times by FFT, re-centred on the grid."""
    # scipy: loaded only when an epsilon is composed, not by every importer of the ledger
    from scipy import fft  # type: ignore[import-untyped]

    composed = fft.irfft(fft.rfft(pmf) ** times, n=len(pmf))
    roll = times - 1
    if times % 2 == 0:
        roll += len(composed) // 2
    return np.roll(composed, roll), domain.shifted(domain.shifts * (times - 1))


def _convolve_same(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Linear convolution of two equal-length pmfs, its central part (length kept)."""
    # scipy: loaded only when an epsilon is composed, not by every importer of the ledger
    from scipy import fft  # type: ignore[import-untyped]

    n = len(left)
    full_length = 2 * n - 1
    size = fft.next_fast_len(full_length, real=True)
    full = fft.irfft(fft.rfft(left, size) * fft.rfft(right, size), size)[:full_length]
    start = (full_length - n) // 2
    return np.asarray(full[start:start + n])


def _domain_bound(history: Sequence[tuple[float, float, int]], delta_error: float,
                  eps_error: float) -> float:
    """Truncation bound L (Gopi et al. 2021, Remark 5.6, as the authors implement it)."""
    total = sum(steps for _, _, steps in history)
    curves = [_rdp_curve(sigma, q) for sigma, q, _ in history]
    whole = sum((curve * steps for curve, (_, _, steps) in zip(curves, history, strict=True)),
                np.zeros(len(PRV_RDP_ORDERS)))
    bound = epsilon_from_rdp(orders=PRV_RDP_ORDERS, rdp=whole, delta=delta_error / 4)[0]
    for curve in curves:
        bound = max(bound, epsilon_from_rdp(orders=PRV_RDP_ORDERS, rdp=curve,
                                            delta=delta_error / (8 * total))[0])
    return max(bound, eps_error) + 3


@functools.lru_cache(maxsize=1024)
def _rdp_curve(sigma: float, q: float) -> np.ndarray:
    curve = sampled_gaussian_rdp(q=q, sigma=sigma, orders=PRV_RDP_ORDERS)
    curve.setflags(write=False)
    return curve


def clear_caches() -> None:
    _rdp_curve.cache_clear()


def prv_epsilon(
    history: Sequence[tuple[float, float, int]], *, delta: float, eps_error: float,
    max_points: int,
) -> float:
    """Upper bound on epsilon at `delta` of the composition of `history`, a sequence of
    (noise multiplier, sampling rate, steps) with steps > 0.

    Raises PrvDomainTooLarge when the mesh would exceed `max_points`, ArithmeticError
    when the numerics cannot give a bound (delta too small for the mesh, say)."""
    if not history:
        return 0.0
    delta_error = delta / 1000
    total = sum(steps for _, _, steps in history)
    bound = _domain_bound(history, delta_error, eps_error)
    mesh = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
    domain = _Domain.aligned(-bound, bound, float(mesh))
    if domain.size > max_points:
        raise PrvDomainTooLarge(f"PRV mesh of {domain.size} points exceeds {max_points}")
    parts: list[tuple[np.ndarray, _Domain]] = []
    for sigma, q, steps in history:
        prv = _TruncatedPrv(q=q, sigma=sigma, t_min=domain.t_min, t_max=domain.t_max)
        pmf, shifted = _discretise(prv, domain)
        parts.append(_self_compose(pmf, shifted, steps))
    # Pairwise convolution tree (an odd one out waits for the next level).
    while len(parts) > 1:
        level = [parts.pop()] if len(parts) % 2 == 1 else []
        for (left, left_domain), (right, right_domain) in zip(parts[:-1:2], parts[1::2],
                                                              strict=True):
            level.append((_convolve_same(left, right),
                          left_domain.shifted(right_domain.shifts)))
        parts = level
    pmf, composed = parts[0]
    upper = _epsilon_upper(pmf, composed, delta=delta, delta_error=delta_error,
                           eps_error=eps_error)
    return upper + abs(upper) * PRV_ROUNDING_RELATIVE


def _epsilon_upper(pmf: np.ndarray, domain: _Domain, *, delta: float, delta_error: float,
                   eps_error: float) -> float:
    """Smallest eps on the grid with delta(eps) <= delta - delta_error, plus eps_error
    (Gopi et al. 2021, Theorem 5.5): delta(eps) = sum_{t >= eps} p(t) (1 - e^(eps - t))."""
    if np.finfo(np.longdouble).eps * domain.size > delta - delta_error:
        raise ArithmeticError("delta too small for this PRV mesh: rounding would dominate")
    t = domain.ts
    tail = np.flip(np.cumsum(np.flip(pmf)))
    tail_weighted = np.flip(np.cumsum(np.flip(pmf * np.exp(-t))))
    neg_delta = np.exp(t) * tail_weighted - tail
    target = delta - delta_error
    index = int(np.searchsorted(neg_delta, -target, side="left"))
    if not 0 < index < len(tail):
        raise ArithmeticError("PRV composition cannot bound epsilon at this delta")
    return float(np.log((tail[index] - target) / tail_weighted[index])) + eps_error
