"""``densenet121-gn``: MONAI's DenseNet-121 (Huang et al. 2017) with GroupNorm."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from common.core.errors import ConfigError
from common.models.registry import check_params


def build(
    *,
    in_channels: int,
    image_size: int | Sequence[int] | None,
    outputs: int,
    params: Mapping[str, Any],
) -> nn.Module:
    """``num_groups`` must divide every layer width; widths are multiples of the growth
    rate (32), so the default 8 always does. ReLU is not in place: Opacus' backward
    hooks cannot follow a view modified in place."""
    check_params(params, {"num_groups", "dropout_prob"}, "densenet121-gn")
    try:
        # monai: loaded only when this network is built (MONAI is slow to import)
        from monai.networks.nets.densenet import DenseNet121
    except ImportError as exc:  # pragma: no cover - monai is a declared dependency
        raise ConfigError("model", f"densenet121-gn needs MONAI ({exc})") from exc
    num_groups = int(params.get("num_groups", 8))
    if num_groups < 1 or 32 % num_groups:
        raise ConfigError("model.params.num_groups", "must divide 32 (1, 2, 4, 8, 16 or 32)")
    model: nn.Module = DenseNet121(
        spatial_dims=2,
        in_channels=in_channels,
        out_channels=outputs,
        norm=("group", {"num_groups": num_groups}),
        act=("relu", {"inplace": False}),
        dropout_prob=float(params.get("dropout_prob", 0.0)),
    )
    return model
