"""The study's training loss: per batch (`TaskLoss`), per record (`record_loss_fn`), and
the labels as it needs them (`label_tensor`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from common.core.errors import DataError
from common.models import Task
from site_agent.patient_dp import LossFn
from site_agent.training_config import TrainingConfig


class TaskLoss(nn.Module):
    """The study's loss: BCE with logits (binary, one logit) or cross-entropy (K logits).

    `reduction` is an attribute because Opacus' ghost-clipping wrapper switches it to
    "none" to get per-sample losses. A binary model may output [B] or [B, 1].
    """

    def __init__(self, task: Task, reduction: str = "mean") -> None:
        super().__init__()
        self.task = task
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.task == "binary":
            return nn.functional.binary_cross_entropy_with_logits(
                logits.reshape(targets.shape), targets.to(logits.dtype), reduction=self.reduction
            )
        return nn.functional.cross_entropy(logits, targets.long(), reduction=self.reduction)


def record_loss_fn(task: Task) -> LossFn:
    """Summed loss of ONE record, as the per-record gradient code (vmap) calls it."""
    if task == "binary":

        def binary(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.binary_cross_entropy_with_logits(
                out.reshape(-1), target.reshape(-1).to(out.dtype), reduction="sum"
            )

        return binary

    def multiclass(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            out.reshape(1, -1), target.reshape(1).long(), reduction="sum"
        )

    return multiclass


def label_tensor(
    labels: np.ndarray, *, config: TrainingConfig, device: torch.device, source: str
) -> torch.Tensor:
    """Labels as the loss needs them: float 0/1 (binary) or class indices."""
    k = config.num_classes
    if labels.size and not (
        np.all(np.isfinite(labels)) and np.all(labels == np.round(labels))
        and labels.min() >= 0 and labels.max() < k
    ):
        raise DataError(f"labels must be class indices 0..{k - 1}", file=source or None)
    dtype = torch.float32 if config.task == "binary" else torch.int64
    return torch.as_tensor(labels, device=device).to(dtype)
