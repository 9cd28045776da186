"""``cnn``: two conv blocks and a linear head, a cheap image baseline for DP training."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from common.models.images._norm import group_norm
from common.models.registry import check_params


class SmallCNN(nn.Module):
    """Two conv blocks (GroupNorm) and a linear head."""

    def __init__(self, *, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=3, padding=1),
            group_norm(16),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            group_norm(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.flatten(self.features(x), 1))
        return out


def build(
    *,
    in_channels: int,
    image_size: int | Sequence[int] | None,
    outputs: int,
    params: Mapping[str, Any],
) -> nn.Module:
    check_params(params, set(), "cnn")
    return SmallCNN(in_channels=in_channels, num_classes=outputs)
