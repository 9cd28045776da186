"""Apply a model bundle to a hospital's file: rebuild the network, preprocess, score.

The network is rebuilt from the bundle's architecture through the model registry of
`common.models` (the same code that built it for training) or, for ``custom``, by
importing the named factory from the installed packages, and only when the caller
allows that factory by name: a bundle must not be able to make `predict` import
arbitrary code.
Preprocessing is `site_agent.data.Preprocessor` with the bundle's global statistics,
the same code that encoded the training data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from common.core.errors import ValidationError
from common.models.architecture import Architecture
from common.models.build import build_from_architecture
from common.models.layout import load_flat_parameters
from common.releases.bundle import ModelBundle
from common.releases.evaluation import metrics_from_scores
from site_agent.data import Preprocessor, StudyTable
from site_agent.imaging import ImageDataset

PREDICT_BATCH = 4096


def build_model(
    arch: Architecture, *, allowed_factories: Sequence[str] = (), check_dp: bool = True
) -> nn.Module:
    """The untrained network an architecture describes, through the one registry
    (`common.models`), DP-checked unless `check_dp=False`; unknown or disallowed is a
    `ConfigError`."""
    return build_from_architecture(arch, allowed_model_factories=allowed_factories,
                                   check_dp=check_dp)


def load_model(bundle: ModelBundle, *, allowed_factories: Sequence[str] = ()) -> nn.Module:
    """The bundle's network with its parameters, in eval mode."""
    # Scoring runs no DP-SGD step: the trained network is not re-checked for Opacus
    # (which would cost the command seconds of start-up importing it).
    model = build_model(bundle.architecture, allowed_factories=allowed_factories,
                        check_dp=False)
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
    return prediction_from_scores(bundle, scores, table.labels)


def predict_images(
    bundle: ModelBundle, images: ImageDataset, *, allowed_factories: Sequence[str] = ()
) -> Prediction:
    """Score an images study's folder (decoded in batches, never loaded whole); metrics
    as `predict_table` when its labels CSV has the label column."""
    from site_agent.trainer import predict_scores

    model = load_model(bundle, allowed_factories=allowed_factories)
    scores = predict_scores(model, images, task=bundle.study.study.task, batch_size=256)
    labelled = images.labels.size > 0 and bool(np.all(images.labels >= 0))
    return prediction_from_scores(bundle, scores, images.labels if labelled else None)


def prediction_from_scores(
    bundle: ModelBundle, scores: np.ndarray, labels: np.ndarray | None
) -> Prediction:
    """Classes and, with `labels`, metrics of `scores` the bundle's network gave, at the
    bundle's own decision threshold (the operating point a deployment uses)."""
    classes = bundle.study.study.classes
    threshold = 0.5
    if bundle.study.study.task == "binary":
        threshold = bundle.threshold.value if bundle.threshold.value is not None else 0.5
        predicted = (scores >= threshold).astype(np.int64)
    else:
        predicted = np.argmax(scores, axis=1).astype(np.int64)
    metrics: dict[str, Any] | None = None
    if labels is not None:
        metrics = {"n": int(labels.shape[0])}
        if bundle.study.study.task == "binary":
            m = metrics_from_scores(scores, labels, threshold=threshold)
            metrics.update(
                auc=_num(m.auc),
                sensitivity=_num(m.sensitivity),
                specificity=_num(m.specificity),
                ppv=_num(m.ppv),
                threshold=threshold,
            )
        else:
            per_class = {
                str(c): _num(metrics_from_scores(scores[:, k], labels == k).auc)
                for k, c in enumerate(classes)
            }
            defined = [v for v in per_class.values() if v is not None]
            metrics.update(
                auc=float(np.mean(defined)) if defined else None,
                auc_per_class=per_class,
                accuracy=float(np.mean(predicted == labels)),
            )
    return Prediction(scores=scores, predicted=predicted, metrics=metrics)


def _num(value: float) -> float | None:
    """JSON has no NaN: an undefined metric (no positives, say) is null."""
    return None if math.isnan(value) else float(value)
