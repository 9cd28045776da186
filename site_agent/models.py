"""Models a site can train privately, and the flat-vector view the federation exchanges.

Every model here is Opacus-valid (no BatchNorm: its running statistics mix samples,
which breaks per-sample gradients and therefore DP-SGD). Image models use GroupNorm,
as recommended by Opacus and by Kolesnikov et al. 2020 ("Big Transfer").

The coordinator and SecAgg only ever see a model as one float32 vector; its layout is
``model.named_parameters()`` in order, each tensor flattened row-major.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from common.errors import ConfigError, ValidationError


class TabularMLP(nn.Module):
    """Feed-forward network for tabular EHR features with one binary logit output."""

    def __init__(
        self, in_features: int, hidden: Sequence[int] = (64, 32), dropout: float = 0.0
    ) -> None:
        super().__init__()
        if in_features < 1:
            raise ConfigError("in_features", "must be >= 1")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError("dropout", "must be in [0, 1)")
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers.append(nn.Linear(width, size))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shape [batch]: per-sample losses then have shape [batch], which is what
        # Opacus' ghost-clipping loss wrapper expects.
        return self.net(x).squeeze(-1)


def _group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with up to 32 groups that divide `channels` (Wu & He 2018)."""
    groups = min(32, channels)
    while channels % groups:
        groups -= 1
    return nn.GroupNorm(groups, channels)


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head: a cheap image baseline for DP training."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=3, padding=1),
            _group_norm(16),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            _group_norm(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class _BasicBlock(nn.Module):
    """ResNet basic block (He et al. 2016, Fig. 2) with GroupNorm instead of BatchNorm."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _group_norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.norm2 = _group_norm(planes)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), _group_norm(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18 (He et al. 2016, Table 1: [2, 2, 2, 2] basic blocks) with GroupNorm."""

    def __init__(self, num_classes: int, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False),
            _group_norm(64),
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
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def resnet18_gn(num_classes: int, in_channels: int = 3) -> ResNet18GN:
    """ResNet-18 with GroupNorm (torchvision is not a dependency, so it is written here)."""
    return ResNet18GN(num_classes, in_channels)


MODEL_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "mlp": TabularMLP,
    "small_cnn": SmallCNN,
    "resnet18_gn": resnet18_gn,
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a model by its configured name (``mlp``, ``small_cnn``, ``resnet18_gn``)."""
    try:
        builder = MODEL_BUILDERS[name]
    except KeyError:
        raise ConfigError(
            "model", f"unknown model {name!r}; known: {sorted(MODEL_BUILDERS)}"
        ) from None
    return builder(**kwargs)


def parameter_layout(model: nn.Module) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every parameter, in the order of the flat vector."""
    return [
        (name, str(p.dtype).removeprefix("torch."), tuple(p.shape))
        for name, p in model.named_parameters()
    ]


def flatten_parameters(model: nn.Module) -> np.ndarray:
    """All parameters as one float32 vector (order = ``model.named_parameters()``)."""
    with torch.no_grad():
        parts = [p.detach().reshape(-1).to("cpu", torch.float32) for p in model.parameters()]
        if not parts:
            return np.zeros(0, dtype=np.float32)
        return torch.cat(parts).numpy().copy()


def load_flat_parameters(model: nn.Module, vec: np.ndarray) -> None:
    """Copy a flat vector (as made by `flatten_parameters`) into the model in place."""
    flat = np.asarray(vec)
    total = sum(p.numel() for p in model.parameters())
    if flat.ndim != 1 or flat.shape[0] != total:
        raise ValidationError(f"parameter vector has shape {flat.shape}, model needs ({total},)")
    if not np.all(np.isfinite(flat)):
        raise ValidationError("parameter vector contains NaN or infinity")
    source = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(source[offset : offset + n].view_as(p).to(p.device, p.dtype))
            offset += n
