"""``mlp``: a feed-forward network for tabular EHR features (``hidden``, ``dropout``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from common.core.errors import ConfigError
from common.models.registry import check_params


class TabularMLP(nn.Module):
    """Feed-forward network for tabular EHR features: one binary logit, or K logits."""

    def __init__(
        self,
        in_features: int,
        *,
        hidden: Sequence[int] = (64, 32),
        dropout: float = 0.0,
        outputs: int = 1,
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
        layers.append(nn.Linear(width, outputs))
        self.net = nn.Sequential(*layers)
        self.outputs = outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Binary: shape [batch], so per-sample losses have shape [batch], which is
        # what Opacus' ghost-clipping loss wrapper expects. Multi-class: [batch, K].
        out: torch.Tensor = self.net(x)
        return out.squeeze(-1) if self.outputs == 1 else out


def build(*, in_features: int, outputs: int, params: Mapping[str, Any]) -> nn.Module:
    check_params(params, {"hidden", "dropout"}, "mlp")
    hidden = tuple(int(h) for h in params.get("hidden", (64, 32)))
    return TabularMLP(
        in_features, hidden=hidden, dropout=float(params.get("dropout", 0.0)), outputs=outputs
    )
