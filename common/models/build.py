"""Build the network a study selects, checked for DP-SGD (Opacus) at build time.

The built-in networks come from their modules (`common.models.registry`); a hospital's
own is a ``package.module:factory`` that the site's (or coordinator's) operator allowed
by name. Imports torch: only what builds a network imports this module. Opacus is
imported by the DP check alone (seconds of start-up that `predict`, which rebuilds a
trained network to score with it, does not pay).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from common.core.errors import ConfigError
from common.models.architecture import Architecture
from common.models.registry import (
    CUSTOM,
    ModelSpec,
    Task,
    kind_of,
    module_of,
    output_units,
)
from common.study import Study, encoded_feature_names


def _need(value: int | None, name: str, model: str) -> int:
    if value is None or value < 1:
        raise ConfigError(name, f"model {model!r} needs a positive {name}")
    return int(value)


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
    # opacus: loaded by the DP check alone; `predict`, rebuilding a network, skips its seconds
    from opacus.utils.module_utils import trainable_modules
    from opacus.validators import ModuleValidator

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


def _build_custom(
    spec: ModelSpec, *, dims: dict[str, Any], allowed_model_factories: Sequence[str]
) -> nn.Module:
    if spec.custom is None:
        raise ConfigError("model.custom", "model 'custom' needs custom = 'package.module:factory'")
    factory = _load_factory(spec.custom, allowed_model_factories)
    built = factory(**_accepted(factory, dims), **dict(spec.params))
    if not isinstance(built, nn.Module):
        raise ConfigError(
            "model.custom", f"{spec.custom} returned {type(built).__name__}, not an nn.Module"
        )
    return built


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
    model: nn.Module
    if name == CUSTOM:
        dims = {"in_features": in_features, "in_channels": in_channels,
                "image_size": image_size, "num_outputs": outputs}
        model = _build_custom(spec, dims=dims, allowed_model_factories=allowed_model_factories)
    else:
        network = importlib.import_module(module_of(name))
        if kind_of(name) == "table":
            model = network.build(in_features=_need(in_features, "in_features", name),
                                  outputs=outputs, params=dict(spec.params))
        else:
            model = network.build(in_channels=_need(in_channels, "in_channels", name),
                                  image_size=image_size, outputs=outputs,
                                  params=dict(spec.params))
    if check_dp:
        check_dp_compatible(model)
    return model


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


def initial_model(
    study: Study, *, seed: int, allowed_factories: Sequence[str] | None = None
) -> nn.Module:
    """The study's untrained network, the same at every call for a seed: what
    `coordinator serve --study` starts round 1 from (its initial weights are public).

    A hospital's own factory is checked with Opacus' ModuleValidator (a `ConfigError`
    naming the layer and the fix) before any round starts. A built-in network is not:
    each is Opacus-valid by construction (tests/training/test_models.py), and every site
    checks the network it trains, so a coordinator serving one never loads Opacus
    (seconds of CPU at every start). `allowed_factories` defaults to the study's own
    custom factory: the coordinator's operator wrote the study it serves.
    """
    if allowed_factories is None:
        allowed_factories = (study.model.custom,) if study.model.custom else ()
    torch.manual_seed(seed)
    return build_for_study(study, allowed_model_factories=allowed_factories,
                           check_dp=study.model.custom is not None)


def build_from_architecture(
    arch: Architecture, *, allowed_model_factories: Sequence[str] = (), check_dp: bool = True
) -> nn.Module:
    """Rebuild a model bundle's recorded architecture (common.models.architecture.Architecture)
    through the one registry; a custom factory must be installed and allowed.
    `check_dp=False` for a network that only scores (no DP-SGD step will run on it)."""
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
        check_dp=check_dp,
    )
