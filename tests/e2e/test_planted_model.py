"""No bit outside the ledger: a coordinator serving a planted model learns nothing from
how a site behaves, through a real federation.

The coordinator is the product's (`medfed coordinator serve --study`), started with a
planted initial model (`--initial-model`: what its operator chooses, as it chooses every
round's model): finite weights within the study's declared bound, NaN exactly on the
records it targets (tests/privacy/planted_models.py). Three real `medfed site run`
processes: `alpha` holds a data set plus the targeted patient, `beta` the SAME data set
without that patient, `gamma` other data. Before non-finite units were zeroed, alpha
dropped out of the training round (its clipped sum, its update or its evaluation score
was NaN) while beta uploaded: one bit per round, outside the ledger. Now both upload in
every phase, the round completes with all three, both end the study the same way and
write the same ledger entries.

For the logistic model (softmax regression over three classes), the MLP, the built-in
`cnn` on images (patient-level DP-SGD) and a hospital-level round (DDGauss, local
training without DP-SGD beneath). The patient is targeted by a rare category it alone
holds (its one-hot column above a threshold: exact, whatever the DP statistics release
gives), and the image by a lone bright pixel.
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from common.core.processes import ManagedProcess
from common.models.build import initial_model
from common.models.initial_file import write_initial_model
from common.models.layout import flatten_parameters, model_layout
from common.privacy.ledger import read_ledger
from common.study import Study, encoded_feature_names, load_study
from site_agent.approvals import Approvals
from site_agent.imaging import ImageSpec, load_image_folder
from site_agent.synthetic_imaging import LABELS_FILE, write_site_folder
from tests.e2e.harness import StudyProcesses, list_members, make_pki
from tests.privacy.planted_models import cnn_activation, plant_cnn, plant_tabular

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SITES = ("alpha", "beta", "gamma")
"""alpha: the shared data set plus the targeted patient; beta: the same data set without
it; gamma: other data."""
RARE = "isolation"
CATEGORIES = ("ward", "diet", "device", "room")
PATIENTS = 100  # two records each: ~80 left to train after the held-out fifth


def study_text(name: str, *, model: str, classes: list[str], privacy: str) -> str:
    """A table study: age, four categorical features whose level `isolation` only the
    targeted patient has, the declared bound raised to 1e38 (the planted model is
    within it: this is the overflow the bound cannot exclude for every model)."""
    features = '[[features]]\nname = "age"\nrange = [18, 100]\n\n' + "\n".join(
        f'[[features]]\nname = "{c}"\ntype = "categorical"\nlevels = ["a", "b", "{RARE}"]\n'
        for c in CATEGORIES)
    task = "binary" if len(classes) == 2 else "multiclass"
    return f"""[study]
name = "{name}"
rounds = 1
task = "{task}"
classes = {json.dumps(classes)}

[data]
label_column = "outcome"
patient_column = "patient"

{features}
[model]
{model}
max_abs_weight = 1e38

[training]
final_evaluation = false
batch_size = 32

