"""Patient-level DP-SGD: the privacy unit is a patient, however many encounters they have.

Record-level DP-SGD clips each record's gradient to C, so a patient with m encounters
can move a step by up to m*C: the patient-level sensitivity is m*C (seed 003, Sec. 3),
and the record-level epsilon says nothing about them. Opacus has no patient-level mode
(Opacus issue #366). We do it here (user-level DP-SGD, McMahan et al. 2018, "Learning
Differentially Private Recurrent Language Models", Alg. 1 with per-user clipping):

1. Poisson-sample PATIENTS with rate q_p = expected_patients / n_patients; a sampled
   patient brings all their records.
2. Per-record gradients (torch.func vmap over grad), summed per patient (index_add_):
   g_p = sum_{r in p} grad loss(r).
3. Clip each per-patient gradient: g_p * min(1, C / ||g_p||), or 0 when g_p is not
   finite (`site_agent.finite_clipping`). Now adding or removing a patient moves the sum
   by at most C, whatever their number of encounters.
4. Sum, add N(0, sigma^2 C^2) noise, divide by the EXPECTED number of patients (not the
   realised one, which would itself depend on the sampled data).
5. Account with (sigma, q_p, steps): the subsampled Gaussian mechanism over patients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from common.core.errors import ConfigError
from site_agent.finite_clipping import clip_factors, rows_to_zero, usable, zero_unusable_rows

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def bce_with_logits(logit: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of one logit (the default loss of the tabular models)."""
    return nn.functional.binary_cross_entropy_with_logits(logit, target, reduction="sum")


def per_record_gradients(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    features: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: LossFn = bce_with_logits,
) -> dict[str, torch.Tensor]:
    """Gradient of each record's loss w.r.t. each parameter: name -> [B, *shape]."""

    def record_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (x.unsqueeze(0),))
        return loss_fn(out.reshape(-1), y.reshape(-1))

    result: dict[str, torch.Tensor] = vmap(grad(record_loss), in_dims=(None, 0, 0))(
        params, features, labels
    )
    return result


def clipped_unit_sum(
    per_record: dict[str, torch.Tensor],
    unit_of_record: torch.Tensor,
    num_units: int,
    *,
    max_grad_norm: float,
) -> dict[str, torch.Tensor]:
    """Sum over privacy units of each unit's clipped summed gradient (noiseless).

    `unit_of_record[i]` in [0, num_units) is the unit (patient) of record i. With
    ``unit_of_record = arange(B)`` this is ordinary record-level clipping.
    """
    if max_grad_norm <= 0:
        raise ConfigError("max_grad_norm", "must be positive")
    per_unit = {}
    for name, g in per_record.items():
        acc = torch.zeros((num_units, *g.shape[1:]), dtype=g.dtype, device=g.device)
        per_unit[name] = acc.index_add_(0, unit_of_record, g)
    squared = torch.zeros(num_units, dtype=torch.float64, device=unit_of_record.device)
    for g in per_unit.values():
        squared = squared + g.reshape(num_units, -1).pow(2).sum(dim=1).to(squared.dtype)
    # Opacus' factor min(1, C / (||g|| + 1e-6)); a unit whose gradient is not finite
    # contributes exactly zero (site_agent.finite_clipping).
    factor = clip_factors(squared, max_grad_norm=max_grad_norm)
    keep = rows_to_zero(usable(squared))
    return {
        name: torch.einsum("u,u...->...", factor.to(g.dtype), zero_unusable_rows(g, keep))
        for name, g in per_unit.items()
    }


def clipped_gradient_sum(
    model: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    unit_of_record: torch.Tensor,
    *,
    max_grad_norm: float,
    loss_fn: LossFn = bce_with_logits,
) -> torch.Tensor:
    """The noiseless clipped sum as one flat vector (what DP noise is added to)."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    _, unit_index = torch.unique(unit_of_record, return_inverse=True)
    num_units = int(unit_index.max().item()) + 1 if unit_index.numel() else 0
    grads = per_record_gradients(model, params, features, labels, loss_fn)
    summed = clipped_unit_sum(grads, unit_index, num_units, max_grad_norm=max_grad_norm)
    return torch.cat([summed[name].reshape(-1) for name in params])


class PatientSampler:
    """Poisson sampling of patients, returning the indices of their records.

    Records are grouped by patient once (CSR layout), so each step costs O(N).
    """

    def __init__(self, unit_of_record: torch.Tensor, *, sample_rate: float) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ConfigError("batch_size", f"patient sample rate {sample_rate} not in (0, 1]")
        self.unit_of_record = unit_of_record
        self.num_units = int(unit_of_record.max().item()) + 1
        self.sample_rate = sample_rate

    def sample(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(record indices, dense patient index per record, number of sampled patients)."""
        chosen = torch.rand(self.num_units, generator=generator) < self.sample_rate
        chosen = chosen.to(self.unit_of_record.device)
        records = torch.nonzero(chosen[self.unit_of_record], as_tuple=False).reshape(-1)
        dense = torch.cumsum(chosen.to(torch.int64), 0) - 1  # patient id -> 0..k-1
        return records, dense[self.unit_of_record[records]], int(chosen.sum().item())


class PatientLevelDPSGD:
    """One noisy, per-patient-clipped gradient per step, written into ``param.grad``."""

    def __init__(
        self,
        model: nn.Module,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_patients: float,
        max_physical_batch_size: int,
        generator: torch.Generator,
        loss_fn: LossFn = bce_with_logits,
    ) -> None:
        self.model = model
        self.noise_multiplier = noise_multiplier
        self.max_grad_norm = max_grad_norm
        self.expected_patients = expected_patients
        self.max_physical_batch_size = max_physical_batch_size
        self.generator = generator
        self.loss_fn = loss_fn

    def compute_grad(
        self,
        features: torch.Tensor,
        labels: torch.Tensor,
        patient_of_record: torch.Tensor,
        num_patients: int,
    ) -> None:
        """Set ``p.grad`` to (sum of clipped per-patient grads + noise) / E[patients].

        Records are processed in physical chunks; per-patient sums accumulate across
        chunks BEFORE clipping, so a patient split over two chunks is still one unit.
        """
        params = {name: p.detach() for name, p in self.model.named_parameters()}
        per_patient = {
            name: torch.zeros((num_patients, *p.shape), dtype=p.dtype, device=p.device)
            for name, p in params.items()
        }
        for start in range(0, int(features.shape[0]), self.max_physical_batch_size):
            stop = start + self.max_physical_batch_size
            grads = per_record_gradients(
                self.model, params, features[start:stop], labels[start:stop], self.loss_fn
            )
            for name, g in grads.items():
                per_patient[name].index_add_(0, patient_of_record[start:stop], g)
        if num_patients > 0:
            ones = torch.arange(num_patients, device=features.device)
            clipped = clipped_unit_sum(
                per_patient, ones, num_patients, max_grad_norm=self.max_grad_norm
            )
        else:
            clipped = {name: torch.zeros_like(p) for name, p in params.items()}
        std = self.noise_multiplier * self.max_grad_norm
        for name, p in self.model.named_parameters():
            noise = torch.normal(0.0, std, size=p.shape, generator=self.generator, device=p.device)
            p.grad = (clipped[name] + noise) / self.expected_patients
