"""`medfed demo` end to end on hospital CSVs (the `--data` path), small and quick:
real processes, real DP-SGD, SecAgg+, one site killed mid-round and restarted. The CSVs
have their own column names, a string categorical column, string labels and missing
values; the demo serves a study drafted from them (`coordinator serve --study`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from common.core.errors import StateError
from common.core.processes import ManagedProcess, medfed_argv
from common.privacy.ledger import anchor_path_for
from common.privacy.ledger_verify import verify_ledger
from common.releases.bundle import read_bundle
from common.releases.evaluation import metrics_from_scores
from common.study import load_study
from demo.options import DemoOptions
from demo.processes import FederationProcesses
from site_agent.data import load_study_table
from site_agent.predict import predict_table
from site_agent.unit_split import held_out_mask, site_split_key
from tests.e2e.harness import REPO
from tests.study.helpers import write_hospital_csv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SITES = ["north", "south", "east", "west"]
# The killed site's round waits out the consistency-check phase deadline before the
# survivors unmask without it: 10 s instead of the demo's 30 (the coordinator's
# documented environment setting, which overrides the demo's coordinator.toml).
SHORT_PHASES = {**os.environ, "MEDFED_COORDINATOR_DEADLINES__PHASE_SECONDS": "10"}


def test_demo_on_csv_folder_writes_report_and_plots(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    for index, site in enumerate(SITES):
        write_hospital_csv(tmp_path / "data" / f"{site}.csv", 300, seed=index + 1)
    out = tmp_path / "run"
    result = subprocess.run(
        medfed_argv(
            "demo", "--data", str(tmp_path / "data"), "--label-column", "Outcome",
            "--patient-column", "Patient-ID", "--out", str(out), "--rounds", "2",
            "--kill-round", "1", "--delta", "1e-3", "--budget-epsilon", "4",
        ),
        cwd=REPO, capture_output=True, text=True, timeout=850, check=False,
        env=SHORT_PHASES,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["sites"] == sorted(SITES)
    assert report["privacy_unit"] == "patient"
    rounds = report["rounds"]
    # The study's federated DP statistics round, then two training rounds and the final
    # evaluation round, all with secure aggregation.
    assert report["statistics_round"] == 1
    study = load_study(report["study"])
    assert study.feature("Admission type").levels == ("elective", "emergency", "transfer")
    assert study.feature("Admission type").missing == "indicator"
    assert study.feature("Lactate mmol/L").missing == "impute"
    assert study.study.classes == ("no", "yes")
    assert [r["round"] for r in rounds] == [2, 3, 4]
    assert all(r["secure_aggregation"] for r in rounds)
    assert rounds[-1]["evaluation_only"] and not rounds[0]["evaluation_only"]
    # The site killed in the first training round after sharing its keys was dropped, and the round
    # still completed with the others.
    faults = [line for line in result.stdout.splitlines() if line.startswith("[fault]")]
    assert faults[0].startswith("[fault] one site will be killed mid-round"), faults
    assert rounds[0]["dropped"] == ["west"]
    assert len(rounds[0]["participants"]) == 4
    # Restarted with its ledger, it enrols (before its study opens the ledger, then with
    # the ledger's head, checked against the replica) and takes part again.
    assert "west" in rounds[1]["participants"]
    for key in ("auc", "sensitivity", "specificity", "ppv"):
        assert 0.0 <= report["final"][key] <= 1.0
        for baseline in ("centralized_nodp", "federated_nodp"):
            assert 0.0 <= report["baselines"][baseline][key] <= 1.0
    for site in SITES:
        spent = report["final"]["epsilon"][site]
        assert 0.0 < spent <= report["final"]["budget"][site] == 4.0
        assert set(rounds[-1]["epsilon"]) == set(SITES)
    assert report["aborted_rounds"] == [] and report["evaluation_round"] == 4
    model = report["model"]
    assert model["kind"] == "final bundle" and model["threshold"] is not None
    assert hashlib.sha256(Path(model["path"]).read_bytes()).hexdigest() == model["sha256"]
    assert report["threshold"] == model["threshold"]
    assert (out / "auc_by_round.png").stat().st_size > 1000
    assert (out / "epsilon_by_round.png").stat().st_size > 1000
    assert "Federated + DP" in result.stdout
    # The DP model's row is exact on the held-out patients, as the baselines are: each
    # site's split rebuilt here from its own key file, its held-out rows scored with the
    # bundle as `medfed predict` scores a file.
    exact = report["final"]["exact"]
    assert exact["threshold"] == model["threshold"]
    scores, labels = [], []
    for site in SITES:
        table = load_study_table(tmp_path / "data" / f"{site}.csv", study)
        held = held_out_mask(np.asarray(table.patient_ids, dtype=object),
                             key=site_split_key(out / "sites" / site), held_out_fraction=0.2)
        prediction = predict_table(read_bundle(Path(model["path"])),
                                   table.subset(np.flatnonzero(held)))
        scores.append(prediction.scores)
        labels.append(table.labels[held])
    pooled = metrics_from_scores(np.concatenate(scores), np.concatenate(labels),
                                 threshold=model["threshold"])
    assert exact["n"] == sum(len(x) for x in labels)
    assert exact["auc"] == pytest.approx(pooled.auc, abs=1e-9)
    assert exact["sensitivity"] == pytest.approx(pooled.sensitivity, abs=1e-9)
    row = next(line for line in result.stdout.splitlines()
               if line.startswith("Federated + DP (eps<=4)"))
    assert f"{exact['auc']:.3f}" in row and f"{exact['specificity']:.3f}" in row
    # Judged against centralized logistic regression fitted on the pooled training rows.
    assert any(line.startswith("Centralized logistic regression (no DP)")
               for line in result.stdout.splitlines())
    gap = exact["auc"] - report["baselines"]["centralized_nodp"]["auc"]
    assert f"DP model against centralized training without DP: AUC {gap:+.3f}" in result.stdout
    assert "Federated + DP AUC as the federation reads it: " in result.stdout
    # Epsilon on evaluation apart from training, per site, from each site's ledger
    # (each purpose composed alone, so neither exceeds the composed total).
    for site in SITES:
        purposes = report["final"]["epsilon_by_purpose"][site]
        assert purposes["training"] > 0 and purposes["evaluation"] > 0
        assert max(purposes.values()) <= report["final"]["epsilon"][site] + 1e-9
    assert "evaluation" in result.stdout and "training" in result.stdout
    # The site's log names the patient count it trains with as the DP count it is.
    log = (out / "logs" / "north.log").read_text()
    assert "(DP count of patients ~" in log
    # Each round after the first names the local loss trend; the end says it again.
    assert "over the last 1 rounds: " in log or "over the last 2 rounds: " in log
    finished = [json.loads(line) for line in log.splitlines()
                if '"event": "site_finished"' in line]
    assert finished and len(finished[-1]["local_losses"]) >= 2, finished
    # The membership-inference audit line next to the seed-002 table.
    audit = report["privacy_audit"]
    assert audit["skipped"] is False and audit["site"] == "east"
    assert audit["no_dp"]["epsilon_claimed"] is None
    assert audit["dp"]["epsilon_claimed"] == pytest.approx(4.0, rel=0.05)
    assert audit["dp"]["epsilon_lower_bound"] < audit["dp"]["epsilon_claimed"]
    for part in ("no_dp", "dp"):
        assert 0.0 <= audit[part]["attack_auc"] <= 1.0
        assert 0.0 <= audit[part]["tpr_at_1pct_fpr"] <= 1.0
    assert audit["line"] == (
        f"membership inference AUC: no DP {audit['no_dp']['attack_auc']:.2f}, "
        f"DP eps=4 {audit['dp']['attack_auc']:.2f}"
    )
    assert audit["line"] in result.stdout
    # Every site holds the same final model as the coordinator, the restarted one too.
    assert "[fault] west restarted with its ledger" in result.stdout
    final = Path(model["path"]).read_bytes()
    for site in SITES:
        assert (out / "sites" / site / "model" / "final.safetensors").read_bytes() == final
    # Each site's own ledger verifies: the restarted site's through `medfed ledger
    # verify`, the others through the function it calls (each CLI run re-composes the
    # ledger's epsilons from scratch in a fresh process, seconds of CPU apiece).
    for site in SITES:
        ledger = out / "sites" / site / "privacy-ledger.db"
        if site == "west":
            verify = subprocess.run(medfed_argv("ledger", "verify", "--ledger", str(ledger)),
                                    cwd=REPO, capture_output=True, text=True, check=False)
            assert verify.returncode == 0, verify.stdout + verify.stderr
        else:
            report = verify_ledger(ledger, anchor_path=anchor_path_for(ledger))
            assert report.ok and report.epsilons_recomposed, report.problems


def test_demo_fails_fast_with_the_dead_sites_message(tmp_path: Path) -> None:
    """A site agent that dies (here: its data file does not exist) ends the demo at
    once with that site's own error, instead of a silent wait for the round start."""
    processes = FederationProcesses(DemoOptions(out=tmp_path / "run"))
    pki = tmp_path / "pki"
    subprocess.run(medfed_argv("pki", "init", "--dir", str(pki)), check=True, cwd=REPO,
                   capture_output=True)
    subprocess.run(medfed_argv("pki", "issue", "--dir", str(pki), "--site", "north"),
                   check=True, cwd=REPO, capture_output=True)
    missing = tmp_path / "absent.csv"
    site = ManagedProcess(
        "north",
        medfed_argv("site", "run", "--pki", str(pki), "--site", "north",
                    "--coordinator", "127.0.0.1:9", "--metrics-listen", "127.0.0.1:0",
                    "--state", str(tmp_path / "north"), "--data", str(missing)),
        log_dir=tmp_path / "logs", cwd=REPO,
    )
    processes.site_agents["north"] = site
    try:
        assert site.wait_exit(timeout=120) != 0
        site.stop()
        with pytest.raises(StateError, match="site north exited with code") as failure:
            processes.check_sites()
        assert str(missing) in str(failure.value)
    finally:
        site.stop()
