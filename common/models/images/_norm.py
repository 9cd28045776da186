"""GroupNorm for the image networks: Opacus-valid, unlike BatchNorm (Opacus' advice,
and Kolesnikov et al. 2020, "Big Transfer")."""

from __future__ import annotations

from torch import nn


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with up to 32 groups that divide `channels` (Wu & He 2018)."""
    groups = min(32, channels)
    while channels % groups:
        groups -= 1
    return nn.GroupNorm(groups, channels)