[privacy]
{privacy}
"""


def write_table(path: Path, *, classes: list[str], seed: int, target: bool) -> Path:
    """PATIENTS patients (two records each) of ordinary categories, plus with `target`
    one patient holding the rare level of every categorical feature."""
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(PATIENTS):
        levels = [str(rng.choice(["a", "b"])) for _ in CATEGORIES]
        for _ in range(2):
            rows.append([f"S{seed}-{p:04d}", str(int(rng.integers(18, 95))), *levels,
                         classes[int(rng.integers(0, len(classes)))]])
    if target:
        rows += [["TARGET", "54", *([RARE] * len(CATEGORIES)), classes[0]]] * 2
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["patient", "age", *CATEGORIES, "outcome"])
        writer.writerows(rows)
    return path


def table_files(root: Path, classes: list[str]) -> dict[str, Path]:
    root.mkdir(parents=True, exist_ok=True)
    return {"alpha": write_table(root / "alpha.csv", classes=classes, seed=1, target=True),
            "beta": write_table(root / "beta.csv", classes=classes, seed=1, target=False),
            "gamma": write_table(root / "gamma.csv", classes=classes, seed=2, target=False)}


def rare_columns(study: Study) -> tuple[int, ...]:
    names = encoded_feature_names(study)
    return tuple(names.index(f"{c}={RARE}") for c in CATEGORIES)


def federate(root: Path, processes: list[ManagedProcess], *, study: str,
             files: dict[str, Path], plant: Callable[[Study, nn.Module], None]) -> None:
    """The study over real processes from a planted initial model; asserts alpha and
    beta behave alike: the training round completes with all three sites (nobody
    dropped, before or after the masked input), both finish the study (exit 0) and
    both ledgers hold the same entries."""
    study_path = root / "study.toml"
    study_path.write_text(study)
    pki = make_pki(root, SITES)
    loaded = load_study(list_members(study_path, pki, SITES))
    network = initial_model(loaded, seed=0)
    plant(loaded, network)
    planted = root / "planted.safetensors"
    write_initial_model(planted, loaded, model_layout(network), flatten_parameters(network),
                        seed=0)
    run = StudyProcesses(root, study=study_path, pki=pki, processes=processes)
    coordinator = run.start_coordinator("--initial-model", str(planted))
    agents = {}
    for site in SITES:
        Approvals(run.site_state(site)).approve_study(loaded)  # `medfed site approve`
        agents[site] = run.start_site(site, files[site])
    end = coordinator.wait_for(
        lambda e: e.get("event") == "round_aborted" or (
            e.get("event") == "round_completed" and e.get("kind") == "training"),
        timeout=600, what="the training round's end")
    assert end["event"] == "round_completed", end
    assert end["survivors"] == ",".join(SITES), end
    assert end["dropped"] == "" and end["dropped_after_input"] == "", end
    for site, proc in agents.items():
        assert proc.wait_exit(timeout=300) == 0, f"{site}:\n{proc.tail(20)}"
    ledgers = {site: [(e.purpose, e.round) for e in
                      read_ledger(run.site_state(site) / "privacy-ledger.db")[1]]
               for site in ("alpha", "beta")}
    assert ledgers["alpha"] == ledgers["beta"]
    assert ("training", int(end["round_number"])) in ledgers["alpha"]


def test_attack_planted_logistic_model_learns_nothing_from_site_behaviour(
        tmp_path: Path, processes: list[ManagedProcess]) -> None:
    classes = ["low", "mid", "high"]

    def plant(study: Study, network: nn.Module) -> None:
        # Class 0's logit: big x (sum of the four rare one-hot columns), infinite for
        # the target alone (sum 4 > 3.5), 0 for everyone else.
        plant_tabular(network, features=rare_columns(study), threshold=3.5)

    federate(tmp_path, processes, files=table_files(tmp_path / "data", classes), plant=plant,
             study=study_text("planted-logistic", model='name = "logistic"', classes=classes,
                              privacy='unit = "patient"\nepsilon = 8.0'))


def test_attack_planted_mlp_learns_nothing_from_site_behaviour(
        tmp_path: Path, processes: list[ManagedProcess]) -> None:
    classes = ["no", "yes"]

    def plant(study: Study, network: nn.Module) -> None:
        plant_tabular(network, features=rare_columns(study)[:1], threshold=0.5)

    federate(tmp_path, processes, files=table_files(tmp_path / "data", classes), plant=plant,
             study=study_text("planted-mlp", model='name = "mlp"\nhidden = [8]',
                              classes=classes, privacy='unit = "patient"\nepsilon = 8.0'))


def test_attack_planted_mlp_learns_nothing_from_a_hospital_level_round(
        tmp_path: Path, processes: list[ManagedProcess]) -> None:
    """Hospital-level DP without DP-SGD beneath: the local training is not private, so
    the targeted patient's NaN reaches the whole update, which the site then clips as a
    hospital. A NaN update is zero in the clipping ball: still sent with its noise."""
    classes = ["no", "yes"]

    def plant(study: Study, network: nn.Module) -> None:
        plant_tabular(network, features=rare_columns(study)[:1], threshold=0.5)

    federate(tmp_path, processes, files=table_files(tmp_path / "data", classes), plant=plant,
             study=study_text("planted-hospital", model='name = "mlp"\nhidden = [8]',
                              classes=classes,
                              privacy='unit = "hospital"\nepsilon = 8.0\nupdate_clip_norm = 1.0'))


def test_attack_planted_cnn_learns_nothing_from_site_behaviour(
        tmp_path: Path, processes: list[ManagedProcess]) -> None:
    """The built-in `cnn` at 16x16 under patient-level DP-SGD: the targeted image is
    black with one white pixel, which stands out after the network's normalisations far
    more than anything in the synthetic scans (checked below before planting)."""
    data = tmp_path / "data"
    shared = write_site_folder(data / "shared", "north_general", seed=7, patients=70)
    files = {"alpha": data / "alpha", "beta": data / "beta",
             "gamma": write_site_folder(data, "riverside_childrens", seed=8, patients=70)}
    shutil.copytree(shared, files["alpha"])
    shutil.copytree(shared, files["beta"])
    target = np.zeros((16, 16), dtype=np.uint8)
    target[8, 8] = 255
    Image.fromarray(target, mode="L").save(files["alpha"] / "target.png")
    with (files["alpha"] / LABELS_FILE).open("a", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerow(["target.png", "1", "TARGET"])

    spec = ImageSpec(image_size=16, channels=1, patient_column="patient_id")
    scans = [load_image_folder(files[s], spec) for s in SITES]
    activation = torch.cat([cnn_activation(d.load(np.arange(len(d)))) for d in scans])
    aimed = float(cnn_activation(scans[0].load(np.array([len(scans[0]) - 1])))[0])
    ordinary = float(activation[activation < aimed].max())
    assert aimed > ordinary + 1.0, (aimed, ordinary)

    def plant(study: Study, network: nn.Module) -> None:
        plant_cnn(network, threshold=(aimed + ordinary) / 2)

    federate(tmp_path, processes, files=files, plant=plant, study="""[study]
name = "planted-cnn"
rounds = 1
classes = ["0", "1"]

[data]
kind = "images"
file_column = "file"
label_column = "label"
patient_column = "patient_id"
image_size = [16, 16]
channels = 1

[model]
name = "cnn"
max_abs_weight = 1e38

[training]
final_evaluation = false
batch_size = 16

[privacy]
unit = "patient"
epsilon = 8.0
""")
