"""Epsilon of a site's WHOLE DP-SGD history, composed with Opacus's accountants.

A site trains with the Poisson-subsampled Gaussian mechanism: each local step samples
records (or patients) with rate ``q`` and adds Gaussian noise ``sigma * C``. Its history
is a list of segments (sigma, q, steps). Privacy loss across rounds is obtained by
composing the whole history in one accountant call, never by summing per-round
epsilons (that is basic composition, far too pessimistic for a ledger).

Accountants (both Opacus's implementations):

* ``"prv"`` (default): numerical composition of privacy-loss random variables,
  Gopi, Lee & Wutschitz, "Numerical Composition of Differential Privacy", NeurIPS 2021.
  Tight; the value returned is Opacus's *upper* bound (estimate + ``eps_error``).
* ``"rdp"``: Renyi DP, Mironov, "Renyi Differential Privacy", CSF 2017, with the
  sampled-Gaussian RDP of Mironov, Talwar & Zhang, "Renyi Differential Privacy of the
  Sampled Gaussian Mechanism", 2019. A looser but always-available upper bound.

Fallback: PRV discretises the privacy loss on a mesh whose size grows with the number
of steps and the loss range; for extreme histories (very little noise, huge sampling
rates) that mesh would need gigabytes, and Opacus may also raise. In those cases we use
RDP instead, which is a valid (larger) upper bound, and say so in `EpsilonReport`.
Everything here is deterministic: same history, same epsilon.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.errors import ConfigError

ACCOUNTANTS = ("prv", "rdp")

# Opacus's default RDP orders plus larger ones: for small epsilons (lots of noise) the
# optimal order is above 63 and Opacus would warn and return a looser bound.
RDP_ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)),
    *(float(a) for a in range(12, 64)),
    64.0,
    80.0,
    96.0,
    128.0,
    192.0,
    256.0,
    512.0,
    1024.0,
)

# Largest PRV discretisation mesh we accept (points). Each point costs a few float64 /
# complex128 array cells during the FFT convolution; 4M points stay well under 1 GiB.
MAX_PRV_DOMAIN_POINTS = 4_000_000

# Opacus's PRV error parameters, passed explicitly so a future default change cannot
# silently change a ledger's recomputed epsilons.
PRV_EPS_ERROR = 0.01

# Opacus's bound on the noise-multiplier search (opacus.accountants.utils.MAX_SIGMA).
MAX_NOISE_MULTIPLIER = 1e6


@dataclass(frozen=True)
class Segment:
    """`steps` DP-SGD steps with one noise multiplier and one (Poisson) sample rate."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        sigma = self.noise_multiplier
        if isinstance(sigma, bool) or not isinstance(sigma, int | float):
            raise ConfigError("noise_multiplier", f"must be a number, got {sigma!r}")
        if not (math.isfinite(sigma) and sigma > 0):
            raise ConfigError("noise_multiplier", f"must be finite and > 0, got {sigma!r}")
        rate = self.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise ConfigError("sample_rate", f"must be a number, got {rate!r}")
        if not (math.isfinite(rate) and 0 < rate <= 1):
            raise ConfigError("sample_rate", f"must be in (0, 1], got {rate!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int):
            raise ConfigError("steps", f"must be an integer, got {self.steps!r}")
        if self.steps < 0:
            raise ConfigError("steps", f"must be >= 0, got {self.steps}")
        # Normalise ints to floats so equal segments compare and hash equal.
        object.__setattr__(self, "noise_multiplier", float(sigma))
        object.__setattr__(self, "sample_rate", float(rate))

    def as_tuple(self) -> tuple[float, float, int]:
        return (self.noise_multiplier, self.sample_rate, self.steps)


@dataclass(frozen=True)
class EpsilonReport:
    """Result of one composition: which accountant actually produced `epsilon`.

    `accountant` is the one used; when PRV could not be used it is ``"rdp"``,
    `requested_accountant` stays ``"prv"`` and `fallback_reason` says why.
    """

    epsilon: float
    delta: float
    accountant: str
    requested_accountant: str = ""
    fallback_reason: str | None = None

    @property
    def fell_back(self) -> bool:
        return self.fallback_reason is not None


class _PrvTooCostly(Exception):
    """Internal: the PRV mesh for this history would be too large."""


def _check_delta(delta: float) -> None:
    if isinstance(delta, bool) or not isinstance(delta, int | float):
        raise ConfigError("delta", f"must be a number, got {delta!r}")
    if not (math.isfinite(delta) and 0 < delta < 1):
        raise ConfigError("delta", f"must be in (0, 1), got {delta!r}")


def _check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ConfigError("accountant", f"must be one of {ACCOUNTANTS}, got {accountant!r}")


def canonical_history(segments: Iterable[Segment]) -> list[tuple[float, float, int]]:
    """Merge segments with equal (sigma, q), drop empty ones, sort.

    Composition is commutative, so merging equal mechanisms wherever they occur is exact;
    it keeps the accountant fast (PRV cost grows with the number of distinct segments)
    and makes the result independent of history order, hence reproducible by `verify`.
    """
    steps_by_mechanism: dict[tuple[float, float], int] = {}
    for segment in segments:
        if not isinstance(segment, Segment):
            raise ConfigError("segments", f"expected Segment, got {type(segment).__name__}")
        if segment.steps == 0:
            continue
        key = (segment.noise_multiplier, segment.sample_rate)
        steps_by_mechanism[key] = steps_by_mechanism.get(key, 0) + segment.steps
    return [(sigma, q, steps) for (sigma, q), steps in sorted(steps_by_mechanism.items())]


def _new_prv_accountant() -> Any:
    from opacus.accountants import PRVAccountant

    class _GuardedPRVAccountant(PRVAccountant):  # type: ignore[misc]
        """Opacus PRV accountant that refuses meshes too large for this machine."""

        def _get_domain(self, **kwargs: Any) -> Any:
            domain = super()._get_domain(**kwargs)
            if domain.size > MAX_PRV_DOMAIN_POINTS:
                raise _PrvTooCostly(
                    f"PRV mesh of {domain.size} points exceeds {MAX_PRV_DOMAIN_POINTS}"
                )
            return domain

    return _GuardedPRVAccountant()


def _prv_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    accountant = _new_prv_accountant()
    accountant.history = list(history)
    # q = 1 makes Opacus take log(0) on a masked-out branch, and its domain sizing calls
    # RDP, which warns about extreme orders; both are harmless for the bound, only noisy.
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(accountant.get_epsilon(delta, eps_error=PRV_EPS_ERROR))


def _rdp_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = list(history)
    with warnings.catch_warnings():
        # "Optimal order is the largest alpha": the bound is still valid (just looser).
        warnings.simplefilter("ignore", UserWarning)
        return float(accountant.get_epsilon(delta, alphas=list(RDP_ORDERS)))


def account(segments: Sequence[Segment], *, delta: float, accountant: str = "prv") -> EpsilonReport:
    """(epsilon, delta) of the composition of ALL `segments`, with provenance."""
    _check_delta(delta)
    _check_accountant(accountant)
    history = canonical_history(segments)
    if not history:
        return EpsilonReport(0.0, float(delta), accountant, accountant)
    if accountant == "rdp":
        return EpsilonReport(_rdp_epsilon(history, delta), float(delta), "rdp", "rdp")
    try:
        epsilon = _prv_epsilon(history, delta)
        if not math.isfinite(epsilon) or epsilon < 0:
            raise ArithmeticError(f"PRV returned {epsilon!r}")
    except (_PrvTooCostly, ArithmeticError, ValueError, MemoryError, RuntimeError) as exc:
        # RDP upper-bounds the true epsilon too, so falling back never under-reports.
        reason = f"PRV accountant unusable for this history ({exc}); RDP bound used"
        return EpsilonReport(_rdp_epsilon(history, delta), float(delta), "rdp", "prv", reason)
    return EpsilonReport(epsilon, float(delta), "prv", "prv")


def compose_epsilon(segments: Sequence[Segment], *, delta: float, accountant: str = "prv") -> float:
    """Epsilon after the whole history `segments` (see `account` for provenance)."""
    return account(segments, delta=delta, accountant=accountant).epsilon


def epsilon_after(
    history: Sequence[Segment],
    new_segment: Segment | Sequence[Segment],
    *,
    delta: float,
    accountant: str = "prv",
) -> float:
    """Epsilon the site would have spent after adding `new_segment` to `history`."""
    extra = [new_segment] if isinstance(new_segment, Segment) else list(new_segment)
    return compose_epsilon([*history, *extra], delta=delta, accountant=accountant)


def plan_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
) -> float:
    """Smallest noise multiplier (within tolerance) whose whole planned schedule meets
    `target_epsilon`: calibrated once for rounds x local steps, not per round.

    The returned sigma satisfies ``compose_epsilon([Segment(sigma, q, steps)]) <=
    target_epsilon`` with the same accountant.
    """
    _check_delta(delta)
    _check_accountant(accountant)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError("target_epsilon", f"must be finite and > 0, got {target_epsilon!r}")
    if not (math.isfinite(epsilon_tolerance) and 0 < epsilon_tolerance < target_epsilon):
        raise ConfigError("epsilon_tolerance", "must be > 0 and below target_epsilon")
    probe = Segment(1.0, sample_rate, steps)  # validates sample_rate and steps
    if steps == 0:
        raise ConfigError("steps", "must be > 0 to plan a noise multiplier")

    def spent(sigma: float) -> float:
        segment = Segment(sigma, probe.sample_rate, steps)
        return compose_epsilon([segment], delta=delta, accountant=accountant)

    # Same bracketing + bisection as Opacus's `get_noise_multiplier`, but evaluated with
    # OUR guarded accountant (Opacus's own search can build a PRV mesh of many GiB for
    # small sigmas), so the planned sigma meets the target with exactly the accounting
    # the ledger will later apply. Invariant: spent(sigma_high) <= target_epsilon.
    sigma_low, sigma_high = 0.0, 10.0
    epsilon_high = math.inf
    while epsilon_high > target_epsilon:
        sigma_high *= 2
        if sigma_high > MAX_NOISE_MULTIPLIER:
            raise ConfigError(
                "target_epsilon", "unreachable for this schedule with any noise multiplier"
            )
        epsilon_high = spent(sigma_high)
    while target_epsilon - epsilon_high > epsilon_tolerance:
        sigma = (sigma_low + sigma_high) / 2
        epsilon = spent(sigma)
        if epsilon < target_epsilon:
            sigma_high, epsilon_high = sigma, epsilon
        else:
            sigma_low = sigma
        if sigma_high - sigma_low < 1e-6:
            break  # the tolerance cannot be met more closely; sigma_high still meets target
    return sigma_high
