"""How many intermediaries a hospital splits into: the adaptive rule of Jiang et al.

Jiang, Zhong, Le, Li, Dou, "Client-Level Differential Privacy via Adaptive
Intermediary in Federated Medical Imaging" (MICCAI 2023): with client-level DP and
few hospitals the aggregate is dominated by noise; splitting each hospital into v
disjoint intermediaries (each its own clipped unit) shrinks the noise relative to the
signal but adds heterogeneity. With the noise ratio xi = ||noise|| / ||aggregate|| and
the update ratio phi = (sum of unit update norms) / ||aggregate||, the paper picks
v = sqrt(N * xi / phi) for N hospitals.

`split_count` follows the authors' public code exactly: github med-air/Client-DP-FL,
``federated_dp/private_trainer.py``, ``PrivateFederatedTrainer.select_split_num``:
``ratio = xi / phi``, ``vn = sqrt(ratio * N)``, then, with ``current`` the number of
intermediaries per hospital in the round that was measured,

- ``vn < 1``: ``floor(current * vn)``;
- default mode: ``floor(vn * current)``;
- ``ada_stable``: ``floor(vn) * current``;
- ``ada_prog``: ``floor((vn * current - current) / 2) + current``.

The code has no lower clamp: ``vn < 1`` with one intermediary gives 0, which its
`split_virtual_client` cannot use (it divides by it). We return ``max(1, .)`` and,
with `maximum` (e.g. the hospital's patient count / a minimum group size), cap it;
both clamps are ours and are applied after the authors' rounding.

Norms: the authors sum each client's norm BEFORE clipping; in medfed the sum must
leave the site privately, so the caller passes norms clipped to S (noised like the
update, `common.privacy.hospital`). The formula is the same; only the input differs.

Scale: the authors' aggregate is the pure AVERAGE of the unit updates (client weights
1 / (N v)) and their noise is the noise on that average (std z S / (N v)); phi is not
scale-free, so `next_split_count` measures both on the average too. With the noise on
the average, v_next = floor(sqrt(lambda N) * v) does not depend on the v measured
(lambda scales as 1 / v^2), which is what makes the rule a fixed point.

Robustness (ours, not the paper's): the norm coordinate is linear in the ring, so ONE site
can put any value there (a hugely negative one made the floor, lambda and v = cap). As
post-processing, `next_split_count` keeps v when the decoded sum is not credibly inside
[0, U S] (`plausible_norm_sum`, `PLAUSIBLE_NORM_SIGMAS` of its planned noise) and moves
v by at most a factor `MAX_STEP_FACTOR` per round (`step_bounds`).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from common.core.errors import ConfigError

SplitMode = Literal["default", "stable", "progressive"]
SPLIT_MODES: tuple[SplitMode, ...] = ("default", "stable", "progressive")


def intermediary_ratio(*, noise_norm: float, aggregate_norm: float, unit_norm_sum: float) -> float:
    """lambda = xi / phi = ||noise|| / (sum of unit update norms); ||aggregate|| cancels."""
    if not (noise_norm >= 0 and math.isfinite(noise_norm)):
        raise ConfigError("noise_norm", "must be finite and >= 0")
    if not (aggregate_norm > 0 and math.isfinite(aggregate_norm)):
        raise ConfigError("aggregate_norm", "must be finite and > 0")
    if not (unit_norm_sum > 0 and math.isfinite(unit_norm_sum)):
        raise ConfigError("unit_norm_sum", "must be finite and > 0")
    # Computed as the authors do (both ratios first), so results match bit for bit.
    xi = noise_norm / aggregate_norm
    phi = unit_norm_sum / aggregate_norm
    return xi / phi


def split_count(
    *,
    noise_norm: float,
    aggregate_norm: float,
    unit_norm_sum: float,
    hospitals: int,
    current: int = 1,
    mode: SplitMode = "default",
    maximum: int | None = None,
) -> int:
    """Intermediaries per hospital for the next round (module docstring: the exact rule)."""
    if hospitals < 1:
        raise ConfigError("hospitals", "must be >= 1")
    if current < 1:
        raise ConfigError("current", "intermediaries per hospital must be >= 1")
    if mode not in SPLIT_MODES:
        raise ConfigError("mode", f"must be one of {SPLIT_MODES}")
    if maximum is not None and maximum < 1:
        raise ConfigError("maximum", "must be >= 1")
    ratio = intermediary_ratio(
        noise_norm=noise_norm, aggregate_norm=aggregate_norm, unit_norm_sum=unit_norm_sum
    )
    vn = float(pow(ratio * hospitals, 1.0 / 2))  # as the authors write it
    if vn < 1:
        count = math.floor(current * vn)
    elif mode == "stable":
        count = math.floor(vn) * current
    elif mode == "progressive":
        count = math.floor((vn * current - current) / 2.0) + current
    else:
        count = math.floor(vn * current)
    count = max(1, count)
    return count if maximum is None else min(count, maximum)


def expected_noise_norm(*, std: float, dim: int) -> float:
    """E||N(0, std^2 I_dim)|| = std sqrt(2) Gamma((dim+1)/2) / Gamma(dim/2) (~ std sqrt(dim)):
    the noise norm the coordinator takes from the plan (it never sees the noise)."""
    if not (std >= 0 and math.isfinite(std)):
        raise ConfigError("std", "must be finite and >= 0")
    if dim < 1:
        raise ConfigError("dim", "must be >= 1")
    return std * math.sqrt(2.0) * math.exp(math.lgamma((dim + 1) / 2) - math.lgamma(dim / 2))


PLAUSIBLE_NORM_SIGMAS = 3.0
"""A decoded unit norm sum is a measurement only inside (k sigma, U S + k sigma), k this,
sigma the norm coordinate's planned noise std: outside it, honest noise explains it with
probability < 0.14 % per side, and a site that pushes it there (the coordinate is
linear in the ring) moves nothing."""
MAX_STEP_FACTOR = 2
"""v moves at most by this factor per round (v // 2 <= v_next <= 2 v): what one round's
measurement, honest or steered by a site inside the plausible range, can do."""


def plausible_norm_sum(
    unit_norm_sum: float, *, norm_noise_std: float, units: int, clip: float,
) -> bool:
    """Whether a decoded norm sum is credibly a measurement (`PLAUSIBLE_NORM_SIGMAS`): the
    true sum lies in [0, units * S], so a value not clearly above 0, or clearly above
    units * S, is noise or a site's doing, never information about the updates."""
    if not (math.isfinite(unit_norm_sum) and math.isfinite(norm_noise_std)):
        return False
    margin = PLAUSIBLE_NORM_SIGMAS * max(norm_noise_std, 0.0)
    return margin < unit_norm_sum <= units * clip + margin


def step_bounds(current: int, *, maximum: int) -> tuple[int, int]:
    """[low, high] for the next v from `current` (`MAX_STEP_FACTOR`), within [1, maximum].

    >>> step_bounds(8, maximum=100)
    (4, 16)
    >>> step_bounds(8, maximum=10), step_bounds(1, maximum=10)
    ((4, 10), (1, 2))
    """
    low = max(1, current // MAX_STEP_FACTOR)
    high = max(1, min(current * MAX_STEP_FACTOR, maximum))
    return min(low, high), high


def next_split_count(
    *,
    mean_update: np.ndarray,
    mean_noise_std: float,
    unit_norm_sum: float,
    norm_noise_std: float,
    units: int,
    clip: float,
    hospitals: int,
    current: int,
    maximum: int,
    mode: SplitMode = "default",
) -> int:
    """v for the next round from one decoded hospital round.

    As the authors' code measures it (`_private_grad_aggregation`): the aggregate is the
    pure average of the `units` clipped unit updates (what the model steps by), the noise
    is the noise on that average, N(0, mean_noise_std^2) per coordinate of the d model
    coordinates (`expected_noise_norm`: taken from the plan, the coordinator never sees
    it), and `unit_norm_sum` the sum of the clipped unit norms, decoded from the norm
    coordinate, with noise std `norm_noise_std` (the plan's z S' / c). `current` is the
    v of the round measured (the authors' ``virtual_clients``).

    Post-processing only, with two guards of ours (one site can move the
    norm coordinate anywhere, it is linear in the ring): a sum outside
    `plausible_norm_sum` is no measurement and v stays `current`; a plausible one is
    projected onto (0, units * S] and the authors' v is then kept within
    `step_bounds` (at most x2 or /2 per round) and [1, maximum].
    """
    if units < 1 or clip <= 0:
        raise ConfigError("units", "a measured round has at least one unit and S > 0")
    keep = min(max(current, 1), maximum)
    aggregate_norm = float(np.linalg.norm(np.asarray(mean_update, dtype=np.float64)))
    if not (aggregate_norm > 0 and math.isfinite(aggregate_norm)):
        return keep  # nothing measured: keep v
    if not plausible_norm_sum(unit_norm_sum, norm_noise_std=norm_noise_std, units=units,
                              clip=clip):
        return keep
    noise_norm = expected_noise_norm(std=mean_noise_std, dim=int(np.asarray(mean_update).size))
    norm_sum = min(unit_norm_sum, units * clip)
    rule = split_count(noise_norm=noise_norm, aggregate_norm=aggregate_norm,
                       unit_norm_sum=norm_sum, hospitals=hospitals, current=current,
                       mode=mode, maximum=maximum)
    low, high = step_bounds(current, maximum=maximum)
    return min(max(rule, low), high)
