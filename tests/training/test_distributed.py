"""Multi-process training at one hospital: torchrun, gloo, 2 real processes on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from common.models.layout import load_flat_parameters
from common.models.tables.mlp import TabularMLP
from common.privacy.accountant import Segment
from common.releases.evaluation import metrics_from_scores
from site_agent.data import prepare_site_split
from site_agent.distributed_train import config_from_args
from site_agent.synthetic import FEATURES, generate_cohort
from site_agent.trainer import LocalTrainer, predict_scores
from site_agent.unit_split import site_split_key, split_by_patient

ARGS = ["--patients", "250", "--rounds", "2", "--batch-size", "48", "--accountant", "rdp"]


@pytest.mark.slow
@pytest.mark.e2e
def test_two_ranks_end_identical_with_single_process_accounting(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "site_agent.distributed_train",
        "--out",
        str(tmp_path),
        *ARGS,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy")
    np.testing.assert_array_equal(rank0, rank1)
    summary = json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert summary["world_size"] == 2 and summary["grad_sample_mode"] == "ghost-distributed"

    # The same site trained in ONE process plans exactly the same mechanism.
    args = Namespace(
        batch_size=48,
        lr=0.5,
        target_epsilon=8.0,
        delta=1e-5,
        rounds=2,
        accountant="rdp",
        grad_sample_mode="ghost",
    )
    data = generate_cohort(["urban_academic"], seed=0, patients_per_site=250)["urban_academic"]
    train, held_out, _ = prepare_site_split(data, key=site_split_key(tmp_path))
    single = LocalTrainer(
        lambda: TabularMLP(len(FEATURES)), train, config_from_args(args, device="cpu"), seed=0
    )
    expected = single.planned_segments() * 2
    assert [Segment(*s) for s in summary["segments"]] == expected

    model = TabularMLP(len(FEATURES))
    load_flat_parameters(model, rank0)
    auc = metrics_from_scores(predict_scores(model, held_out.features), held_out.labels).auc
    assert auc > 0.75  # the distributed run really trained


@pytest.mark.slow
@pytest.mark.e2e
def test_two_ranks_train_the_imaging_model_with_unchanged_accounting(tmp_path: Path) -> None:
    """torchrun + DPDDP runs an images study's CNN too (gloo, 2 processes)."""
    from common.models.build import build_for_study
    from common.study import load_study
    from site_agent.imaging import image_spec_for_study, load_image_folder
    from site_agent.synthetic_imaging import write_site_folder
    from tests.training.test_study_hook import images_study

    folder = write_site_folder(tmp_path / "cohort", "st_marys", seed=1, patients=60)
    study_path = images_study(tmp_path)
    text = study_path.read_text(encoding="utf-8").replace("[16, 16]", "[12, 12]")
    study_path.write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    image_args = ["--rounds", "1", "--batch-size", "16", "--accountant", "rdp",
                  "--lr", "0.2", "--study", str(study_path), "--data", str(folder)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "site_agent.distributed_train", "--out", str(out), *image_args,
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = np.load(out / "rank0.npy"), np.load(out / "rank1.npy")
    np.testing.assert_array_equal(rank0, rank1)
    summary = json.loads((out / "result.json").read_text(encoding="utf-8"))
    assert summary["world_size"] == 2

    study = load_study(study_path)
    train, _ = split_by_patient(  # the launcher's split: the key it made in --out
        load_image_folder(folder, image_spec_for_study(study)), held_out_fraction=0.2,
        key=site_split_key(out),
    )
    args = Namespace(batch_size=16, lr=0.2, target_epsilon=8.0, delta=1e-5, rounds=1,
                     accountant="rdp", grad_sample_mode="ghost")
    single = LocalTrainer(lambda: build_for_study(study), train,
                          config_from_args(args, device="cpu", study=study), seed=0)
    assert [Segment(*s) for s in summary["segments"]] == single.planned_segments()
    assert summary["sample_rate"] == single.sample_rate
    initial = build_for_study(study)
    assert rank0.shape == (sum(p.numel() for p in initial.parameters()),)
