"""The DP mechanisms a ledger entry can record, with one tagged canonical JSON encoding.

Every value that leaves a site under DP is one of these (docs/privacy.md, "What is spent
on what"). Each records only its parameters, never data, so a ledger (and the
coordinator's replica of it) can be recomposed by anyone holding it.

Noise is always named by what it is, so "sigma" is never ambiguous:

* `SampledGaussian` (``"kind": "sampled_gaussian"``): DP-SGD, ``steps`` Poisson-sampled
  Gaussian steps, ``noise_multiplier`` = noise std / clipping norm (Abadi et al., CCS 2016).
  This is today's `Segment`, which stays its name for existing callers.
* `Gaussian` (``"gaussian"``): ``count`` releases with ABSOLUTE noise std ``noise_std``
  of a query with L2 sensitivity ``l2_sensitivity``; its noise multiplier is the ratio.
* `DistributedDiscreteGaussian` (``"distributed_discrete_gaussian"``): Kairouz, Liu &
  Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning with
  Secure Aggregation", ICML 2021. All quantities in RING units (after scaling by 1/gamma
  and randomized rounding): each of ``contributors`` sites adds discrete Gaussian noise of
  variance ``noise_variance_per_site`` per coordinate to a ``dimension``-long integer
  vector whose L2 (and L1) sensitivity is ``l2_sensitivity`` (``l1_sensitivity``).
  ``contributors`` is the PLANNED worst case (round-size floor minus colluding sites), not
  the number that happened to take part. Its guarantee is the paper's Proposition 14 RDP
  bound (a zCDP bound with the tau term), not a PLD.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final

from common.core.errors import ConfigError
from common.privacy.ddgauss import DDGaussPlan

KIND_SAMPLED_GAUSSIAN: Final = "sampled_gaussian"
KIND_GAUSSIAN: Final = "gaussian"
KIND_DDGAUSS: Final = "distributed_discrete_gaussian"
KINDS: Final = (KIND_SAMPLED_GAUSSIAN, KIND_GAUSSIAN, KIND_DDGAUSS)

# Relative tolerance when a stored tau is compared with its recomputation.
TAU_RELATIVE_TOLERANCE: Final = 1e-9


def _number(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(field, f"must be finite, got {value!r}")
    return float(value)


def _positive(field: str, value: object) -> float:
    number = _number(field, value)
    if number <= 0:
        raise ConfigError(field, f"must be > 0, got {value!r}")
    return number


def _count(field: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(field, f"must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Segment:
    """`steps` DP-SGD steps with one noise multiplier and one (Poisson) sample rate."""

    noise_multiplier: float
    sample_rate: float
    steps: int

    kind = KIND_SAMPLED_GAUSSIAN

    def __post_init__(self) -> None:
        sigma = _positive("noise_multiplier", self.noise_multiplier)
        rate = _number("sample_rate", self.sample_rate)
        if not 0 < rate <= 1:
            raise ConfigError("sample_rate", f"must be in (0, 1], got {self.sample_rate!r}")
        _count("steps", self.steps, minimum=0)
        # Normalise ints to floats so equal segments compare and hash equal.
        object.__setattr__(self, "noise_multiplier", sigma)
        object.__setattr__(self, "sample_rate", rate)

    def as_tuple(self) -> tuple[float, float, int]:
        return (self.noise_multiplier, self.sample_rate, self.steps)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "steps": self.steps,
        }


SampledGaussian = Segment
"""The Poisson-subsampled Gaussian mechanism of DP-SGD (same class as `Segment`)."""


@dataclass(frozen=True)
class Gaussian:
    """`count` Gaussian releases: noise std `noise_std` (absolute), L2 sensitivity
    `l2_sensitivity`; e.g. a DP count has sensitivity 1 per privacy unit."""

    noise_std: float
    l2_sensitivity: float
    count: int = 1

    kind = KIND_GAUSSIAN

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_std", _positive("noise_std", self.noise_std))
        object.__setattr__(
            self, "l2_sensitivity", _positive("l2_sensitivity", self.l2_sensitivity)
        )
        _count("count", self.count, minimum=1)

    @property
    def noise_multiplier(self) -> float:
        """Noise std in units of the sensitivity (what the accountants take)."""
        return self.noise_std / self.l2_sensitivity

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_std": self.noise_std,
            "l2_sensitivity": self.l2_sensitivity,
            "count": self.count,
        }


def ddgauss_tau(*, noise_variance_per_site: float, contributors: int) -> float:
    """tau = 10 * sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k+1)) (Kairouz et al. 2021,
    Theorem 1 / Proposition 14): how far a sum of n discrete Gaussians is from one."""
    return 10.0 * sum(
        math.exp(-2.0 * math.pi**2 * noise_variance_per_site * k / (k + 1))
        for k in range(1, contributors)
    )


@dataclass(frozen=True)
class DistributedDiscreteGaussian:
    """One securely summed release with noise added by `contributors` sites in the ring.

    `noise_variance_per_site` is s^2 for each site's N_Z(0, s^2), s the discrete
    Gaussian's parameter in grid units (its actual variance is at most s^2, KLS21); the
    sum's is `total_noise_variance` = n s^2. `contributors` = n is the planned worst case
    (round-size floor minus colluding sites). `l1_sensitivity` None: the bound
    min(sqrt(d) * Delta2, Delta2^2) is used, valid for integer vectors (|v_i| <= v_i^2).
    `count` identical releases compose as `count`. Build it from a round's plan with
    `from_plan` so the ledger records exactly what `common.privacy.ddgauss` ran.
    """

    noise_variance_per_site: float
    contributors: int
    l2_sensitivity: float
    dimension: int
    l1_sensitivity: float | None = None
    count: int = 1
    # Intermediaries: each hospital sent the sum of this many disjoint units,
    # each clipped alone. The sensitivities are per unit (the intermediary-level
    # guarantee, add/remove one unit; a patient inside a unit is the replace relation,
    # 2x: common.privacy.layered.record_level); a whole hospital is `units` of them
    # (`per_hospital`). Recorded only when > 1, so older entries keep their bytes.
    units: int = 1

    kind = KIND_DDGAUSS

    def __post_init__(self) -> None:
        variance = _positive("noise_variance_per_site", self.noise_variance_per_site)
        if variance < 0.25:
            # Proposition 14 assumes sigma >= 1/2 per site.
            raise ConfigError(
                "noise_variance_per_site", f"must be >= 0.25 (sigma >= 1/2), got {variance}"
            )
        object.__setattr__(self, "noise_variance_per_site", variance)
        _count("contributors", self.contributors, minimum=1)
        object.__setattr__(
            self, "l2_sensitivity", _positive("l2_sensitivity", self.l2_sensitivity)
        )
        _count("dimension", self.dimension, minimum=1)
        if self.l1_sensitivity is not None:
            object.__setattr__(
                self, "l1_sensitivity", _positive("l1_sensitivity", self.l1_sensitivity)
            )
        _count("count", self.count, minimum=1)
        _count("units", self.units, minimum=1)

    def per_hospital(self) -> DistributedDiscreteGaussian:
        """The same release seen from one whole hospital: its `units` rounded unit
        vectors move the sum by at most `units` x the per-unit sensitivities (triangle
        inequality), so the hospital-level guarantee is the v-fold one."""
        if self.units == 1:
            return self
        return DistributedDiscreteGaussian(
            noise_variance_per_site=self.noise_variance_per_site,
            contributors=self.contributors,
            l2_sensitivity=self.units * self.l2_sensitivity,
            dimension=self.dimension,
            l1_sensitivity=self.units * self.effective_l1_sensitivity,
            count=self.count,
        )

    @classmethod
    def from_plan(
        cls, plan: DDGaussPlan, *, replacement: bool = False, units: int = 1
    ) -> DistributedDiscreteGaussian:
        """The mechanism of one round planned by `common.privacy.ddgauss.plan_ddgauss`
        (`replacement`: sensitivities doubled, for the replace-one-site relation)."""
        factor = 2.0 if replacement else 1.0
        return cls(
            noise_variance_per_site=plan.site_sigma**2,
            contributors=plan.n_noise,
            l2_sensitivity=factor * plan.l2_sensitivity,
            dimension=plan.padded_dim,
            l1_sensitivity=factor * plan.l1_sensitivity,
            units=units,
        )

    @property
    def total_noise_variance(self) -> float:
        """Variance of the summed noise per coordinate, in ring units (n * sigma^2)."""
        return self.contributors * self.noise_variance_per_site

    @property
    def tau(self) -> float:
        return ddgauss_tau(
            noise_variance_per_site=self.noise_variance_per_site, contributors=self.contributors
        )

    @property
    def effective_l1_sensitivity(self) -> float:
        if self.l1_sensitivity is not None:
            return self.l1_sensitivity
        return min(math.sqrt(self.dimension) * self.l2_sensitivity, self.l2_sensitivity**2)

    def rdp(self, order: float) -> float:
        """Renyi DP of one release at `order` > 1: Proposition 14 of Kairouz et al. 2021,
        the minimum of its three bounds (sigma here is the per-site std)."""
        n, d, tau = self.contributors, self.dimension, self.tau
        central_std = math.sqrt(n * self.noise_variance_per_site)
        l2_scale = self.l2_sensitivity / central_std
        l1_scale = self.effective_l1_sensitivity / central_std
        term_1 = order / 2.0 * l2_scale**2 + tau * d
        term_2 = order / 2.0 * (l2_scale**2 + 2.0 * l1_scale * tau + tau**2 * d)
        term_3 = order / 2.0 * (l2_scale + math.sqrt(d) * tau) ** 2
        return min(term_1, term_2, term_3)

    @property
    def zcdp_rho(self) -> float:
        """rho with D_alpha <= rho * alpha for all alpha > 1 (what the ledger reports as
        the zCDP guarantee): Proposition 14's three terms bounded by linear ones, the
        first via tau*d <= tau*d*alpha. The accountant composes `rdp` (tighter) instead."""
        n, d, tau = self.contributors, self.dimension, self.tau
        central_std = math.sqrt(n * self.noise_variance_per_site)
        l2_scale = self.l2_sensitivity / central_std
        l1_scale = self.effective_l1_sensitivity / central_std
        rho_1 = l2_scale**2 / 2.0 + tau * d
        rho_2 = (l2_scale**2 + 2.0 * l1_scale * tau + tau**2 * d) / 2.0
        rho_3 = (l2_scale + math.sqrt(d) * tau) ** 2 / 2.0
        return min(rho_1, rho_2, rho_3)

    def to_json_dict(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "noise_variance_per_site": self.noise_variance_per_site,
            "contributors": self.contributors,
            "l2_sensitivity": self.l2_sensitivity,
            "l1_sensitivity": self.l1_sensitivity,
            "dimension": self.dimension,
            "count": self.count,
            # Derived, recorded so a reader sees it; checked against recomputation on read.
            "tau": self.tau,
        }
        if self.units > 1:
            out["units"] = self.units
        return out


Mechanism = Segment | Gaussian | DistributedDiscreteGaussian
MECHANISM_TYPES: Final = (Segment, Gaussian, DistributedDiscreteGaussian)


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, floats as Python's shortest round-trip repr: the same
    values always give the same bytes (the ledger's hashes and signatures depend on it)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def mechanism_to_json_dict(mechanism: Mechanism) -> dict[str, Any]:
    if not isinstance(mechanism, MECHANISM_TYPES):
        raise ConfigError("mechanisms", f"not a mechanism: {type(mechanism).__name__}")
    return mechanism.to_json_dict()


def _expect_keys(kind: str, raw: dict[str, Any], keys: set[str]) -> None:
    if set(raw) != keys:
        raise ConfigError(
            "mechanisms", f"{kind} needs exactly the fields {sorted(keys)}, got {sorted(raw)}"
        )


def mechanism_from_json_dict(raw: object) -> Mechanism:
    """Strict inverse of `mechanism_to_json_dict` (ConfigError on anything else).

    A format-1 segment ``[sigma, q, steps]`` is read as a sampled Gaussian."""
    if isinstance(raw, list) and len(raw) == 3:
        return Segment(raw[0], raw[1], raw[2])
    if not isinstance(raw, dict):
        raise ConfigError("mechanisms", f"a mechanism is a JSON object, got {raw!r}")
    kind = raw.get("kind")
    if kind == KIND_SAMPLED_GAUSSIAN:
        _expect_keys(kind, raw, {"kind", "noise_multiplier", "sample_rate", "steps"})
        return Segment(raw["noise_multiplier"], raw["sample_rate"], raw["steps"])
    if kind == KIND_GAUSSIAN:
        _expect_keys(kind, raw, {"kind", "noise_std", "l2_sensitivity", "count"})
        return Gaussian(raw["noise_std"], raw["l2_sensitivity"], raw["count"])
    if kind == KIND_DDGAUSS:
        units = raw.get("units", 1)
        if "units" in raw and units == 1:
            raise ConfigError("mechanisms", "units = 1 is recorded by leaving it out")
        _expect_keys(
            kind,
            {k: v for k, v in raw.items() if k != "units"},
            {
                "kind",
                "noise_variance_per_site",
                "contributors",
                "l2_sensitivity",
                "l1_sensitivity",
                "dimension",
                "count",
                "tau",
            },
        )
        mechanism = DistributedDiscreteGaussian(
            noise_variance_per_site=raw["noise_variance_per_site"],
            contributors=raw["contributors"],
            l2_sensitivity=raw["l2_sensitivity"],
            dimension=raw["dimension"],
            l1_sensitivity=raw["l1_sensitivity"],
            count=raw["count"],
            units=units,
        )
        stored_tau = _number("tau", raw["tau"])
        if not math.isclose(stored_tau, mechanism.tau, rel_tol=TAU_RELATIVE_TOLERANCE,
                            abs_tol=1e-300):
            raise ConfigError("tau", f"recorded {stored_tau!r} != recomputed {mechanism.tau!r}")
        return mechanism
    raise ConfigError("mechanisms", f"unknown mechanism kind {kind!r}; known: {KINDS}")


def mechanisms_to_json(mechanisms: tuple[Mechanism, ...] | list[Mechanism]) -> str:
    """Canonical text of a list of mechanisms (order kept: it is what the site ran)."""
    return canonical_json([mechanism_to_json_dict(m) for m in mechanisms]).decode("ascii")


def describe(mechanism: Mechanism) -> str:
    """One human line (for `medfed ledger show`)."""
    if isinstance(mechanism, Segment):
        return (
            f"DP-SGD sampled Gaussian: noise multiplier {mechanism.noise_multiplier:g}, "
            f"sample rate {mechanism.sample_rate:g}, {mechanism.steps} steps"
        )
    if isinstance(mechanism, Gaussian):
        return (
            f"Gaussian: noise std {mechanism.noise_std:g}, L2 sensitivity "
            f"{mechanism.l2_sensitivity:g}, x{mechanism.count}"
        )
    return (
        f"distributed discrete Gaussian: {mechanism.contributors} contributors x variance "
        f"{mechanism.noise_variance_per_site:g} (total {mechanism.total_noise_variance:g}), "
        f"L2 sensitivity {mechanism.l2_sensitivity:g}, d={mechanism.dimension}, "
        f"tau={mechanism.tau:.3g}, zCDP rho={mechanism.zcdp_rho:.4g}, x{mechanism.count}"
        + (f", per intermediary ({mechanism.units} per hospital)" if mechanism.units > 1 else "")
    )
