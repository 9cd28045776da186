"""Apply a model bundle to a hospital's file: rebuild the network, preprocess, score.

The network is rebuilt from the bundle's architecture through `MODEL_REGISTRY` (the
imaging work of issue 12 adds its models there) or, for ``custom``, by importing the
named factory from the installed packages, and only when the caller allows that
factory by name: a bundle must not be able to make `predict` import arbitrary code.
Preprocessing is `site_agent.data.Preprocessor` with the bundle's global statistics,
the same code that encoded the training data.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from common.bundle import Architecture, ModelBundle, architecture_from_study
from common.errors import ConfigError, ValidationError
from common.evaluation import metrics_from_scores
from common.study import Study
from site_agent.data import Preprocessor, StudyTable
from site_agent.models import SmallCNN, TabularMLP, load_flat_parameters, resnet18_gn

PREDICT_BATCH = 4096


def _mlp(arch: Architecture) -> nn.Module:
    if arch.in_features is None:
        raise ConfigError("model", "mlp needs in_features (a table study)")
    if arch.num_outputs != 1:
        raise ConfigError(
            "model", "the mlp has one binary output; multi-class tables need issue 12's models"
        )
    return TabularMLP(arch.in_features, hidden=arch.hidden, dropout=arch.dropout)


def _image_inputs(arch: Architecture) -> int:
    if arch.in_channels is None:
        raise ConfigError("model", f"{arch.name} needs in_channels (an images study)")
    return arch.in_channels


MODEL_REGISTRY: dict[str, Callable[[Architecture], nn.Module]] = {
    "mlp": _mlp,
    "cnn": lambda a: SmallCNN(_image_inputs(a), a.num_outputs),
    "small_cnn": lambda a: SmallCNN(_image_inputs(a), a.num_outputs),
    "resnet18-gn": lambda a: resnet18_gn(a.num_outputs, _image_inputs(a)),
    "resnet18_gn": lambda a: resnet18_gn(a.num_outputs, _image_inputs(a)),
}


def build_model(arch: Architecture, *, allowed_factories: Sequence[str] = ()) -> nn.Module:
    """The untrained network an architecture describes; unknown or disallowed is a
    `ConfigError` saying what to do."""
    if arch.custom is not None:
        return _custom(arch, allowed_factories)
    name = arch.name or ""
    try:
        builder = MODEL_REGISTRY[name]
    except KeyError:
        raise ConfigError(
            "model", f"model {name!r} is not available here; known: {sorted(MODEL_REGISTRY)}"
        ) from None
    return builder(arch)


def _custom(arch: Architecture, allowed_factories: Sequence[str]) -> nn.Module:
    factory_name = arch.custom or ""
    if factory_name not in allowed_factories:
        raise ConfigError(
            "model.custom",
            f"the model is built by {factory_name!r}; allow it explicitly "
            f"(--allow-factory {factory_name}) if you trust that installed package",
        )
    module_name, _, attribute = factory_name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            "model.custom", f"cannot import {module_name!r} for {factory_name!r}: {exc}"
        ) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError("model.custom", f"{factory_name!r}: no such callable")
    model = factory(**arch.options)
    if not isinstance(model, nn.Module):
        raise ConfigError("model.custom", f"{factory_name!r} did not return a torch nn.Module")
    return model


def load_model(bundle: ModelBundle, *, allowed_factories: Sequence[str] = ()) -> nn.Module:
    """The bundle's network with its parameters, in eval mode."""
    model = build_model(bundle.architecture, allowed_factories=allowed_factories)
    expected = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    stored = [(n, tuple(np.shape(v))) for n, v in bundle.parameters.items()]
    if expected != stored:
        raise ValidationError(
            "the bundle's tensors do not fit the rebuilt network (names or shapes differ)"
        )
    load_flat_parameters(model, bundle.flat())
    model.eval()
    return model


def score_table(model: nn.Module, bundle: ModelBundle, table: StudyTable) -> np.ndarray:
    """Scores in [0, 1]: P(positive) [N] for binary, class probabilities [N, K] otherwise."""
    features = Preprocessor(bundle.study, bundle.statistics).transform(table)
    outputs = []
    with torch.no_grad():
        for start in range(0, features.shape[0], PREDICT_BATCH):
            batch = torch.from_numpy(features[start : start + PREDICT_BATCH])
            logits = model(batch)
            if bundle.study.study.task == "binary":
                outputs.append(torch.sigmoid(logits.reshape(-1)).numpy())
            else:
                outputs.append(torch.softmax(logits, dim=-1).numpy())
    return np.concatenate(outputs).astype(np.float64)


@dataclass(frozen=True)
class Prediction:
    scores: np.ndarray
    predicted: np.ndarray  # class indices
    metrics: dict[str, Any] | None  # present when the file has the label column


def predict_table(
    bundle: ModelBundle, table: StudyTable, *, allowed_factories: Sequence[str] = ()
) -> Prediction:
    """Score `table`; with labels, metrics at the bundle's threshold (AUC, sensitivity,
    specificity, PPV for binary; one-vs-rest AUC per class and accuracy otherwise)."""
    model = load_model(bundle, allowed_factories=allowed_factories)
    scores = score_table(model, bundle, table)
    classes = bundle.study.study.classes
    if bundle.study.study.task == "binary":
        threshold = bundle.threshold.value if bundle.threshold.value is not None else 0.5
        predicted = (scores >= threshold).astype(np.int64)
    else:
        predicted = np.argmax(scores, axis=1).astype(np.int64)
    metrics: dict[str, Any] | None = None
    if table.labels is not None:
        metrics = {"n": len(table)}
        if bundle.study.study.task == "binary":
            m = metrics_from_scores(scores, table.labels, threshold=threshold)
            metrics.update(
                auc=_num(m.auc),
                sensitivity=_num(m.sensitivity),
                specificity=_num(m.specificity),
                ppv=_num(m.ppv),
                threshold=threshold,
            )
        else:
            per_class = {
                str(c): _num(metrics_from_scores(scores[:, k], table.labels == k).auc)
                for k, c in enumerate(classes)
            }
            defined = [v for v in per_class.values() if v is not None]
            metrics.update(
                auc=float(np.mean(defined)) if defined else None,
                auc_per_class=per_class,
                accuracy=float(np.mean(predicted == table.labels)),
            )
    return Prediction(scores=scores, predicted=predicted, metrics=metrics)


def _num(value: float) -> float | None:
    """JSON has no NaN: an undefined metric (no positives, say) is null."""
    return None if math.isnan(value) else float(value)


def initial_model(study: Study, *, seed: int, allowed_factories: Sequence[str] = ()) -> nn.Module:
    """The study's untrained network, the same at every call for a seed: what
    `coordinator serve --study` starts round 1 from (its initial weights are public)."""
    torch.manual_seed(seed)
    return build_model(architecture_from_study(study), allowed_factories=allowed_factories)
