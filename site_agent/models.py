"""Models a site can train privately, and the flat-vector view the federation exchanges.

Every model here is Opacus-valid (no BatchNorm: its running statistics mix samples,
which breaks per-sample gradients and therefore DP-SGD). Image models use GroupNorm,
as recommended by Opacus and by Kolesnikov et al. 2020 ("Big Transfer").

The coordinator and SecAgg only ever see a model as one float32 vector; its layout is
``model.named_parameters()`` in order, each tensor flattened row-major.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import torch
from opacus.utils.module_utils import trainable_modules
from opacus.validators import ModuleValidator
from torch import nn

from common.errors import ConfigError, ValidationError

if TYPE_CHECKING:
    from common.bundle import Architecture
    from common.study import Study


class TabularMLP(nn.Module):
    """Feed-forward network for tabular EHR features: one binary logit, or K logits."""

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int] = (64, 32),
        dropout: float = 0.0,
        *,
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
        out: torch.Tensor = self.head(torch.flatten(self.features(x), 1))
        return out


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
        result: torch.Tensor = self.relu(out + self.shortcut(x))
        return result


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
        out: torch.Tensor = self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))
        return out


Task = Literal["binary", "multiclass"]

MODEL_NAMES = ("logistic", "mlp", "cnn", "resnet18-gn", "densenet121-gn", "custom")
"""Canonical model names a study may select."""

MODEL_ALIASES = {
    "small_cnn": "cnn",
    "resnet18_gn": "resnet18-gn",
    "densenet121_gn": "densenet121-gn",
    "densenet121": "densenet121-gn",
}
"""Earlier registry names, kept so existing configs still load."""

RECORD_FORMAT = 1
"""Version of `architecture_record`'s layout (bump when a field changes meaning)."""


@dataclass(frozen=True)
class ModelSpec:
    """What a study's ``[model]`` section says: a registry name and its parameters,
    or ``custom = "package.module:factory"`` for a hospital's own ``nn.Module``."""

    name: str = "mlp"
    params: Mapping[str, Any] = field(default_factory=dict)
    custom: str | None = None

    @classmethod
    def from_fields(
        cls,
        *,
        name: str | None,
        custom: str | None = None,
        hidden: Sequence[int] = (64, 32),
        dropout: float = 0.0,
        options: Mapping[str, Any] | None = None,
    ) -> ModelSpec:
        """From a study's ``[model]`` fields: mlp takes hidden/dropout, a custom factory
        its options; other built-ins take their options."""
        if custom is not None:
            return cls(name="custom", params=dict(options or {}), custom=custom)
        if (name or "mlp") == "mlp":
            return cls(name="mlp", params={"hidden": list(hidden), "dropout": dropout})
        if name == "logistic":
            return cls(name="logistic")
        return cls(name=str(name), params=dict(options or {}))

    @property
    def canonical_name(self) -> str:
        """The registry name with aliases resolved ("custom" when a factory is named)."""
        if self.custom is not None:
            return "custom"
        return MODEL_ALIASES.get(self.name, self.name)


def output_units(*, task: Task, num_classes: int) -> int:
    """Output width: one logit for a binary task (BCE), K logits for K classes (CE)."""
    if task == "binary":
        if num_classes != 2:
            raise ConfigError("num_classes", f"a binary task has 2 classes, not {num_classes}")
        return 1
    if task == "multiclass":
        if num_classes < 3:
            raise ConfigError(
                "num_classes", f"multiclass needs >= 3 classes (got {num_classes}); use binary"
            )
        return num_classes
    raise ConfigError("task", f"unknown task {task!r}; known: binary, multiclass")


def _need(value: int | None, name: str, model: str) -> int:
    if value is None or value < 1:
        raise ConfigError(name, f"model {model!r} needs a positive {name}")
    return int(value)


def _check_params(params: Mapping[str, Any], allowed: set[str], model: str) -> None:
    unknown = set(params) - allowed
    if unknown:
        raise ConfigError(
            "model.params",
            f"unknown parameter(s) {sorted(unknown)} for {model!r}; known: {sorted(allowed)}",
        )


def _densenet121_gn(
    *,
    in_channels: int,
    image_size: int | Sequence[int] | None,
    outputs: int,
    params: Mapping[str, Any],
) -> nn.Module:
    """MONAI's DenseNet-121 (Huang et al. 2017) with GroupNorm instead of BatchNorm.

    ``num_groups`` must divide every layer width; widths are multiples of the growth
    rate (32), so the default 8 always does. ReLU is not in place: Opacus' backward
    hooks cannot follow a view modified in place.
    """
    _check_params(params, {"num_groups", "dropout_prob"}, "densenet121-gn")
    try:
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


