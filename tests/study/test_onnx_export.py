"""`medfed model export --format onnx`: the exported graph, run by onnxruntime on a
hospital's raw values (a string categorical, missing and out-of-range values), gives the
probabilities `medfed predict` gives, and its metadata says how to feed it."""

from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.commands.cli import main_with
from common.models.architecture import architecture_from_study
from common.models.build import initial_model
from common.releases.bundle import (
    ModelBundle,
    Threshold,
    read_bundle,
    write_bundle,
)
from common.study import load_study, study_from_mapping, study_sha256
from site_agent.data import load_study_table
from site_agent.predict import predict_images, predict_table
from site_agent.predict_cli import register_model
from tests.study.helpers import (
    privacy_card,
    study_mapping,
    trained_bundle,
    write_hospital_csv,
)

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def run(argv: list[str]) -> int:
    return main_with([register_model], argv)


def session(path: Path) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # the test machine's cores are shared
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def metadata(path: Path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def raw_matrix(csv_path: Path, features: list[dict[str, Any]], inputs: list[str]) -> np.ndarray:
    """What a hospital's own code does with the metadata alone: numeric cells as floats
    (NaN when empty), categorical cells as one 0/1 column per level."""
    kinds = {f["name"]: f["type"] for f in features}
    with csv_path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    matrix = np.zeros((len(rows), len(inputs)), dtype=np.float32)
    for i, row in enumerate(rows):
        for j, name in enumerate(inputs):
            if kinds.get(name) == "numeric":
                cell = row[name].strip()
                matrix[i, j] = float(cell) if cell not in ("", "NA") else math.nan
            else:
                feature, level = name.split("=", 1)
                matrix[i, j] = 1.0 if row[feature].strip() == level else 0.0
    return matrix


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("onnx-model")
    train = write_hospital_csv(folder / "train.csv", n_patients=150, seed=21)
    path = folder / "final.safetensors"
    write_bundle(path, trained_bundle(train, steps=150))
    return path


def hospital_file(path: Path) -> Path:
    """Another hospital's file, plus rows outside the study's age range [18, 100] and
    with every value that may be missing missing."""
    write_hospital_csv(path, n_patients=80, seed=22)
    with path.open("a", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["X-1", "130", "M", "", "NA", "yes"])
        writer.writerow(["X-2", "3", "F", "7.5", "", "no"])
        writer.writerow(["X-3", "64", "F", "NA", "transfer", "no"])
    return path


def test_onnx_gives_predicts_scores(
    tmp_path: Path, model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.onnx"
    argv = ["model", "export", "--model", str(model_file), "--format", "onnx", "--out", str(out)]
    assert run(argv) == 0
    assert f"exported {model_file} to {out}" in capsys.readouterr().out

    data = hospital_file(tmp_path / "county.csv")
    bundle = read_bundle(model_file)
    table = load_study_table(data, bundle.study, for_prediction=True)
    missing = table.missing_counts()
    assert missing["Lactate mmol/L"] > 0 and missing["Admission type"] > 0
    expected = predict_table(bundle, table).scores

    meta = metadata(out)
    inputs = json.loads(meta["medfed.inputs"])
    features = json.loads(meta["medfed.features"])
    raw = raw_matrix(data, features, inputs)
    (scores,) = session(out).run(["probability"], {"features": raw})
    assert scores.shape == expected.shape == (len(table),)
    assert np.allclose(scores, expected, atol=1e-5)


def test_onnx_metadata_names_the_features(
    tmp_path: Path, model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.onnx"
    assert run(["model", "export", "--model", str(model_file), "--out", str(out)]) == 0
    meta = metadata(out)
    assert json.loads(meta["medfed.inputs"]) == [
        "Age (years)",
        "Sex=F",
        "Sex=M",
        "Lactate mmol/L",
        "Admission type=elective",
        "Admission type=emergency",
        "Admission type=transfer",
    ]
    assert "Lactate mmol/L__missing" in json.loads(meta["medfed.encoded_features"])
    assert meta["medfed.format"] == "medfed-onnx/1" and meta["medfed.task"] == "binary"
    assert json.loads(meta["medfed.classes"]) == ["no", "yes"]
    assert json.loads(meta["medfed.threshold"])["value"] == 0.45
    assert "st-marys epsilon 3.2" in meta["medfed.privacy_summary"]
    assert json.loads(meta["medfed.privacy_card"])["accountant"] == "prv"
    assert "NaN for missing" in meta["medfed.usage"]
    model = onnx.load(str(out))
    assert [i.name for i in model.graph.input] == ["features"]
    assert [o.name for o in model.graph.output] == ["probability"]


def test_multiclass_export_gives_softmax(tmp_path: Path) -> None:
    mapping = study_mapping()
    mapping["study"] = {
        "name": "triage", "rounds": 2, "task": "multiclass", "classes": ["no", "yes", "icu"]
    }
    study = study_from_mapping(mapping)
    trained = trained_bundle(write_hospital_csv(tmp_path / "t.csv", n_patients=60), steps=1)
    model = initial_model(study, seed=4)
    bundle = ModelBundle(
        study=study,
        architecture=architecture_from_study(study),
        statistics=trained.statistics.model_copy(update={"study_sha256": study_sha256(study)}),
        threshold=Threshold(method="argmax"),
        card=trained.card,
        parameters={n: p.detach().numpy().copy() for n, p in model.named_parameters()},
        round=2,
        final=True,
    )
    path = tmp_path / "triage.safetensors"
    write_bundle(path, bundle)
    out = tmp_path / "triage.onnx"
    assert run(["model", "export", "--model", str(path), "--out", str(out)]) == 0
    data = hospital_file(tmp_path / "d.csv")
    expected = predict_table(bundle, load_study_table(data, study, for_prediction=True)).scores
    meta = metadata(out)
    raw = raw_matrix(data, json.loads(meta["medfed.features"]), json.loads(meta["medfed.inputs"]))
    (scores,) = session(out).run(["probability"], {"features": raw})
    assert scores.shape == expected.shape == (raw.shape[0], 3)
    assert np.allclose(scores, expected, atol=1e-5)
    assert np.allclose(scores.sum(axis=1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    "features",
    [
        [
            {"name": "a", "range": [-3, 3], "missing": "impute"},
            {"name": "b", "missing": "indicator"},
        ],
        [{"name": "c", "type": "categorical", "levels": ["x", "y"], "missing": "indicator"}],
    ],
    ids=["numeric-only", "categorical-only"],
)
def test_single_kind_studies_export(tmp_path: Path, features: list[dict[str, Any]]) -> None:
    from common.study import CategoricalStatistics, GlobalStatistics, NumericStatistics

    study = study_from_mapping(
        {
            "study": {"name": "one-kind", "rounds": 1},
            "data": {"label_column": "y"},
            "features": features,
            "model": {"name": "mlp", "hidden": [4]},
            "privacy": {"unit": "record"},
        }
    )
    names = [f["name"] for f in features]
    numeric = {
        n: NumericStatistics(mean=0.5, scale=2.0, impute=0.25, clip_low=-3.0, clip_high=3.0)
        for n in names
        if n != "c"
    }
    categorical = {"c": CategoricalStatistics(impute="x")} if "c" in names else {}
    model = initial_model(study, seed=2)
    bundle = ModelBundle(
        study=study,
        architecture=architecture_from_study(study),
        statistics=GlobalStatistics(
            study_sha256=study_sha256(study),
            source="test",
            numeric=numeric,
            categorical=categorical,
        ),
        threshold=Threshold(value=0.5, method="fixed"),
        card=privacy_card(study),
        parameters={n: p.detach().numpy().copy() for n, p in model.named_parameters()},
    )
    path = tmp_path / "b.safetensors"
    write_bundle(path, bundle)
    out = tmp_path / "b.onnx"
    assert run(["model", "export", "--model", str(path), "--out", str(out)]) == 0
    cells = {"a": ["", "9", "-7", "1.5"], "b": ["2", "", "0", "NA"], "c": ["x", "y", "", "y"]}
    data = tmp_path / "d.csv"
    with data.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow([*names, "y"])
        writer.writerows([*(cells[n][i] for n in names), str(i % 2)] for i in range(4))
    expected = predict_table(bundle, load_study_table(data, study, for_prediction=True)).scores
    meta = metadata(out)
    raw = raw_matrix(data, json.loads(meta["medfed.features"]), json.loads(meta["medfed.inputs"]))
    (scores,) = session(out).run(["probability"], {"features": raw})
    assert np.allclose(scores, expected, atol=1e-5)


def test_image_model_export(tmp_path: Path) -> None:
    from site_agent.imaging import image_spec_for_study, load_image_folder
    from site_agent.synthetic_imaging import write_site_folder
    from tests.study.test_images_cli import image_bundle
    from tests.training.test_study_hook import images_study

    study = load_study(images_study(tmp_path))
    path = tmp_path / "cnn.safetensors"
    bundle = image_bundle(study)
    write_bundle(path, bundle)
    out = tmp_path / "cnn.onnx"
    assert run(["model", "export", "--model", str(path), "--out", str(out)]) == 0
    meta = metadata(out)
    channels, height, width = json.loads(meta["medfed.input_shape"])
    assert (channels, height, width) == (study.data.channels, *(study.data.image_size or ()))
    assert "bilinear resize" in meta["medfed.image_preprocessing"]

    folder = write_site_folder(tmp_path / "img", "st_marys", seed=5, patients=6)
    images = load_image_folder(folder, image_spec_for_study(study), labels_optional=True)
    expected = predict_images(bundle, images).scores
    pixels = images.load(np.arange(len(images))).numpy().astype(np.float32)
    assert pixels.shape[1:] == (channels, height, width)
    (scores,) = session(out).run(["probability"], {"images": pixels})
    assert np.allclose(scores, expected, atol=1e-5)


def test_export_errors_are_clear(
    tmp_path: Path,
    model_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "m.onnx"
    base = ["model", "export", "--model", str(model_file), "--out", str(out)]
    assert run([*base, "--format", "pmml"]) == 2
    assert "unknown export format 'pmml'" in capsys.readouterr().err

    # A bundle naming a custom factory exports only when the factory is allowed by name.
    ref = "tests.study.no_such_module:build"
    mapping = study_mapping()
    mapping["model"] = {"custom": ref}
    study = study_from_mapping(mapping)
    bundle = read_bundle(model_file)
    custom = replace(
        bundle,
        study=study,
        architecture=architecture_from_study(study),
        statistics=bundle.statistics.model_copy(update={"study_sha256": study_sha256(study)}),
    )
    path = tmp_path / "custom.safetensors"
    write_bundle(path, custom)
    argv = ["model", "export", "--model", str(path), "--out", str(out)]
    assert run(argv) == 2
    assert f"--allow-factory {ref}" in capsys.readouterr().err
    assert run([*argv, "--allow-factory", ref]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert not out.exists()

    # Without the onnx package, the message says how to install it.
    monkeypatch.setitem(sys.modules, "onnx", None)
    assert run(base) == 2
    assert "pip install onnx" in capsys.readouterr().err
    assert not out.exists()
