"""``medfed model export --format onnx``: a model bundle as one self-contained ONNX file.

A hospital that cannot run Python (a scoring service, an EHR plug-in) runs the ONNX file
with any ONNX runtime and gets the same probabilities as ``medfed predict``:

* Tables: the bundle's numeric preprocessing is part of the graph (missing value ->
  global impute value and its indicator column, clip to the global range, standardise
  with the global mean and scale; `site_agent.data.Preprocessor`, in float64 as there).
  The caller feeds one float32 matrix ``features`` [records, columns] of *raw* values,
  one column per numeric feature (NaN for missing) and one 0/1 column per categorical
  level (``name=level``; a missing value is all zeros, imputed in the graph when the
  study says ``impute``). The column order is ``medfed.inputs`` in the model's metadata.
* Images: the network alone, input ``images`` [N, channels, height, width] float32; the
  caller decodes, scales to [0, 1] and resizes as `site_agent.imaging` does (written
  into ``medfed.image_preprocessing``).

The output ``probability`` is P(positive class) [N] for binary studies (sigmoid) and
the class probabilities [N, K] for multi-class (softmax). The threshold, classes, study
and privacy card travel in the ONNX ``metadata_props``.

Exported with the TorchScript exporter (``torch.onnx.export(dynamo=False)``), which needs
only the ``onnx`` package; the dynamo exporter of torch >= 2.9 also needs onnxscript.
``onnx`` is optional: without it the command says how to install it.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from common.core.errors import ConfigError, StateError
from common.core.fileio import atomic_write
from common.releases.bundle import ModelBundle, bundle_metadata
from common.study import MISSING_SUFFIX, Study, encoded_feature_names, study_sha256
from site_agent.predict import load_model

EXPORT_FORMATS = ("onnx",)
ONNX_FORMAT = "medfed-onnx/1"
OPSET = 17
INSTALL_HINT = "ONNX export needs the onnx package: pip install onnx"


def raw_input_names(study: Study) -> list[str]:
    """Columns of the ONNX ``features`` input, in order: a numeric feature as its name, a
    categorical one as ``name=level`` per declared level (the encoding, less the
    ``__missing`` indicators, which the graph computes)."""
    return [n for n in encoded_feature_names(study) if not _is_indicator(study, n)]


def _is_indicator(study: Study, name: str) -> bool:
    return any(
        f.missing == "indicator" and name == f.name + MISSING_SUFFIX for f in study.features
    )


class TabularScorer(nn.Module):
    """Raw columns -> `Preprocessor` encoding -> network -> probability, in one graph.

    Vectorised so the graph stays small however many features: numeric columns are
    imputed, clipped and standardised together; categorical blocks find their missing
    rows (no level set) with one matrix product; the encoded matrix is a fixed
    permutation of [numeric, one-hot, numeric missing, categorical missing].
    """

    num_cols: torch.Tensor
    cat_cols: torch.Tensor
    impute_value: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    mean: torch.Tensor
    scale: torch.Tensor
    group: torch.Tensor
    impute_level: torch.Tensor
    order: torch.Tensor

    def __init__(self, bundle: ModelBundle, network: nn.Module) -> None:
        super().__init__()
        study, stats = bundle.study, bundle.statistics
        raw = raw_input_names(study)
        numeric = [f for f in study.features if f.type == "numeric"]
        categorical = [f for f in study.features if f.type == "categorical"]
        num_cols = [raw.index(f.name) for f in numeric]
        cat_cols = [raw.index(f"{f.name}={lv}") for f in categorical for lv in f.levels or ()]
        group = np.zeros((len(cat_cols), len(categorical)))  # level column -> its feature
        impute = np.zeros((len(categorical), len(cat_cols)))  # feature -> its impute level
        sources: dict[str, int] = {}  # encoded name -> column of the stacked pieces
        n_num, n_cat = len(numeric), len(cat_cols)
        for j, spec in enumerate(numeric):
            sources[spec.name] = j
            sources[spec.name + MISSING_SUFFIX] = n_num + n_cat + j
        k = 0
        for j, spec in enumerate(categorical):
            levels = list(spec.levels or ())
            level = stats.categorical[spec.name].impute
            for i, name in enumerate(levels):
                group[k + i, j] = 1.0
                sources[f"{spec.name}={name}"] = n_num + k + i
            if spec.missing == "impute" and level is not None:
                impute[j, k + levels.index(level)] = 1.0
            sources[spec.name + MISSING_SUFFIX] = 2 * n_num + n_cat + j
            k += len(levels)

        def f64(values: Any) -> torch.Tensor:
            return torch.tensor(np.asarray(values, dtype=np.float64).reshape(-1))

        def column(key: str) -> torch.Tensor:
            return f64([getattr(stats.numeric[f.name], key) for f in numeric])

        self.register_buffer("num_cols", torch.tensor(num_cols, dtype=torch.int64))
        self.register_buffer("cat_cols", torch.tensor(cat_cols, dtype=torch.int64))
        self.register_buffer("impute_value", column("impute"))
        self.register_buffer("clip_low", column("clip_low"))
        self.register_buffer("clip_high", column("clip_high"))
        self.register_buffer("mean", column("mean"))
        self.register_buffer("scale", column("scale"))
        self.register_buffer("group", torch.tensor(group, dtype=torch.float64))
        self.register_buffer("impute_level", torch.tensor(impute, dtype=torch.float64))
        order = [sources[name] for name in encoded_feature_names(study)]
        self.register_buffer("order", torch.tensor(order, dtype=torch.int64))
        self.has_numeric = bool(num_cols)
        self.has_categorical = bool(cat_cols)
        self.network = network
        self.binary = study.study.task == "binary"

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = features.to(torch.float64)
        values: list[torch.Tensor] = []
        missing: list[torch.Tensor] = []
        if self.has_numeric:  # a study without numeric features has no such nodes
            raw = torch.index_select(x, 1, self.num_cols)
            num_missing = torch.isnan(raw)
            clean = torch.where(num_missing, self.impute_value, raw)
            clean = torch.minimum(torch.maximum(clean, self.clip_low), self.clip_high)
            values.append((clean - self.mean) / self.scale)
            missing.append(num_missing.to(torch.float64))
        if self.has_categorical:
            one_hot = torch.index_select(x, 1, self.cat_cols)
            one_hot = torch.where(torch.isnan(one_hot), torch.zeros_like(one_hot), one_hot)
            cat_missing = (torch.matmul(one_hot, self.group) == 0).to(torch.float64)
            values.append(one_hot + torch.matmul(cat_missing, self.impute_level))
            missing.append(cat_missing)
        encoded = torch.index_select(torch.cat(values + missing, dim=1), 1, self.order)
        return _probability(self.network(encoded.to(torch.float32)), binary=self.binary)


class ImageScorer(nn.Module):
    """The network and its output activation; the caller prepares the pixels."""

    def __init__(self, network: nn.Module, *, binary: bool) -> None:
        super().__init__()
        self.network = network
        self.binary = binary

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return _probability(self.network(images), binary=self.binary)


def _probability(logits: torch.Tensor, *, binary: bool) -> torch.Tensor:
    if binary:
        return torch.sigmoid(logits.reshape(-1))
    return torch.softmax(logits, dim=-1)


def image_preprocessing(study: Study) -> str:
    """What the caller does to an image before the graph (as `site_agent.imaging`)."""
    height, width = study.data.image_size or (0, 0)
    return (
        f"float32 [N, {study.data.channels}, {height}, {width}]: PNG/JPEG pixel values divided "
        "by the format's maximum (255, or 65535 for 16-bit); DICOM: modality LUT "
        "(RescaleSlope * x + RescaleIntercept), then the file's WindowCenter/WindowWidth "
        "(else the image's min..max) mapped linearly to [0, 1], MONOCHROME1 inverted; "
        "colour images as RGB channels, a grey image repeated to 3 channels when the study "
        f"has 3 (a colour image for a 1-channel study is refused); then a bilinear resize "
        f"of each channel to {height} x {width} "
        "(Pillow, mode F). No mean/std normalisation."
    )


def _usage(bundle: ModelBundle, inputs: Sequence[str]) -> str:
    study = bundle.study
    classes = list(study.study.classes)
    if study.study.task == "binary":
        out = f"probability [N]: P({study.data.label_column} = {classes[1]!r})"
        if bundle.threshold.value is not None:
            out += f"; predict positive when >= {bundle.threshold.value:g} (medfed.threshold)"
    else:
        out = f"probability [N, {len(classes)}]: one column per class {classes}, arg-max"
    if study.data.kind == "images":
        return f"input images {image_preprocessing(study)} Output {out}."
    return (
        f"input features float32 [N, {len(inputs)}], columns in the order of medfed.inputs: "
        "raw numeric values (NaN for missing; the graph imputes, clips and standardises "
        "with the bundled statistics), and one 0/1 column per categorical level "
        "(name=level; all zeros for a missing value). "
        f"Output {out}."
    )


def _privacy_summary(bundle: ModelBundle) -> str:
    card = bundle.card
    sites = ", ".join(f"{s.site} epsilon {s.epsilon:.3g} delta {s.delta:g}" for s in card.sites)
    secagg = "plain aggregation" if card.secagg is None else card.secagg.protocol
    return (
        f"{card.unit}-level DP ({card.accountant} accountant), {card.rounds} rounds, "
        f"{secagg}; {sites or 'no site reported'}; mechanisms: {', '.join(card.mechanisms)}"
    )


def onnx_metadata(bundle: ModelBundle, *, bundle_sha256: str) -> dict[str, str]:
    """The ONNX ``metadata_props``: everything a caller needs to feed and judge the model."""
    study = bundle.study
    meta = bundle_metadata(bundle)
    inputs = raw_input_names(study) if study.data.kind == "table" else []
    out = {
        "medfed.format": ONNX_FORMAT,
        "medfed.bundle_sha256": bundle_sha256,
        "medfed.study_name": study.study.name,
        "medfed.study_sha256": study_sha256(study),
        "medfed.study": meta["medfed.study"],
        "medfed.task": study.study.task,
        "medfed.classes": json.dumps([str(c) for c in study.study.classes]),
        "medfed.label_column": study.data.label_column,
        "medfed.threshold": meta["medfed.threshold"],
        "medfed.statistics": meta["medfed.statistics"],
        "medfed.privacy_card": meta["medfed.privacy_card"],
        "medfed.privacy_summary": _privacy_summary(bundle),
        "medfed.round": meta["medfed.round"],
        "medfed.final": meta["medfed.final"],
        "medfed.usage": _usage(bundle, inputs),
    }
    if study.data.kind == "table":
        out["medfed.inputs"] = json.dumps(inputs, ensure_ascii=False)
        out["medfed.encoded_features"] = json.dumps(
            encoded_feature_names(study), ensure_ascii=False
        )
        out["medfed.features"] = json.dumps(
            [
                {"name": f.name, "type": f.type, "levels": list(f.levels or ()),
                 "missing": f.missing}
                for f in study.features
            ],
            ensure_ascii=False,
        )
    else:
        out["medfed.input_shape"] = json.dumps(
            [study.data.channels, *(study.data.image_size or ())]
        )
        out["medfed.image_preprocessing"] = image_preprocessing(study)
    return out


def _import_onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ConfigError("format", INSTALL_HINT) from None
    return onnx


def export_onnx_bytes(
    bundle: ModelBundle, *, bundle_sha256: str, allowed_factories: Sequence[str] = ()
) -> bytes:
    """The bundle as a checked ONNX model with medfed's metadata (see the module doc)."""
    onnx = _import_onnx()
    study = bundle.study
    binary = study.study.task == "binary"
    network = load_model(bundle, allowed_factories=allowed_factories)
    scorer: nn.Module
    if study.data.kind == "table":
        scorer = TabularScorer(bundle, network)
        name = "features"
        example = torch.zeros(2, len(raw_input_names(study)))
    else:
        scorer = ImageScorer(network, binary=binary)
        name = "images"
        height, width = study.data.image_size or (1, 1)
        example = torch.zeros(2, study.data.channels or 1, height, width)
    scorer.eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        # torch >= 2.9 marks the TorchScript exporter deprecated; the dynamo one needs
        # onnxscript, which is not a dependency.
        warnings.simplefilter("ignore", DeprecationWarning)
        # GroupNorm's input-size check in torch.nn.functional is traced as a constant;
        # harmless (it only validates). Tracer warnings from a model's own code still show.
        warnings.filterwarnings(
            "ignore",
            message="Converting a tensor to a Python boolean",
            module="torch.nn.functional",
        )
        torch.onnx.export(
            scorer,
            (example,),
            cast(Any, buffer),  # the stubs say a path; the TorchScript exporter takes a file
            dynamo=False,
            input_names=[name],
            output_names=["probability"],
            dynamic_axes={name: {0: "records"}, "probability": {0: "records"}},
            opset_version=OPSET,
        )
    model = onnx.load_from_string(buffer.getvalue())
    model.producer_name = "medfed"
    model.doc_string = _usage(bundle, raw_input_names(study) if name == "features" else [])
    for key, value in onnx_metadata(bundle, bundle_sha256=bundle_sha256).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(model, full_check=True)
    data: bytes = model.SerializeToString()
    return data


def export_model(
    model_path: str | Path,
    out: str | Path,
    *,
    format: str = "onnx",
    allowed_factories: Sequence[str] = (),
) -> str:
    """Export the bundle at `model_path` to `out` (written atomically); returns the
    SHA-256 of the written file."""
    from common.releases.bundle import read_bundle

    if format not in EXPORT_FORMATS:
        raise ConfigError("format", f"unknown export format {format!r}; known: onnx")
    _import_onnx()  # before reading anything: the fix is an install
    model_path, out = Path(model_path), Path(out)
    bundle = read_bundle(model_path)
    bundle_sha = hashlib.sha256(model_path.read_bytes()).hexdigest()
    data = export_onnx_bytes(bundle, bundle_sha256=bundle_sha, allowed_factories=allowed_factories)
    try:
        atomic_write(out, data)
    except OSError as exc:
        raise StateError(f"cannot write {out}: {exc.strerror}") from None
    return hashlib.sha256(data).hexdigest()