def _load_factory(reference: str, allowed: Sequence[str]) -> Callable[..., nn.Module]:
    """The function named ``package.module:factory``, if this site's policy allows it.

    The study comes from the coordinator; importing a module runs its code, so only
    factories the site (or coordinator) operator listed may be loaded.
    """
    if reference.count(":") != 1 or not all(reference.split(":")):
        raise ConfigError("model.custom", f"{reference!r} is not 'package.module:factory'")
    if reference not in allowed:
        raise ConfigError(
            "model.custom",
            f"factory {reference!r} is not in allowed_model_factories "
            f"({sorted(allowed) or 'empty'}); if you trust that installed package, add it "
            f"to the site policy (policy.allowed_model_factories) or pass "
            f"--allow-factory {reference}",
        )
    module_name, attribute = reference.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            "model.custom", f"cannot import {module_name!r} for factory {reference!r}: {exc}"
        ) from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(
            "model.custom", f"{reference!r}: {module_name} has no callable {attribute!r}"
        )
    return cast(Callable[..., nn.Module], factory)


def _accepted(factory: Callable[..., Any], dims: dict[str, Any]) -> dict[str, Any]:
    """The input/output sizes the factory declares (by name, or via ``**kwargs``).

    A factory that takes only its study ``options`` still works; one that declares
    ``num_outputs`` or ``in_channels`` gets them from the study."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dims
    names = {p.name for p in parameters}
    return {k: v for k, v in dims.items() if k in names}


def _fix_hint(layer: nn.Module) -> str:
    kind = type(layer).__name__
    if isinstance(layer, nn.modules.batchnorm._BatchNorm):
        return f"replace {kind} with GroupNorm (or apply opacus ModuleValidator.fix)"
    if isinstance(layer, (nn.LSTM, nn.GRU, nn.RNN)):
        return f"replace {kind} with Opacus' DP{kind} (opacus.layers)"
    if isinstance(layer, nn.MultiheadAttention):
        return "replace MultiheadAttention with opacus.layers.DPMultiheadAttention"
    if isinstance(layer, nn.modules.instancenorm._InstanceNorm):
        return f"construct {kind} with track_running_stats=False"
    return "replace it with an Opacus-supported layer (see opacus ModuleValidator.fix)"


def check_dp_compatible(model: nn.Module) -> None:
    """Opacus' ModuleValidator rules, reported with the layer's path and the fix.

    Opacus' own errors do not say which layer failed; a hospital's engineer needs that.
    """
    for path, layer in trainable_modules(model):
        validator = ModuleValidator.VALIDATORS.get(type(layer))
        if validator is None:
            continue
        errors = validator(layer)
        if errors:
            reason = str(errors[0]).split(". ")[0]
            raise ConfigError(
                "model",
                f"layer {path or '<root>'} ({type(layer).__name__}) is not usable with "
                f"DP-SGD: {reason}; fix: {_fix_hint(layer)}",
            )
    remaining = ModuleValidator.validate(model, strict=False)
    if remaining:
        raise ConfigError("model", f"not usable with DP-SGD: {remaining[0]}")


def build_model(
    spec: ModelSpec | str,
    *,
    num_classes: int = 2,
    task: Task | None = None,
    in_features: int | None = None,
    in_channels: int | None = None,
    image_size: int | Sequence[int] | None = None,
    allowed_model_factories: Sequence[str] = (),
    check_dp: bool = True,
) -> nn.Module:
    """Build the model a study selects, checked for DP-SGD (Opacus) at build time.

    `num_classes` counts label classes: 2 gives one binary logit (BCE), K >= 3 gives K
    logits (cross-entropy); `task` defaults accordingly. A custom factory is called
    with its study ``params`` plus whichever of ``in_features``, ``in_channels``,
    ``image_size`` and ``num_outputs`` it declares.
    """
    if isinstance(spec, str):
        spec = ModelSpec(name=spec)
    if task is None:
        task = "binary" if num_classes == 2 else "multiclass"
    outputs = output_units(task=task, num_classes=num_classes)
    name = spec.canonical_name
    params = dict(spec.params)
    model: nn.Module
    if name == "mlp":
        _check_params(params, {"hidden", "dropout"}, name)
        hidden = tuple(int(h) for h in params.get("hidden", (64, 32)))
        model = TabularMLP(
            _need(in_features, "in_features", name),
            hidden,
            float(params.get("dropout", 0.0)),
            outputs=outputs,
        )
    elif name == "logistic":
        # Logistic regression (softmax regression for K classes): one linear layer.
        # Under DP-SGD it has the fewest coordinates to noise and matches the
        # centralized baseline's model class.
        _check_params(params, set(), name)
        model = TabularMLP(_need(in_features, "in_features", name), (), outputs=outputs)
    elif name == "cnn":
        _check_params(params, set(), name)
        model = SmallCNN(_need(in_channels, "in_channels", name), outputs)
    elif name == "resnet18-gn":
        _check_params(params, set(), name)
        model = ResNet18GN(outputs, _need(in_channels, "in_channels", name))
    elif name == "densenet121-gn":
        model = _densenet121_gn(
            in_channels=_need(in_channels, "in_channels", name),
            image_size=image_size,
            outputs=outputs,
            params=params,
        )
    elif name == "custom":
        if spec.custom is None:
            raise ConfigError(
                "model.custom", "model 'custom' needs custom = 'package.module:factory'"
            )
        factory = _load_factory(spec.custom, allowed_model_factories)
        dims = {
            "in_features": in_features,
            "in_channels": in_channels,
            "image_size": image_size,
            "num_outputs": outputs,
        }
        built = factory(**_accepted(factory, dims), **params)
        if not isinstance(built, nn.Module):
            raise ConfigError(
                "model.custom", f"{spec.custom} returned {type(built).__name__}, not an nn.Module"
            )
        model = built
    else:
        raise ConfigError(
            "model",
            f"unknown model {spec.name!r}; known: {list(MODEL_NAMES)} "
            f"(aliases {sorted(MODEL_ALIASES)})",
        )
    if check_dp:
        check_dp_compatible(model)
    return model


def architecture_record(
    spec: ModelSpec | str,
    *,
    num_classes: int = 2,
    task: Task | None = None,
    in_features: int | None = None,
    in_channels: int | None = None,
    image_size: int | Sequence[int] | None = None,
) -> dict[str, Any]:
    """JSON-safe description from which `build_from_record` rebuilds the same model
    (for model bundles: no pickled code, a custom factory is recorded by name)."""
    if isinstance(spec, str):
        spec = ModelSpec(name=spec)
    if task is None:
        task = "binary" if num_classes == 2 else "multiclass"
    output_units(task=task, num_classes=num_classes)  # validate now, not at rebuild
    record: dict[str, Any] = {
        "format": RECORD_FORMAT,
        "name": spec.canonical_name,
        "params": json.loads(json.dumps(dict(spec.params))),
        "custom": spec.custom,
        "task": task,
        "num_classes": num_classes,
        "in_features": in_features,
        "in_channels": in_channels,
        "image_size": image_size if image_size is None or isinstance(image_size, int)
        else [int(d) for d in image_size],
    }
    return record


def build_from_record(
    record: Mapping[str, Any], *, allowed_model_factories: Sequence[str] = ()
) -> nn.Module:
    """Rebuild a recorded architecture; a custom factory must be installed and allowed."""
    if record.get("format") != RECORD_FORMAT:
        raise ConfigError(
            "model", f"unsupported architecture record format {record.get('format')!r}"
        )
    try:
        spec = ModelSpec(
            name=str(record["name"]), params=dict(record["params"]), custom=record["custom"]
        )
        return build_model(
            spec,
            num_classes=int(record["num_classes"]),
            task=record["task"],
            in_features=record["in_features"],
            in_channels=record["in_channels"],
            image_size=record["image_size"],
            allowed_model_factories=allowed_model_factories,
        )
    except (KeyError, TypeError) as exc:
        raise ConfigError("model", f"malformed architecture record: {exc!r}") from exc


def spec_from_study(study: Study) -> ModelSpec:
    """The `ModelSpec` of a study's ``[model]`` section."""
    model = study.model
    return ModelSpec.from_fields(
        name=model.name,
        custom=model.custom,
        hidden=model.hidden,
        dropout=model.dropout,
        options=model.options,
    )


