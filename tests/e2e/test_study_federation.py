"""A study over real processes: `coordinator serve --study`, the
federated DP statistics round, training with the global statistics, the final model at
every site; and a site whose file does not match the study, which stops before sending
anything."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from common.core.processes import ManagedProcess
from common.privacy.ledger import read_ledger
from common.privacy.mechanisms import DistributedDiscreteGaussian, Gaussian
from common.releases.statistics import statistics_length
from common.study import check_statistics, load_study, statistics_from_bytes
from site_agent.dp_release import gaussian_std_for
from tests.e2e.harness import StudyProcesses, list_members, make_pki
from tests.study.helpers import hospital_csvs, study_toml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SITES = ["alpha", "beta", "gamma"]
STUDY = study_toml("e2e", rounds=1, count_epsilon=0.3)


def test_statistics_round_training_and_final_model(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    study_path = tmp_path / "study.toml"
    study_path.write_text(STUDY)
    pki = make_pki(tmp_path, [*SITES, "broken"])
    study = load_study(list_members(study_path, pki, [*SITES, "broken"]))
    files = hospital_csvs(tmp_path, SITES)
    # The broken hospital's file lacks a column the study needs.
    rows = list(csv.reader(files["alpha"].open(encoding="utf-8")))
    with (tmp_path / "broken.csv").open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([row[:3] + row[4:] for row in rows])

    run = StudyProcesses(tmp_path, study=study_path, pki=pki, processes=processes)
    run.start_coordinator("--debug-write-aggregates")
    broken = run.start_site("broken", tmp_path / "broken.csv", "--debug-write-updates")
    # The hospitals start beside it (min_sites is 3: the broken one never counts).
    agents = {name: run.start_site(name, files[name], "--debug-write-updates")
              for name in SITES}
    assert broken.wait_exit(timeout=300) != 0
    message = broken.tail(5)
    assert "broken.csv" in message and "'Lactate mmol/L'" in message
    assert "missing column" in message
    # Refused before any key or update: no ledger entry, no update written.
    assert not (run.site_state("broken") / "debug-updates").exists()

    for name, proc in agents.items():
        assert proc.wait_exit(timeout=800) == 0, f"{name}:\n{proc.tail(30)}"

    state = run.state
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
        upload = run.site_state(name) / "debug-updates" / f"round-{stats_round:06d}.u32"
        np.add(expected, np.fromfile(upload, "<u4"), out=expected)
    assert np.array_equal(aggregate, expected)

    final = (state / "model" / "final.safetensors").read_bytes()
    for name in SITES:
        assert (run.site_state(name) / "model" / "final.safetensors").read_bytes() == final
        header, entries = read_ledger(run.site_state(name) / "privacy-ledger.db")
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
