"""Models are Opacus-valid and round-trip through the flat vector the federation uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opacus.validators import ModuleValidator

from common.errors import ConfigError, ValidationError
from site_agent.models import (
    build_model,
    flatten_parameters,
    load_flat_parameters,
    parameter_layout,
    resnet18_gn,
)


@pytest.mark.parametrize(
    ("name", "kwargs", "input_shape", "output_shape"),
    [
        ("mlp", {"in_features": 9}, (4, 9), (4,)),
        ("small_cnn", {"in_channels": 1, "num_classes": 3}, (2, 1, 16, 16), (2, 3)),
        ("resnet18_gn", {"num_classes": 2}, (1, 3, 32, 32), (1, 2)),
    ],
)
def test_models_are_opacus_valid_and_run(name, kwargs, input_shape, output_shape) -> None:
    model = build_model(name, **kwargs)
    ModuleValidator.validate(model, strict=True)  # raises on BatchNorm and friends
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randn(*input_shape)).shape == output_shape


def test_resnet18_has_resnet18_depth() -> None:
    model = resnet18_gn(num_classes=10)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    # 1 stem conv + 8 blocks x 2 convs + 3 downsampling shortcuts = 20 convolutions.
    assert len(convs) == 20
    assert 11_000_000 < sum(p.numel() for p in model.parameters()) < 11_300_000


def test_flatten_and_load_round_trip_in_named_parameter_order() -> None:
    torch.manual_seed(0)
    source = build_model("mlp", in_features=5, hidden=(7,))
    target = build_model("mlp", in_features=5, hidden=(7,))
    vec = flatten_parameters(source)
    layout = parameter_layout(source)
    assert vec.dtype == np.float32
    assert vec.shape == (sum(int(np.prod(shape)) for _, _, shape in layout),)
    assert [name for name, _, _ in layout] == [n for n, _ in source.named_parameters()]
    first_name, first_dtype, first_shape = layout[0]
    assert (first_name, first_dtype, first_shape) == ("net.0.weight", "float32", (7, 5))
    np.testing.assert_array_equal(vec[:35], source.net[0].weight.detach().numpy().reshape(-1))
    load_flat_parameters(target, vec)
    np.testing.assert_array_equal(flatten_parameters(target), vec)
    x = torch.randn(3, 5)
    torch.testing.assert_close(target(x), source(x))


def test_load_rejects_wrong_size_and_non_finite() -> None:
    model = build_model("mlp", in_features=3)
    vec = flatten_parameters(model)
    with pytest.raises(ValidationError):
        load_flat_parameters(model, vec[:-1])
    bad = vec.copy()
    bad[0] = np.nan
    with pytest.raises(ValidationError):
        load_flat_parameters(model, bad)


def test_unknown_model_is_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        build_model("transformer")
    assert info.value.field == "model"
