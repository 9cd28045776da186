"""An imaging study through the same commands as tables: a
study.toml with ``[data] kind = "images"`` and a hospital's own model factory, served by
`medfed coordinator serve --study`; real `medfed site run` processes on PNG, 16-bit PNG
and DICOM folders join by enrolment (each allowing the factory), train with
patient-level DP-SGD and SecAgg+, and store the final model; `medfed data check` on an
image folder names a bad file; `medfed predict` on an image folder reports an AUC."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.commands.cli import main_with
from common.core.processes import ManagedProcess
from common.privacy.ledger import read_ledger
from common.releases.bundle import read_bundle
from site_agent.predict_cli import register_data, register_predict
from site_agent.synthetic_imaging import HOSPITALS, write_site_folder
from tests.e2e.harness import StudyProcesses, list_members, make_pki

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

FACTORY = "tests.e2e.imaging_models:lesion_net"
# One hospital per loading path: 8-bit PNG, DICOM (modality LUT + window), 16-bit PNG.
SITES = ["north_general", "riverside_childrens", "st_marys"]
PATIENTS = 85
"""Each patient is held out with probability 0.2 (a keyed hash, `site_agent.unit_split`),
so the patients left to train are 85 - Binomial(85, 0.2): fewer than the 50 DP-SGD needs
with probability 2e-6 per site (at 70 it was 3 %: a site then stopped at its first
training round, "too few patients: 49 < 50", and the round aborted for everyone)."""
STUDY = f"""
[study]
name = "lesions"
rounds = 2
classes = ["0", "1"]

[data]
kind = "images"
file_column = "file"
label_column = "label"
patient_column = "patient_id"
image_size = [16, 16]
channels = 1

[model]
custom = "{FACTORY}"
options = {{ width = 8 }}

[training]
local_epochs = 2
learning_rate = 0.5
batch_size = 16

[privacy]
unit = "patient"
epsilon = 8.0
"""


def medfed(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The hospital's offline commands, in this process (the federation runs in real
    processes below)."""
    code = main_with([register_data, register_predict], list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_imaging_study_trains_a_custom_model_on_png_and_dicom(
    tmp_path: Path, processes: list[ManagedProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    assert [HOSPITALS[s].format for s in SITES] == ["png", "dicom", "png16"]
    folders = {
        site: write_site_folder(tmp_path / "cohort", site, seed=7, patients=PATIENTS)
        for site in SITES
    }
    assert any(folders["riverside_childrens"].glob("*.dcm"))
    study = tmp_path / "study.toml"
    study.write_text(STUDY, encoding="utf-8")

    # Offline, at each hospital: the folder fits the study.
    for site, folder in folders.items():
        code, out, err = medfed(capsys, "data", "check", "--study", str(study), "--data",
                                str(folder), "--json")
        assert code == 0, err
        report = json.loads(out.splitlines()[-1])
        assert report["ok"] and report["patients"] == PATIENTS, site
    # A damaged DICOM file is named, not reported as a crash.
    bad = tmp_path / "bad"
    shutil.copytree(folders["riverside_childrens"], bad)
    victim = sorted(bad.glob("*.dcm"))[2]
    victim.write_bytes(victim.read_bytes()[:200])
    code, out, err = medfed(capsys, "data", "check", "--study", str(study), "--data", str(bad),
                            "--json")
    error = json.loads(out.splitlines()[-1])["error"]
    assert code == 2 and error["file"] == str(victim), error

    pki = make_pki(tmp_path, SITES)
    run = StudyProcesses(tmp_path, study=list_members(study, pki, SITES), pki=pki,
                         processes=processes)
    run.start_coordinator()
    agents = {site: run.start_site(site, folders[site], "--allow-factory", FACTORY,
                                   "--device", "cpu")
              for site in SITES}
    for site, proc in agents.items():
        assert proc.wait_exit(timeout=800) == 0, f"{site}:\n{proc.tail(30)}"

    final_path = run.state / "model" / "final.safetensors"
    final = final_path.read_bytes()
    for site in SITES:
        assert (run.site_state(site) / "model" / "final.safetensors").read_bytes() == final
        _, entries = read_ledger(run.site_state(site) / "privacy-ledger.db")
        training = [e for e in entries if e.purpose == "training"]
        assert len(training) == 2  # one DP-SGD entry per round
    bundle = read_bundle(final_path)
    assert bundle.architecture.custom == FACTORY and bundle.final and bundle.round >= 2
    assert bundle.study.data.kind == "images" and bundle.card.unit == "patient"

    # New patients of a DICOM hospital: predict rebuilds the factory (only when allowed)
    # and reports an AUC.
    fresh = write_site_folder(tmp_path / "new", "valley_community", seed=11, patients=60)
    argv = ["predict", "--model", str(final_path), "--data", str(fresh),
            "--out", str(tmp_path / "scores.csv"), "--json"]
    code, _, err = medfed(capsys, *argv)
    assert code == 2 and f"--allow-factory {FACTORY}" in err
    code, out, err = medfed(capsys, *argv, "--allow-factory", FACTORY)
    assert code == 0, err
    metrics = json.loads(out.splitlines()[-1])
    assert metrics["n"] == len((tmp_path / "scores.csv").read_text().splitlines()) - 1
    assert isinstance(metrics["auc"], float) and 0.0 <= metrics["auc"] <= 1.0
