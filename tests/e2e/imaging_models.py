"""A hospital's own network for the imaging study tests: what `[model] custom =
"tests.e2e.imaging_models:lesion_net"` names. GroupNorm, not BatchNorm, so Opacus'
ModuleValidator accepts it."""

from __future__ import annotations

from torch import nn


def lesion_net(in_channels: int, num_outputs: int, width: int = 8) -> nn.Module:
    """Two convolutions, global max pooling: a small bright lesion anywhere in the image
    lights up one position, which max pooling keeps."""
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.GroupNorm(2, width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(2, width), nn.ReLU(),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(width, num_outputs),
    )
