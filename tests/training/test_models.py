"""Models are Opacus-valid and round-trip through the flat vector the federation uses."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from opacus.validators import ModuleValidator

from common.core.errors import ConfigError, ValidationError
from common.models import ModelSpec, kind_of
from common.models.architecture import Architecture
from common.models.build import build_from_architecture, build_model
from common.models.images.resnet18_gn import ResNet18GN
from common.models.layout import flatten_parameters, load_flat_parameters, model_layout


@pytest.mark.parametrize(
    ("name", "kwargs", "input_shape", "output_shape"),
    [
        ("mlp", {"in_features": 9}, (4, 9), (4,)),
        ("logistic", {"in_features": 9}, (4, 9), (4,)),
        ("logistic", {"in_features": 9, "num_classes": 4}, (4, 9), (4, 4)),
        ("mlp", {"in_features": 9, "num_classes": 4}, (4, 9), (4, 4)),
        ("cnn", {"in_channels": 1, "num_classes": 3}, (2, 1, 16, 16), (2, 3)),
        ("cnn", {"in_channels": 1}, (2, 1, 16, 16), (2, 1)),
        ("resnet18-gn", {"in_channels": 3, "num_classes": 3}, (1, 3, 32, 32), (1, 3)),
        ("resnet18-gn", {"in_channels": 1}, (1, 1, 32, 32), (1, 1)),
        ("densenet121-gn", {"in_channels": 1, "num_classes": 3}, (2, 1, 32, 32), (2, 3)),
    ],
)
def test_models_are_opacus_valid_and_run(name, kwargs, input_shape, output_shape) -> None:
    model = build_model(name, **kwargs)
    ModuleValidator.validate(model, strict=True)  # raises on BatchNorm and friends
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert model(torch.randn(*input_shape)).shape == output_shape


def test_resnet18_has_resnet18_depth() -> None:
    model = ResNet18GN(num_classes=10)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    # 1 stem conv + 8 blocks x 2 convs + 3 downsampling shortcuts = 20 convolutions.
    assert len(convs) == 20
    assert 11_000_000 < sum(p.numel() for p in model.parameters()) < 11_300_000


def test_flatten_and_load_round_trip_in_named_parameter_order() -> None:
    torch.manual_seed(0)
    source = build_model(ModelSpec("mlp", {"hidden": [7]}), in_features=5)
    target = build_model(ModelSpec("mlp", {"hidden": [7]}), in_features=5)
    vec = flatten_parameters(source)
    layout = model_layout(source)
    assert vec.dtype == np.float32
    assert vec.shape == (sum(int(np.prod(spec.shape)) for spec in layout),)
    assert [spec.name for spec in layout] == [n for n, _ in source.named_parameters()]
    first = layout[0]
    assert (first.name, first.dtype, first.shape) == ("net.0.weight", "<f4", (7, 5))
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


def test_mlp_hidden_sizes_from_params() -> None:
    model = build_model(ModelSpec("mlp", {"hidden": [5, 3]}), in_features=4)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(5, 4), (5,), (3, 5), (3,), (1, 3), (1,)]
    with pytest.raises(ConfigError, match="unknown parameter"):
        build_model(ModelSpec("mlp", {"layers": [5]}), in_features=4)
    with pytest.raises(ConfigError) as info:
        build_model("cnn")  # no in_channels
    assert info.value.field == "in_channels"


def test_task_and_class_count_must_agree() -> None:
    with pytest.raises(ConfigError, match="multiclass needs >= 3"):
        build_model("mlp", in_features=3, num_classes=2, task="multiclass")
    with pytest.raises(ConfigError, match="binary task has 2 classes"):
        build_model("mlp", in_features=3, num_classes=3, task="binary")


class _WithBatchNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x).mean(dim=(2, 3)))


def batchnorm_factory(**kwargs: object) -> torch.nn.Module:
    return _WithBatchNorm()


def lstm_factory(**kwargs: object) -> torch.nn.Module:
    return torch.nn.LSTM(4, 4)


def good_factory(
    *, in_channels: int, num_outputs: int, width: int = 8, **_: object
) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(in_channels, width, 3, padding=1),
        torch.nn.GroupNorm(2, width),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(width, num_outputs),
    )


def not_a_module_factory(**kwargs: object) -> object:
    return "model"


HERE = "tests.training.test_models"


def test_incompatible_layers_are_named_with_the_fix() -> None:
    ref = f"{HERE}:batchnorm_factory"
    with pytest.raises(ConfigError) as info:
        build_model(ModelSpec(custom=ref), in_channels=1, allowed_model_factories=[ref])
    message = str(info.value)
    assert "stem.1" in message and "BatchNorm2d" in message and "GroupNorm" in message
    ref = f"{HERE}:lstm_factory"
    with pytest.raises(ConfigError, match="DPLSTM"):
        build_model(ModelSpec(custom=ref), allowed_model_factories=[ref])


def test_custom_factory_needs_the_allow_list_and_round_trips_by_name() -> None:
    ref = f"{HERE}:good_factory"
    spec = ModelSpec(name="custom", params={"width": 6}, custom=ref)
    with pytest.raises(ConfigError, match="allowed_model_factories") as info:
        build_model(spec, in_channels=1)
    assert info.value.field == "model.custom"
    torch.manual_seed(0)
    model = build_model(spec, in_channels=1, num_classes=3, allowed_model_factories=[ref])
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 3)
    # What a model bundle records: JSON-safe (no pickle in bundles), the factory by name.
    recorded = _json_round_trip(
        Architecture(custom=ref, in_channels=1, num_outputs=3, options={"width": 6}))
    assert recorded.custom == ref and recorded.num_outputs == 3
    rebuilt = build_from_architecture(recorded, allowed_model_factories=[ref])
    assert model_layout(rebuilt) == model_layout(model)
    with pytest.raises(ConfigError, match="allowed_model_factories"):
        build_from_architecture(recorded)
    missing = recorded.model_copy(update={"custom": "no_such_package.models:net"})
    with pytest.raises(ConfigError, match="cannot import"):
        build_from_architecture(missing, allowed_model_factories=["no_such_package.models:net"])
    bad = f"{HERE}:not_a_module_factory"
    with pytest.raises(ConfigError, match=r"not an nn\.Module"):
        build_model(ModelSpec(custom=bad), allowed_model_factories=[bad])
    with pytest.raises(ConfigError, match=r"package\.module:factory"):
        build_model(ModelSpec(custom="nocolon"), allowed_model_factories=["nocolon"])


def _json_round_trip(architecture: Architecture) -> Architecture:
    """The architecture as a model bundle's metadata writes and reads it (JSON)."""
    written = json.dumps(architecture.model_dump(mode="json"))
    return Architecture.model_validate(json.loads(written))