def build_for_study(
    study: Study,
    *,
    in_features: int | None = None,
    allowed_model_factories: Sequence[str] = (),
    check_dp: bool = True,
) -> nn.Module:
    """The study's network, DP-checked: what a site trains and the coordinator starts from.

    Tables take their input width from the study's encoding unless `in_features` says
    otherwise (a site's own column list); images take channels and size from ``[data]``.
    """
    from common.study import encoded_feature_names

    images = study.data.kind == "images"
    if not images and in_features is None:
        in_features = len(encoded_feature_names(study))
    return build_model(
        spec_from_study(study),
        num_classes=len(study.study.classes),
        task=study.study.task,
        in_features=None if images else in_features,
        in_channels=study.data.channels if images else None,
        image_size=study.data.image_size if images else None,
        allowed_model_factories=allowed_model_factories,
        check_dp=check_dp,
    )


def build_from_architecture(
    arch: Architecture, *, allowed_model_factories: Sequence[str] = ()
) -> nn.Module:
    """Rebuild a model bundle's recorded architecture (common.bundle.Architecture)
    through the one registry; a custom factory must be installed and allowed."""
    if arch.num_outputs == 2:
        raise ConfigError(
            "model", "a recorded model has 1 output (binary) or K >= 3 (multi-class), not 2"
        )
    binary = arch.num_outputs == 1
    spec = ModelSpec.from_fields(
        name=arch.name,
        custom=arch.custom,
        hidden=arch.hidden,
        dropout=arch.dropout,
        options=arch.options,
    )
    return build_model(
        spec,
        num_classes=2 if binary else arch.num_outputs,
        task="binary" if binary else "multiclass",
        in_features=arch.in_features,
        in_channels=arch.in_channels,
        image_size=arch.image_size,
        allowed_model_factories=allowed_model_factories,
    )


def resnet18_gn(num_classes: int, in_channels: int = 3) -> ResNet18GN:
    """ResNet-18 with GroupNorm (torchvision is not a dependency, so it is written here)."""
    return ResNet18GN(num_classes, in_channels)


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
