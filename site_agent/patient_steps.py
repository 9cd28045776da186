"""The clipped gradient sum of one patient-level DP-SGD step (site_agent.patient_dp has
the mechanism and its paper), memory-bounded by the physical batch."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from site_agent.patient_dp import LossFn, clipped_unit_sum, per_record_gradients
from site_agent.task_loss import TaskLoss
from site_agent.training_config import TrainingConfig


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
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Sum of per-patient clipped gradients, memory-bounded by the physical batch.

    Patients are processed in groups of whole patients with at most
    `max_physical_batch_size` records (a larger patient is its own group, its
    records in physical chunks), so per-record and per-patient gradients never
    exceed a physical batch's worth (ResNet-18: 11M parameters each). Clipping is
    per patient and summing is linear, so the result equals one big batch.
    `inputs` gives the model inputs of record indices; `labels` holds every record's.
    Returns the clipped sums by parameter name and the batch's summed loss.
    """
    limit = config.max_physical_batch_size
    params = {name: p.detach() for name, p in model.named_parameters()}
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    loss_sum = torch.zeros((), device=device)
    if num_patients == 0:
        return total, loss_sum
    order = torch.argsort(patient_index, stable=True)
    records, patient_index = records[order], patient_index[order]
    counts = torch.bincount(patient_index, minlength=num_patients).tolist()
    groups: list[tuple[int, int]] = []
    first, size = 0, 0
    for patient, count in enumerate(counts):
        if size and size + count > limit:
            groups.append((first, patient))
            first, size = patient, 0
        size += count
    groups.append((first, num_patients))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    for p0, p1 in groups:
        rows = slice(int(offsets[p0]), int(offsets[p1]))
        group_records, units = records[rows], patient_index[rows] - p0
        per_unit = {
            name: torch.zeros((p1 - p0, *p.shape), dtype=p.dtype, device=p.device)
            for name, p in params.items()
        }
        for start in range(0, int(group_records.numel()), limit):
            chunk = group_records[start : start + limit]
            x, y = inputs(chunk), labels[chunk]
            grads = per_record_gradients(model, params, x, y, record_loss)
            for name, g in grads.items():
                per_unit[name].index_add_(0, units[start : start + limit], g)
            with torch.no_grad():
                loss_sum += TaskLoss(config.task, "sum")(model(x), y)
        identity = torch.arange(p1 - p0, device=device)
        clipped = clipped_unit_sum(
            per_unit, identity, p1 - p0, max_grad_norm=config.max_grad_norm
        )
        for name in total:
            total[name] += clipped[name]
    return total, loss_sum
