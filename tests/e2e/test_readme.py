"""README.md's "Running a real federation" section, run as written.

The shell blocks tagged ``<!-- readme-test: NAME -->`` are extracted from README.md and
run with bash, with only paths, ports, site and file names substituted, on three
generated hospital files (their own column names, a categorical column, missing
values). The federation must complete (statistics round, training, final evaluation),
every site must store the same final model as the coordinator, and `predict` must
report an AUC.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from common.core.processes import ManagedProcess
from tests.e2e.harness import README_SITES, Readme, readme_blocks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SITES = README_SITES
BLOCKS = ("hospital-key", "operator-pki", "study-init", "data-check", "approve", "coordinator",
          "site", "status", "predict")
WARDS = ["icu", "surgical", "medical"]


def write_hospital(path: Path, *, patients: int, seed: int) -> None:
    """Two encounters per patient; some missing lactate and ward cells."""
    rng = np.random.default_rng(seed)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["patient_id", "age_years", "sbp_mmhg", "lactate", "ward", "sepsis"])
        for p in range(patients):
            age = int(rng.integers(18, 95))
            for _ in range(2):
                sbp = rng.normal(120, 20)
                lactate = rng.gamma(2.0, 1.0)
                ward = WARDS[int(rng.integers(0, 3))]
                risk = 0.05 * (age - 60) + 1.2 * (lactate - 2) - 0.03 * (sbp - 120) + (
                    1.0 if ward == "icu" else 0.0
                )
                label = int(rng.random() < 1 / (1 + math.exp(-risk)))
                writer.writerow([
                    f"{path.stem}-{p:05d}", age, f"{sbp:.0f}",
                    "" if rng.random() < 0.1 else f"{lactate:.2f}",
                    "NA" if rng.random() < 0.05 else ward, label,
                ])


def test_readme_blocks_are_tagged() -> None:
    assert set(BLOCKS) <= set(readme_blocks())


def test_the_readme_federation_runs_as_written(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    for index, site in enumerate(SITES):
        write_hospital(tmp_path / f"{site}.csv", patients=150, seed=index + 1)
    readme = Readme(tmp_path)
    readme.set_up_pki()
    readme.run(readme.command("study-init"))
    for site in SITES:
        assert "ok" in readme.run(readme.command("data-check", site)).splitlines()[0]
        approved = readme.run(readme.command("approve", site))
        # The members the hospital approves: all three, each with its key fingerprint.
        assert all(f"  - {name} " in approved for name in SITES), approved

    coordinator = readme.start("coordinator", readme.command("coordinator"))
    processes.append(coordinator)
    coordinator.wait_event("listening", timeout=120)
    sites = {site: readme.start(site, readme.command("site", site)) for site in SITES}
    processes.extend(sites.values())
    for site, proc in sites.items():
        assert proc.wait_exit(timeout=800) == 0, f"{site}:\n{proc.tail(30)}"
    # A finished study is not an outage: the coordinator stays up (status, final model)
    # until its operator stops it, then exits 0.
    coordinator.wait_log("still serving status and the final model", timeout=120)
    assert coordinator.alive, coordinator.tail(30)
    status = readme.run(readme.command("status"))
    assert "finished" in status, status
    # Each kind of round by its name (the README study: 3 training rounds).
    assert "statistics round completed, 3 of 3 training rounds completed, " \
        "final evaluation round completed" in status, status
    for site in SITES:
        assert site in status, status
    coordinator.proc.terminate()
    assert coordinator.wait_exit(timeout=120) == 0, coordinator.tail(30)

    final = (tmp_path / "state" / "coordinator" / "model" / "final.safetensors").read_bytes()
    for site in SITES:
        assert (tmp_path / "state" / site / "model" / "final.safetensors").read_bytes() == final
    output = readme.run(readme.command("predict", SITES[1]))
    metrics = json.loads(output.strip().splitlines()[-1])
    assert isinstance(metrics["auc"], float) and 0.0 <= metrics["auc"] <= 1.0
    assert (tmp_path / "scores.csv").exists()
