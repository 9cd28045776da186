"""``resnet18-gn``: ResNet-18 with GroupNorm (torchvision is not a dependency, so it is
written here)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from common.models.images._norm import group_norm
from common.models.registry import check_params


class _BasicBlock(nn.Module):
    """ResNet basic block (He et al. 2016, Fig. 2) with GroupNorm instead of BatchNorm."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm1 = group_norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.norm2 = group_norm(planes)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), group_norm(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        result: torch.Tensor = self.relu(out + self.shortcut(x))
        return result


class ResNet18GN(nn.Module):
    """ResNet-18 (He et al. 2016, Table 1: [2, 2, 2, 2] basic blocks) with GroupNorm."""

    def __init__(self, *, in_channels: int = 3, num_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
            group_norm(64),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        blocks: list[nn.Module] = []
        in_planes = 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks.append(_BasicBlock(in_planes, planes, stride))
            blocks.append(_BasicBlock(planes, planes, 1))
            in_planes = planes
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))
        return out


def build(
    *,
    in_channels: int,
    image_size: int | Sequence[int] | None,
    outputs: int,
    params: Mapping[str, Any],
) -> nn.Module:
    check_params(params, set(), "resnet18-gn")
    return ResNet18GN(in_channels=in_channels, num_classes=outputs)
