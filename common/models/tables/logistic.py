"""``logistic``: logistic regression (softmax regression for K classes), one linear
layer. Under DP-SGD it has the fewest coordinates to noise and matches the centralized
baseline's model class."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from common.models.registry import check_params
from common.models.tables.mlp import TabularMLP


def build(*, in_features: int, outputs: int, params: Mapping[str, Any]) -> nn.Module:
    check_params(params, set(), "logistic")
    return TabularMLP(in_features, hidden=(), outputs=outputs)
