"""The clip factor every DP-SGD clipping path uses: min(1, C / (||g_u|| + 1e-6)) for a
privacy unit whose gradient norm is finite (Opacus' factor), and 0 for a unit whose norm,
or any value it is computed from, is NaN or infinite.

Why zero is allowed: DP-SGD's sensitivity argument needs only that each unit's
contribution f(g_u) has L2 norm at most C and is computed from that unit's records and
the public model alone (Abadi et al. 2016, "Deep Learning with Differential Privacy",
CCS, Sec. 3.1 and the proof of Thm. 1: the noise is calibrated to the bound C, whatever
maps g_u into the ball; Bu et al. 2023, "Automatic Clipping: Differentially Private Deep
Learning Made Easier and Stronger", NeurIPS: any per-sample clipping function with
||f(g)|| <= C has the privacy of Abadi's clipping). f(g) = 0 for a non-finite g is
such a function. So the clipped sum stays finite, adding or removing one unit still moves
it by at most C, and the Gaussian noise covers it.

Without this rule one unit's NaN makes the whole sum NaN and the site cannot upload:
a served model that overflows float32 only on the records it targets would learn from
the site's dropout whether such a record is there, outside the ledger.

Sums of squares accumulate in float64 (a float32 square overflows from |g| ~ 1.8e19); a
term a layer computes in float32 that overflows makes its unit's norm non-finite, hence
a zero contribution too.
"""

from __future__ import annotations

import torch

MAX_RECORD_GRADIENT_NORM = 1e30
"""Where one unit holds several records (patient-level DP), a unit any of whose records
has a per-layer gradient norm above this contributes zero as well: the book-keeping
products then sum terms of at most 1e30 each, which float32 (up to 3.4e38) holds for up
to a million records of a physical batch, so cancelling records of one unit cannot
overflow into a non-finite sum. An honest model's per-record gradients are many orders
of magnitude below it; the rule is public and depends on the unit's own records only."""


def clip_factors(squared: torch.Tensor, *, max_grad_norm: float) -> torch.Tensor:
    """float64 clip factor per unit from its squared gradient norm (any float dtype):
    min(1, C / (sqrt(squared) + 1e-6)), and 0 where `squared` is NaN or infinite (module
    docstring). A slightly negative `squared` (float cancellation) counts as 0."""
    wide = squared.to(torch.float64)
    norms = wide.clamp_min(0.0).sqrt()  # NaN stays NaN
    factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(wide), factor, torch.zeros_like(factor))


def usable(squared: torch.Tensor) -> torch.Tensor:
    """Which units contribute: those whose squared gradient norm is finite."""
    return torch.isfinite(squared)


def rows_to_zero(keep: torch.Tensor) -> torch.Tensor | None:
    """`keep` when some row is to be zeroed, else None: `zero_unusable_rows` then leaves
    every tensor as it is (no copy of activations or per-sample gradients in the usual
    step where every unit is finite)."""
    return None if bool(keep.all()) else keep


def zero_unusable_rows(values: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """`values` [n, ...] with the rows where `keep` [n] is False set to exactly 0 (a
    multiplication by 0 would leave NaN from an infinite value); `values` itself when
    `keep` is None (`rows_to_zero`)."""
    if keep is None:
        return values
    mask = keep.reshape(-1, *([1] * (values.dim() - 1))).to(values.device)
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def units_within_record_bound(record_squared: torch.Tensor, unit: torch.Tensor,
                              num_units: int) -> torch.Tensor:
    """Per unit: whether every record's largest per-layer squared gradient norm
    (`record_squared` [n], float64) is finite and at most MAX_RECORD_GRADIENT_NORM^2."""
    bad = ~(record_squared <= MAX_RECORD_GRADIENT_NORM ** 2)  # NaN counts as bad
    count = torch.zeros(num_units, dtype=torch.float64, device=record_squared.device)
    count.index_add_(0, unit, bad.to(torch.float64))
    return count == 0
