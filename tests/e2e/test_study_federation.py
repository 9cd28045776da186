"""A study over real processes (issues 10 and 11): `coordinator serve --study`, the
federated DP statistics round, training with the global statistics, the final model at
every site; and a site whose file does not match the study, which stops before sending
anything."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.privacy.ledger import read_ledger
from common.privacy.mechanisms import DistributedDiscreteGaussian, Gaussian
from common.processes import ManagedProcess, medfed_argv
from common.statistics import statistics_length
from common.study import check_statistics, load_study, statistics_from_bytes
from site_agent.dp_release import gaussian_std_for
from tests.e2e.harness import REPO, make_pki
from tests.study.helpers import write_hospital_csv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SITES = ["alpha", "beta", "gamma"]
STUDY = """
[study]
name = "e2e"
rounds = 1
classes = ["no", "yes"]

[data]
label_column = "Outcome"
patient_column = "Patient-ID"

[[features]]
name = "Age (years)"
range = [18, 100]

[[features]]
name = "Sex"
type = "categorical"
levels = ["F", "M"]

[[features]]
name = "Lactate mmol/L"
missing = "impute"

[[features]]
name = "Admission type"
type = "categorical"
levels = ["elective", "emergency", "transfer"]
missing = "indicator"

[model]
name = "mlp"
hidden = [8]

[training]
final_evaluation = false

[privacy]
unit = "patient"
epsilon = 8.0
delta = 1e-5
count_epsilon = 0.3
"""


@pytest.fixture
def processes() -> Iterator[list[ManagedProcess]]:
    started: list[ManagedProcess] = []
    yield started
    for proc in started:
        proc.stop()


def test_statistics_round_training_and_final_model(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    pki = make_pki(tmp_path, [*SITES, "broken"])
    study_path = tmp_path / "study.toml"
    study_path.write_text(STUDY)
    study = load_study(study_path)
    for index, site in enumerate(SITES):
        write_hospital_csv(tmp_path / f"{site}.csv", 120, seed=index + 1)
    # The broken hospital's file lacks a column the study needs.
    rows = list(csv.reader((tmp_path / "alpha.csv").open(encoding="utf-8")))
    with (tmp_path / "broken.csv").open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([row[:3] + row[4:] for row in rows])

    logs = tmp_path / "logs"
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    coordinator = ManagedProcess(
        "coordinator",
        medfed_argv("coordinator", "serve", "--study", str(study_path), "--pki", str(pki),
                    "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                    "--state", str(tmp_path / "coordinator"), "--min-sites", "3",
                    "--selection-seconds", "1", "--debug-write-aggregates",
                    "--linger-seconds", "20"),
        log_dir=logs, env=env, cwd=REPO,
    )
    processes.append(coordinator)
    port = int(coordinator.wait_event("listening", timeout=120)["port"])

    def site(name: str) -> ManagedProcess:
        proc = ManagedProcess(
            name,
            medfed_argv("site", "run", "--pki", str(pki), "--site", name,
                        "--coordinator", f"127.0.0.1:{port}", "--metrics-listen",
                        "127.0.0.1:0", "--state", str(tmp_path / "sites" / name),
                        "--data", str(tmp_path / f"{name}.csv"), "--debug-write-updates",
                        "--once"),
            log_dir=logs, env=env, cwd=REPO,
        )
        processes.append(proc)
        return proc

    broken = site("broken")
    assert broken.wait_exit(timeout=300) != 0
    message = broken.tail(5)
    assert "broken.csv" in message and "'Lactate mmol/L'" in message
    assert "missing column" in message
    # Refused before any key or update: no ledger entry, no update written.
    assert not (tmp_path / "sites" / "broken" / "debug-updates").exists()

    agents = {name: site(name) for name in SITES}
    for name, proc in agents.items():
        assert proc.wait_exit(timeout=800) == 0, f"{name}:\n{proc.tail(30)}"

    state = tmp_path / "coordinator"
    import json

    record = json.loads((state / "statistics.json").read_text())
    statistics = statistics_from_bytes(record["statistics"].encode())
    check_statistics(study, statistics)
    age = statistics.numeric["Age (years)"]
    assert 30 < age.mean < 80 and (age.clip_low, age.clip_high) == (18, 100)
    lactate = statistics.numeric["Lactate mmol/L"]
    assert 0 < lactate.impute < 6 and lactate.clip_low < lactate.clip_high

    # The statistics round: exactly the sum of the sites' noised integer releases.
    stats_round = int(record["round"])
    aggregate = np.fromfile(state / "aggregates" / f"round-{stats_round:06d}.u32", "<u4")
    assert aggregate.size == statistics_length(study)
    expected = np.zeros_like(aggregate)
    for name in SITES:
        upload = tmp_path / "sites" / name / "debug-updates" / f"round-{stats_round:06d}.u32"
        np.add(expected, np.fromfile(upload, "<u4"), out=expected)
    assert np.array_equal(aggregate, expected)

    final = (state / "model" / "final.safetensors").read_bytes()
    for name in SITES:
        assert (tmp_path / "sites" / name / "model" / "final.safetensors").read_bytes() == final
        header, entries = read_ledger(tmp_path / "sites" / name / "privacy-ledger.db")
        # The study's count_epsilon (0.3) is spent, not the site's own limit (0.5).
        (count,) = [m for e in entries if e.purpose == "count" for m in e.mechanisms]
        assert isinstance(count, Gaussian)
        assert count.noise_std == gaussian_std_for(
            epsilon=0.3, delta=header.delta, accountant=header.accountant)
        released = [e for e in entries if e.purpose == "statistics"]
        assert [e.round for e in released] == [stats_round]
        (mechanism,) = released[0].mechanisms
        assert isinstance(mechanism, DistributedDiscreteGaussian)
        assert mechanism.contributors == 2  # round-size floor 3 minus 1 colluding site
        assert any(e.purpose == "training" for e in entries)
