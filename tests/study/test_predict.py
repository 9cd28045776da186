"""`medfed predict` and `medfed model show` end to end on a bundle with a real torch model
trained in the test: another hospital's file is scored and an AUC reported."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from common.commands.cli import main_with
from common.releases.bundle import write_bundle
from common.study import study_from_mapping
from site_agent.predict_cli import register_model, register_predict
from tests.study.helpers import COLUMNS, study_mapping, trained_bundle, write_hospital_csv


def run(argv: list[str]) -> int:
    return main_with([register_model, register_predict], argv)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    train = write_hospital_csv(folder / "train.csv", n_patients=300, seed=11)
    path = folder / "final.safetensors"
    write_bundle(path, trained_bundle(train))
    return path


def test_predict_reports_auc(
    tmp_path: Path, model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_hospital_csv(tmp_path / "county.csv", n_patients=200, seed=12)
    out = tmp_path / "scores.csv"
    argv = ["predict", "--model", str(model_file), "--data", str(data), "--out", str(out)]
    assert run(argv) == 0
    text = capsys.readouterr().out
    assert "AUC" in text and "sensitivity" in text and "specificity" in text and "PPV" in text
    with capsys.disabled():
        print("\n" + text.strip())  # the report a hospital sees
    assert run([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["records"] == 400 and result["threshold"] == 0.45
    # The synthetic signal is strong: a trained model ranks far better than chance.
    assert result["auc"] > 0.7
    assert set(result) >= {"auc", "sensitivity", "specificity", "ppv", "n"}
    with out.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 400 and list(rows[0]) == ["row", "Patient-ID", "score", "prediction"]
    assert rows[0]["row"] == "2" and rows[0]["prediction"] in ("no", "yes")
    assert all(0.0 <= float(r["score"]) <= 1.0 for r in rows)


def test_predict_without_labels_writes_csv_to_stdout(
    tmp_path: Path, model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labelled = write_hospital_csv(tmp_path / "l.csv", n_patients=5, seed=13)
    lines = labelled.read_text(encoding="utf-8").splitlines()
    unlabelled = tmp_path / "u.csv"
    # New patients: no outcome column yet, no patient id either.
    with unlabelled.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        for record in csv.reader(lines):
            writer.writerow(record[1:5])
    assert run(["predict", "--model", str(model_file), "--data", str(unlabelled)]) == 0
    captured = capsys.readouterr()
    scores = list(csv.DictReader(captured.out.splitlines()))
    assert len(scores) == 10 and list(scores[0]) == ["row", "score", "prediction"]
    assert "no metrics" in captured.err
    assert COLUMNS[5] not in captured.out


def test_predict_refuses_bad_data(
    tmp_path: Path, model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_hospital_csv(tmp_path / "x.csv", n_patients=5, seed=14)
    text = data.read_text(encoding="utf-8").replace(",F,", ",female,", 1)
    data.write_text(text, encoding="utf-8")
    assert run(["predict", "--model", str(model_file), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert "column 'Sex'" in err and "'female' is not declared" in err


def test_custom_factory_needs_explicit_permission(
    tmp_path: Path, model_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from common.models.architecture import architecture_from_study
    from common.releases.bundle import read_bundle

    bundle = read_bundle(model_file)
    mapping = study_mapping()
    mapping["model"] = {"custom": "tests.study.no_such_module:build"}
    study = study_from_mapping(mapping)
    from common.study import study_sha256

    custom = replace(
        bundle,
        study=study,
        architecture=architecture_from_study(study),
        statistics=bundle.statistics.model_copy(update={"study_sha256": study_sha256(study)}),
    )
    path = tmp_path / "custom.safetensors"
    write_bundle(path, custom)
    data = write_hospital_csv(tmp_path / "d.csv", n_patients=5, seed=15)
    assert run(["predict", "--model", str(path), "--data", str(data)]) == 2
    assert "--allow-factory tests.study.no_such_module:build" in capsys.readouterr().err
    argv = ["predict", "--model", str(path), "--data", str(data)]
    assert run([*argv, "--allow-factory", "tests.study.no_such_module:build"]) == 2
    assert "cannot import" in capsys.readouterr().err


def test_model_show(model_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["model", "show", "--model", str(model_file)]) == 0
    text = capsys.readouterr().out
    for words in (
        "sepsis-pilot",
        "threshold 0.45 (youden-dp-roc)",
        "site st-marys: epsilon 3.2",
        "hospital-level: epsilon 12.8",
        "secagg+: threshold 2",
        "Lactate mmol/L__missing",
        "accountant prv",
    ):
        assert words in text
    assert run(["model", "show", "--model", str(model_file), "--json"]) == 0
    card = json.loads(capsys.readouterr().out)
    assert card["privacy"]["sites"][1]["site"] == "county" and card["final"] is True
    assert card["encoded_features"][0] == "Age (years)"


def test_initial_model_and_threshold_for_the_coordinator() -> None:
    import numpy as np

    from common.models.build import initial_model
    from common.models.layout import flatten_parameters
    from common.releases.bundle import parameters_from_flat, threshold_from_histogram
    from tests.study.helpers import hospital_study

    study = hospital_study()
    a = initial_model(study, seed=7)
    b = initial_model(study, seed=7)
    np.testing.assert_array_equal(flatten_parameters(a), flatten_parameters(b))
    layout = [(n, tuple(p.shape)) for n, p in a.named_parameters()]
    assert layout[0] == ("net.0.weight", (16, 8))  # 8 encoded inputs, hidden [16]
    parameters = parameters_from_flat(layout, flatten_parameters(a))
    assert list(parameters) == [n for n, _ in layout]
    histogram = np.array([5, 5, 0, 0, 0, 0, 5, 5])  # negatives low, positives high
    threshold = threshold_from_histogram(histogram, bins=4)
    assert threshold.value == 0.5 and threshold.histogram_bins == 4


def test_unknown_or_unbuildable_models_are_refused() -> None:
    from common.core.errors import ConfigError
    from common.models.architecture import Architecture
    from site_agent.predict import build_model

    # One registry (common.models): the mlp has K outputs for multi-class.
    multi = build_model(Architecture(name="mlp", in_features=3, num_outputs=3))
    assert list(multi.parameters())[-1].shape == (3,)
    with pytest.raises(ConfigError, match="not 2"):
        build_model(Architecture(name="mlp", in_features=3, num_outputs=2))
    with pytest.raises(ConfigError, match="in_channels"):
        build_model(Architecture(name="cnn", num_outputs=1))
    with pytest.raises(ConfigError, match="allowed_model_factories"):
        build_model(Architecture(custom="tests.study.helpers:no_such", num_outputs=1))
    cnn = build_model(Architecture(name="resnet18-gn", in_channels=1, num_outputs=1))
    assert sum(p.numel() for p in cnn.parameters()) > 1_000_000
