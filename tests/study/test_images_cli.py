"""Imaging data through the hospital's commands: `medfed data
check --study --data FOLDER` names bad files; `medfed predict --model BUNDLE --data
FOLDER` rebuilds the recorded architecture and scores the images."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from common.commands.cli import main_with
from common.models.architecture import architecture_from_study
from common.releases.bundle import ModelBundle, Threshold, write_bundle
from common.study import GlobalStatistics, Study, load_study, study_sha256
from site_agent.predict_cli import register_data, register_predict
from site_agent.synthetic_imaging import write_site_folder
from tests.study.helpers import privacy_card
from tests.training.test_study_hook import images_study


def run(argv: list[str]) -> int:
    return main_with([register_data, register_predict], argv)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_site_folder(tmp_path_factory.mktemp("img"), "st_marys", seed=3, patients=70)


def image_bundle(study: Study) -> ModelBundle:
    from common.models.build import initial_model

    model = initial_model(study, seed=1)
    return ModelBundle(
        study=study,
        architecture=architecture_from_study(study),
        statistics=GlobalStatistics(study_sha256=study_sha256(study), source="pixels in [0, 1]"),
        threshold=Threshold(value=0.5, method="fixed"),
        card=privacy_card(study),
        parameters={n: p.detach().numpy().copy() for n, p in model.named_parameters()},
        round=2,
        final=True,
    )


def test_data_check_reports_an_image_folder(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study = images_study(tmp_path)
    assert run(["data", "check", "--study", str(study), "--data", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["ok"] and report["privacy_unit"] == "patient" and report["patients"] == 70
    assert sum(report["labels"].values()) == report["records"]


def test_data_check_names_the_bad_file(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    victim = sorted(bad.glob("*.png"))[3]
    victim.write_bytes(b"not a png")
    study = images_study(tmp_path)
    assert run(["data", "check", "--study", str(study), "--data", str(bad), "--json"]) == 2
    error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert error["file"] == str(victim) and "unreadable image" in error["message"]
    victim.unlink()  # now the CSV row names a missing file
    assert run(["data", "check", "--study", str(study), "--data", str(bad), "--json"]) == 2
    error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert victim.name in error["message"] and error["file"].endswith("labels.csv")


def test_predict_scores_an_image_folder(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    study = load_study(images_study(tmp_path))
    model = tmp_path / "final.safetensors"
    write_bundle(model, image_bundle(study))
    out = tmp_path / "scores.csv"
    argv = ["predict", "--model", str(model), "--data", str(folder), "--out", str(out), "--json"]
    assert run(argv) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    with out.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == summary["records"] == summary["n"] and rows[0]["file"].endswith(".png")
    assert summary["auc"] is None or 0.0 <= summary["auc"] <= 1.0
    scores = np.array([float(r["score"]) for r in rows])
    assert np.all((scores >= 0) & (scores <= 1))

    # New images without labels: scores, no metrics.
    unlabelled = tmp_path / "new"
    unlabelled.mkdir()
    with (folder / "labels.csv").open(encoding="utf-8") as src:
        first = next(csv.DictReader(src))
    (unlabelled / first["file"]).write_bytes((folder / first["file"]).read_bytes())
    (unlabelled / "labels.csv").write_text(f"file\n{first['file']}\n", encoding="utf-8")
    assert run(["predict", "--model", str(model), "--data", str(unlabelled), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["records"] == 1 and "auc" not in summary


def test_predict_refuses_a_custom_factory_it_was_not_allowed(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = "tests.training.test_study_hook:tiny_net"
    study = load_study(images_study(tmp_path, model=f'custom = "{ref}"'))
    bundle = image_bundle(study)
    model = tmp_path / "custom.safetensors"
    write_bundle(model, bundle)
    assert run(["predict", "--model", str(model), "--data", str(folder), "--json"]) == 2
    assert f"--allow-factory {ref}" in capsys.readouterr().err
    argv = ["predict", "--model", str(model), "--data", str(folder), "--json",
            "--allow-factory", ref]
    assert run(argv) == 0
