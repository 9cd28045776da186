"""The DP tuning study's simulation (bench.dp_tuning) learns a learnable table and its
DP-SGD noise follows the budget: real per-unit clipping and noise, real accounting."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from bench.dp_tuning import Setting, study


def write_sites(folder: Path) -> None:
    rng = np.random.default_rng(3)
    folder.mkdir()
    for site in ("a", "b", "c"):
        with (folder / f"{site}.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["pid", "y", "age", "sex", "lab"])
            for pid in range(400):
                age, lab = rng.normal(60, 10), rng.normal(2, 1)
                logit = 0.08 * (age - 60) + 1.2 * (lab - 2)
                writer.writerow([f"{site}{pid}", int(rng.random() < 1 / (1 + np.exp(-logit))),
                                 f"{age:.1f}", rng.choice(["F", "M"]),
                                 "" if pid % 7 == 0 else f"{lab:.2f}"])


def test_dp_federated_logistic_learns_and_tighter_budget_means_more_noise(
    tmp_path: Path,
) -> None:
    write_sites(tmp_path / "sites")
    setting = Setting(model="logistic", learning_rate=1.0, rounds=2)
    loose = study(tmp_path / "sites", label="y", patient="pid", settings=[setting],
                  epsilon=8.0, delta=1e-5, seed=0)
    tight = study(tmp_path / "sites", label="y", patient="pid", settings=[setting],
                  epsilon=0.5, delta=1e-5, seed=0)
    assert loose["centralized_lr_auc"] > 0.75
    row = loose["settings"][0]
    assert len(row["auc_by_round"]) == 2 and row["final_auc"] > 0.7
    assert row["gap"] == round(loose["centralized_lr_auc"] - row["final_auc"], 4)
    sigma_loose = loose["settings"][0]["noise_multipliers"]
    sigma_tight = tight["settings"][0]["noise_multipliers"]
    assert set(sigma_loose) == {"a", "b", "c"}
    assert all(sigma_tight[s] > sigma_loose[s] for s in sigma_loose)
