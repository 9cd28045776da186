"""The clipped gradient sum of one patient-level DP-SGD step (site_agent.patient_dp has
the mechanism and its paper), memory-bounded by the physical batch.

Fast path: `site_agent.unit_clipping.UnitClipper` (per-patient norms by ghost clipping,
the clipped sum by book-keeping, one forward and one backward pass, loss included).
Models it does not support take the per-record reference (`per_record_gradients`,
vmap over grad), which is exact but materialises every record's gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from common.core.errors import ConfigError
from site_agent.finite_clipping import clip_factors, usable
from site_agent.patient_dp import LossFn, clipped_unit_sum, per_record_gradients
from site_agent.task_loss import TaskLoss
from site_agent.training_config import TrainingConfig
from site_agent.unit_clipping import UnitClipper, supports_unit_clipping

logger = logging.getLogger(__name__)


def unit_clipper_for(
    model: nn.Module, inputs: Callable[[torch.Tensor], torch.Tensor], config: TrainingConfig
) -> UnitClipper | None:
    """Unit-level ghost clipping when `model` suits it (checked on one forward pass of
    record 0; nothing is trained or released), else None: the per-record reference."""
    if not supports_unit_clipping(model):
        return None
    clipper = UnitClipper(
        model, max_grad_norm=config.max_grad_norm, loss_per_record=TaskLoss(config.task, "none")
    )
    device = next(model.parameters()).device
    try:
        clipper.check(inputs(torch.zeros(1, dtype=torch.int64, device=device)))
    except ConfigError as exc:
        logger.info("patient-level DP-SGD takes per-record gradients: %s", exc)
        clipper.remove()
        return None
    return clipper


def patient_groups(counts: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive patients [p0, p1) with at most `limit` records per group; a patient
    with more records than `limit` is a group of its own."""
    groups: list[tuple[int, int]] = []
    first, size = 0, 0
    for patient, count in enumerate(counts):
        if size and size + count > limit:
            groups.append((first, patient))
            first, size = patient, 0
        size += count
    groups.append((first, len(counts)))
    return groups


def clipped_patient_sum(
    model: nn.Module,
    records: torch.Tensor,
    patient_index: torch.Tensor,
    num_patients: int,
    *,
    inputs: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    record_loss: LossFn,
    config: TrainingConfig,
    device: torch.device,
    clipper: UnitClipper | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Sum of per-patient clipped gradients, memory-bounded by the physical batch.

    Patients are processed in groups of whole patients with at most
    `max_physical_batch_size` records; a larger patient is its own group, whose
    gradient is accumulated over physical chunks by plain backward passes and then
    clipped. So no step holds more than a physical batch's activations. Clipping is
    per patient and summing is linear, so the result equals one big batch.
    `inputs` gives the model inputs of record indices; `labels` holds every record's.
    With `clipper` the groups take the one-pass unit-level ghost clipping, else the
    per-record reference. Returns the clipped sums by parameter name and the summed loss.
    """
    limit = config.max_physical_batch_size
    if clipper is not None and num_patients > 0 and records.numel() <= limit:
        # One physical batch: the clipper's sums as they are (frozen parameters: zero).
        clipped, loss_sum = clipper.clipped_sum(
            inputs(records), labels[records], patient_index, num_patients
        )
        if len(clipped) < len(clipper.names):
            for name, p in model.named_parameters():
                if name not in clipped:
                    clipped[name] = torch.zeros_like(p)
        return clipped, loss_sum
    params = {name: p.detach() for name, p in model.named_parameters()}
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    loss_sum = torch.zeros((), device=device)
    if num_patients == 0:
        return total, loss_sum
    order = torch.argsort(patient_index, stable=True)
    records, patient_index = records[order], patient_index[order]
    counts = torch.bincount(patient_index, minlength=num_patients).tolist()
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    for p0, p1 in patient_groups(counts, limit):
        rows = slice(int(offsets[p0]), int(offsets[p1]))
        group_records, units = records[rows], patient_index[rows] - p0
        if clipper is not None and p1 - p0 == 1 and group_records.numel() > limit:
            clipped, group_loss = _one_large_patient(
                model, group_records, inputs=inputs, labels=labels, config=config
            )
        elif clipper is not None:
            x, y = inputs(group_records), labels[group_records]
            clipped, group_loss = clipper.clipped_sum(x, y, units, p1 - p0)
        else:
            clipped, group_loss = _reference_group(
                model, params, group_records, units, p1 - p0, inputs=inputs, labels=labels,
                record_loss=record_loss, config=config, device=device,
            )
        loss_sum += group_loss
        for name, value in clipped.items():
            total[name] += value
    return total, loss_sum


def _one_large_patient(
    model: nn.Module,
    group_records: torch.Tensor,
    *,
    inputs: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    config: TrainingConfig,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One patient with more records than a physical batch: their summed gradient over
    physical chunks (plain backward passes), clipped to `max_grad_norm` (zero when it is
    not finite)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    summed = [torch.zeros_like(p) for _, p in named]
    loss_sum = torch.zeros((), device=summed[0].device)
    criterion = TaskLoss(config.task, "sum")
    limit = config.max_physical_batch_size
    for start in range(0, int(group_records.numel()), limit):
        chunk = group_records[start : start + limit]
        loss = criterion(model(inputs(chunk)), labels[chunk])
        grads = torch.autograd.grad(loss, [p for _, p in named])
        for acc, g in zip(summed, grads):
            acc.add_(g)
        loss_sum += loss.detach()
    squared = sum((g.double().square().sum() for g in summed),
                  torch.zeros((), dtype=torch.float64, device=loss_sum.device))
    # Opacus' factor, or exactly zero for a gradient that is not finite
    # (site_agent.finite_clipping).
    factor = clip_factors(squared, max_grad_norm=config.max_grad_norm)
    if not bool(usable(squared)):
        return {name: torch.zeros_like(g) for (name, _), g in zip(named, summed)}, loss_sum
    return {name: g * factor.to(g.dtype) for (name, _), g in zip(named, summed)}, loss_sum


def _reference_group(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    group_records: torch.Tensor,
    units: torch.Tensor,
    num_units: int,
    *,
    inputs: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    record_loss: LossFn,
    config: TrainingConfig,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-record gradients (vmap over grad) summed per patient, then clipped."""
    limit = config.max_physical_batch_size
    per_unit = {
        name: torch.zeros((num_units, *p.shape), dtype=p.dtype, device=p.device)
        for name, p in params.items()
    }
    loss_sum = torch.zeros((), device=device)
    for start in range(0, int(group_records.numel()), limit):
        chunk = group_records[start : start + limit]
        x, y = inputs(chunk), labels[chunk]
        grads = per_record_gradients(model, params, x, y, record_loss)
        for name, g in grads.items():
            per_unit[name].index_add_(0, units[start : start + limit], g)
        with torch.no_grad():
            loss_sum += TaskLoss(config.task, "sum")(model(x), y)
    identity = torch.arange(num_units, device=device)
    clipped = clipped_unit_sum(per_unit, identity, num_units, max_grad_norm=config.max_grad_norm)
    return clipped, loss_sum
