"""The physical batch a site's memory budget allows for its model and DP-SGD path.

A training step holds the model's fixed state (weights, gradient, clipped sum, noise,
optimizer moments) plus, per record in a physical batch, the activations autograd keeps
and their gradients, plus what the DP path builds per record: unfolded conv inputs and
per-record (or per-unit) layer gradients for unit-level ghost clipping
(`site_agent.unit_clipping`), a whole per-record gradient for Opacus' hooks or the
per-record reference. `physical_batch_for_budget` sizes the batch so that estimate fits
the budget; the trainer then splits every larger step into physical batches (whole
patients per batch for patient-level DP), so no step beyond the budget is attempted.
The estimate comes from one forward pass of a single synthetic record (no gradients),
with a safety factor for allocator slack and temporaries.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Literal

import torch
from opacus.utils.module_utils import trainable_modules
from torch import nn

from common.core.errors import ConfigError
from site_agent.training_config import TrainingConfig

logger = logging.getLogger(__name__)

DpPath = Literal["nonprivate", "unit-ghost", "per-sample", "reference"]
SAFETY = 1.5
"""Estimated bytes are multiplied by this (allocator rounding, temporaries)."""
FIXED_COPIES = 6
"""Model-sized tensors a step holds: weights, gradient, clipped sum, noise, two moments."""
DEFAULT_CPU_FRACTION = 0.25
DEFAULT_GPU_FRACTION = 0.5


def default_memory_budget(device: torch.device) -> int:
    """The safe default: half a GPU's memory, or a quarter of the machine's RAM."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * DEFAULT_GPU_FRACTION)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 4 * 2**30
    return int(ram * DEFAULT_CPU_FRACTION)


@dataclass(frozen=True)
class StepMemory:
    """Estimated bytes of one step: `fixed` plus `per_record` times the physical batch."""

    fixed: int
    per_record: int

    def records_within(self, budget: int) -> int:
        return max(0, (budget - self.fixed) // max(1, self.per_record))


def estimate_step_memory(
    model: nn.Module, record_shape: tuple[int, ...], *, path: DpPath, device: torch.device
) -> StepMemory:
    """`StepMemory` of `model` on records of `record_shape` under the DP `path`."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    itemsize = next(model.parameters()).element_size()
    outputs = 0
    extra = 0
    trainable = {id(m) for _, m in trainable_modules(model)}

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: object) -> None:
        nonlocal outputs, extra
        if isinstance(output, torch.Tensor):
            outputs += output.numel()
        if path != "unit-ghost" or id(module) not in trainable:
            return
        out = output if isinstance(output, torch.Tensor) else None
        if isinstance(module, nn.Conv2d) and out is not None:
            t = out[0, 0].numel()
            d = module.in_channels * int(torch.tensor(module.kernel_size).prod())
            o = module.out_channels
            # unfolded input and output gradient, plus the norm rule `_conv_squared`
            # takes (records ~ pairs): T x T Gram matrices of A and G for the record and
            # its pairs, or the per-record and per-unit explicit O x D gradients.
            rule = 4 * t * t if 2 * t * (d + o) < d * o else 2 * o * d
            extra += d * t + o * t + rule
        elif isinstance(module, nn.Linear):
            d_in, d_out = module.in_features, module.out_features
            rule = 4 * (d_in + d_out) if 2 * (d_in + d_out) <= d_in * d_out else 2 * d_in * d_out
            extra += d_out + rule
        else:
            extra += sum(p.numel() for p in module.parameters(recurse=False))

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros((1, *record_shape), device=device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    if path == "per-sample":
        extra += params
    elif path == "reference":
        extra += 2 * params
    inputs = int(torch.tensor(record_shape).prod()) if record_shape else 1
    per_record = (2 * outputs + extra + inputs) * itemsize
    return StepMemory(
        fixed=int(FIXED_COPIES * params * itemsize * SAFETY),
        per_record=int(per_record * SAFETY),
    )


def physical_batch_for_budget(
    model: nn.Module,
    record_shape: tuple[int, ...],
    *,
    budget: int,
    path: DpPath,
    device: torch.device,
    cap: int,
) -> int:
    """The largest physical batch (at most `cap`) whose estimated step fits `budget`."""
    estimate = estimate_step_memory(model, record_shape, path=path, device=device)
    fits = estimate.records_within(budget)
    if fits < 1:
        raise ConfigError(
            "training.memory_budget",
            f"{budget / 2**20:.1f} MiB cannot hold one training step of this model: "
            f"~{estimate.fixed / 2**20:.1f} MiB for the model's state plus "
            f"~{estimate.per_record / 2**20:.1f} MiB per record",
        )
    return min(cap, fits)


def fit_physical_batch(
    config: TrainingConfig,
    model: nn.Module,
    record_shape: tuple[int, ...],
    *,
    path: DpPath,
    device: torch.device,
) -> TrainingConfig:
    """`config` with the physical batch its memory budget allows for `model` and the DP
    `path` ("default": the device's safe default); unchanged without a budget."""
    if config.memory_budget is None:
        return config
    budget = (
        default_memory_budget(device) if config.memory_budget == "default"
        else config.memory_budget
    )
    physical = physical_batch_for_budget(
        model, record_shape, budget=budget, path=path, device=device,
        cap=config.max_physical_batch_size,
    )
    logger.info("physical batch %d records (memory budget %.0f MiB, %s)",
                physical, budget / 2**20, path)
    return dataclasses.replace(config, max_physical_batch_size=physical)