@pytest.mark.parametrize("name", ["logistic", "mlp", "cnn", "resnet18-gn", "densenet121-gn"])
def test_a_recorded_architecture_rebuilds_registry_models(name: str) -> None:
    tables = ("mlp", "logistic")
    dims: dict[str, Any] = ({"in_features": 6} if name in tables
                            else {"in_channels": 1, "image_size": (32, 32)})
    hidden = (64, 32) if name == "mlp" else ()
    recorded = _json_round_trip(Architecture(name=name, num_outputs=3, hidden=hidden, **dims))
    assert recorded.name == name
    torch.manual_seed(1)
    a = build_from_architecture(recorded)
    b = build_model(ModelSpec.from_fields(name=name, hidden=hidden), num_classes=3, **dims)
    assert model_layout(a) == model_layout(b)


def test_logistic_is_one_linear_layer() -> None:
    """Logistic regression: weights and bias only, whatever hidden the study carries."""
    model = build_model(ModelSpec.from_fields(name="logistic", hidden=(64, 32)), in_features=7)
    assert [tuple(p.shape) for p in model.parameters()] == [(1, 7), (1,)]
    with pytest.raises(ConfigError, match="logistic"):
        build_model(ModelSpec("logistic", {"hidden": [4]}), in_features=7)


def test_spec_from_study_fields() -> None:
    mlp = ModelSpec.from_fields(name=None, hidden=(8,), dropout=0.1)
    assert mlp == ModelSpec("mlp", {"hidden": [8], "dropout": 0.1})
    assert ModelSpec.from_fields(name="densenet121-gn").canonical_name == "densenet121-gn"
    custom = ModelSpec.from_fields(name=None, custom="pkg.mod:make", options={"width": 4})
    assert (custom.canonical_name, custom.params) == ("custom", {"width": 4})


def options_only_factory(width: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, width))


def test_custom_factory_gets_only_the_sizes_it_declares() -> None:
    ref = f"{HERE}:options_only_factory"
    model = build_model(
        ModelSpec(custom=ref, params={"width": 3}),
        in_channels=1,
        num_classes=3,
        allowed_model_factories=[ref],
    )
    assert model(torch.randn(2, 1, 4, 4)).shape == (2, 3)


@pytest.mark.parametrize("name", ["small_cnn", "densenet121", "resnet18_gn"])
def test_only_registry_names_are_models(name: str) -> None:
    """One name per network, its module's (``_`` read as ``-``): no alias resolves."""
    with pytest.raises(ConfigError, match="unknown model"):
        kind_of(name)
