"""A study run again from a fresh coordinator state, with real processes over mutual
TLS: a site that already released the study's statistics (its state folder keeps the
pin) declines the new statistics round, the coordinator logs why, and the site stops
with the way out instead of failing every round while the coordinator aborts for
missed heartbeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.core.processes import ManagedProcess
from common.privacy.ledger import read_ledger
from common.study import load_study, study_sha256
from site_agent.data import load_study_table
from site_agent.statistics_pin import StatisticsPin
from tests.e2e.harness import StudyProcesses, list_members, make_pki
from tests.study.helpers import hospital_csvs, noiseless_statistics, study_toml

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SITES = ["alpha", "beta", "gamma"]


def test_a_site_that_released_the_statistics_declines_the_rerun_and_stops(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    study_path = tmp_path / "study.toml"
    study_path.write_text(study_toml("rerun", rounds=1))
    pki = make_pki(tmp_path, SITES)
    study = load_study(list_members(study_path, pki, SITES))
    files = hospital_csvs(tmp_path, SITES)
    run = StudyProcesses(tmp_path, study=study_path, pki=pki, processes=processes)
    # alpha took part in an earlier run of this very study: its state folder holds the
    # statistics it accepted then (what the agent writes at its first training round).
    alpha_state = run.site_state("alpha")
    StatisticsPin(alpha_state).accept(
        noiseless_statistics(study, load_study_table(files["alpha"], study)))
    pin = alpha_state / "statistics" / f"{study_sha256(study)}.json"
    assert pin.is_file()

    coordinator = run.start_coordinator()  # a fresh state: the statistics round again
    agents = {name: run.start_site(name, files[name]) for name in SITES}

    alpha = agents["alpha"]
    assert alpha.wait_exit(timeout=400) == 2, alpha.tail(30)
    text = " ".join(json.dumps(line) for line in alpha.lines)
    assert "declining round" in text and "statistics were already released" in text
    assert str(pin) in text and "remove that statistics file" in text
    assert "medfed: error:" in text and "Traceback" not in text
    # The coordinator heard why alpha left, for the round it was selected for.
    declined = coordinator.wait_event("site_declined", timeout=60, site="alpha")
    assert "released this study's statistics already" in str(declined["msg"])
    # Privacy intact: no second release, not even a ledger reservation for one.
    _, entries = read_ledger(alpha_state / "privacy-ledger.db")
    assert [e for e in entries if e.purpose == "statistics"] == []
    assert pin.is_file()
    # The other sites are still up, waiting for a round that can have them.
    assert agents["beta"].alive and agents["gamma"].alive
