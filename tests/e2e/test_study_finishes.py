"""Studies always finish, or end saying why (real processes over mutual TLS, real DP-SGD
sites with their SQLite ledgers):

* the study exactly as `medfed study init` drafts it (the user gives only the label,
  patient column, categorical levels and missing-value rule) runs its statistics,
  training and final evaluation rounds to `model/final.safetensors` at every site, and
  `site run --once` exits 0;
* a final evaluation round every site declines for good (their ledgers already hold the
  DP evaluations their policy allows) is not re-opened in a loop: the coordinator ends
  the study with an error naming the sites' reason, records it in its state, `medfed
  status` says so, and every `site run --once` exits non-zero with the same reason.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from common.commands.status import fetch_status
from common.core.config import PrivacySection
from common.core.processes import ManagedProcess, medfed_argv
from common.privacy.ledger import LedgerSigner, PrivacyLedger, read_ledger
from common.protocol.tls import TlsFiles
from common.study import DEFAULT_EVALUATION_NOISE_STD, load_study, study_sha256
from coordinator import queries
from coordinator.engine import FAILED_META
from coordinator.round_kinds.query import STUDY_DONE_FOR_QUERIES
from coordinator.store import CoordinatorStore
from site_agent.dp_release import PURPOSE_EVALUATION, evaluation_mechanism
from tests.e2e.harness import REPO, StudyProcesses, make_pki, run_medfed
from tests.study.helpers import hospital_rows

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

SITES = ["alpha", "beta", "gamma"]
COLUMNS = ["Patient-ID", "Age", "Sex", "Lactate", "Admission", "Outcome"]
ROUNDS = 1


def write_site_files(root: Path, n_patients: int = 100) -> dict[str, Path]:
    """One small hospital file per site with a 0/1 outcome (`study init`'s default
    classes): two visits per patient, some missing lactate and admission values."""
    files = {}
    for index, site in enumerate(SITES):
        path = root / f"{site}.csv"
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS)
            for row in hospital_rows(n_patients, seed=index + 1):
                writer.writerow([*row[:5], "1" if row[5] == "yes" else "0"])
        files[site] = path
    return files


def init_study(root: Path, files: dict[str, Path], *extra: str, pki: Path) -> Path:
    """`medfed study init` with only what a user must say about the data, and its
    hospitals (`--member-from` each site certificate in `pki`)."""
    out = root / "study.toml"
    members = [arg for site in SITES
               for arg in ("--member-from", str(pki / "sites" / f"{site}.crt"))]
    run_medfed("study", "init", "--out", str(out), "--header-from", str(files[SITES[0]]),
               "--label-column", "Outcome", "--patient-column", "Patient-ID",
               "--categorical", "Sex=F,M", "--categorical", "Admission=elective,emergency,"
               "transfer", "--missing", "impute", *members, *extra)
    return out


def test_the_study_init_study_finishes_with_the_final_model_at_every_site(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    files = write_site_files(tmp_path)
    # Every other setting is study init's default; only --rounds is lowered to one, since
    # each round of three DP sites costs CPU on a shared 2-core test machine and what is
    # checked here (every completed round DP-evaluated, the final evaluation round
    # included, the budget spent by the study's end) holds for one (the default ten-round
    # draft passes the same allowance rule and the default site policy:
    # tests/study/test_evaluation_allowance.py; several rounds run end to end in
    # tests/e2e/test_readme.py and tests/e2e/test_ledger_reset.py).
    pki = make_pki(tmp_path, SITES)
    study_path = init_study(tmp_path, files, "--rounds", str(ROUNDS), pki=pki)
    study = load_study(study_path)
    assert [m.name for m in study.members] == SITES
    assert study.training.final_evaluation
    assert study.privacy.evaluation.max_evaluations == "derived"
    assert study.max_evaluations == ROUNDS + 1

    run = StudyProcesses(tmp_path, study=study_path, pki=pki, processes=processes)
    # The sites poll as soon as their last round ends and hear "finished" at once: a
    # 5 s linger is ample, and the test waits for the coordinator's own exit after it.
    coordinator = run.start_coordinator("--exit-when-finished", "--linger-seconds", "5")
    agents = {site: run.start_site(site, files[site]) for site in SITES}
    for site, proc in agents.items():
        assert proc.wait_exit(timeout=1300) == 0, f"{site}:\n{proc.tail(30)}"
    assert coordinator.wait_exit(timeout=120) == 0, coordinator.tail(30)

    store = CoordinatorStore(f"sqlite:///{run.state / 'coordinator.db'}")
    try:
        records = [r for r in store.rounds() if r.status == "completed"]
        completed = {r.round_number for r in records}
        assert store.get_meta(FAILED_META) is None
    finally:
        store.close()
    # Every DP evaluation, the first round's included, is read with the noise the sites
    # put on their ledgers (each adds std 10 / sqrt(n_noise = 2) per count; three sum),
    # sent to the replica before the histogram: never an estimate from the release.
    announced = math.sqrt(len(SITES) * study.privacy.evaluation.noise_std ** 2 / 2)
    for record in records:
        assert record.metrics["auc_noise_std"] == pytest.approx(announced), record
    assert len(completed) == study.max_evaluations  # the training rounds + the final one
    final = (run.state / "model" / "final.safetensors").read_bytes()
    for site in SITES:
        assert (run.site_state(site) / "model" / "final.safetensors").read_bytes() == final
        header, entries = read_ledger(run.site_state(site) / "privacy-ledger.db")
        # A DP evaluation, on the ledger, in every round the study completed, the final
        # evaluation round included: the allowance the study asked paid for all of them.
        assert completed <= {e.round for e in entries if e.purpose == PURPOSE_EVALUATION}
        # Noise planned for the study's own rounds: the budget is spent by its end (the
        # final evaluation's reserve included), never past it.
        spent = max(e.epsilon_after for e in entries)
        assert 0.9 * header.budget_epsilon <= spent <= header.budget_epsilon, (site, spent)
    # No round is left to run a query before: `medfed query run` says so at once, and
    # submits nothing (it used to wait out its timeout, 600 s by default).
    query = tmp_path / "query.toml"
    query.write_text(f'name = "late"\nstudy_sha256 = "{study_sha256(study)}"\n\n'
                     '[[statistics]]\nname = "patients"\nkind = "count"\nepsilon = 0.5\n')
    asked = subprocess.run(
        medfed_argv("query", "run", "--query", str(query), "--coordinator-state",
                    str(run.state)), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert asked.returncode != 0 and STUDY_DONE_FOR_QUERIES in asked.stderr, asked.stderr
    assert not any(queries.folder(run.state, queries.INBOX).glob("*"))


def used_ledger(settings_dir: Path, site: str, *, pki: Path, evaluations: int) -> None:
    """A site ledger (as `site run` opens it) holding `evaluations` DP evaluations from
    an earlier study: the policy's allowance spent before this study starts."""
    privacy = PrivacySection()
    ledger = PrivacyLedger(
        settings_dir / "privacy-ledger.db", site_id=site, budget_epsilon=privacy.budget_epsilon,
        delta=privacy.delta, accountant=privacy.accountant, privacy_unit="patient",
        signer=LedgerSigner.from_files(pki / "sites" / f"{site}.crt",
                                       pki / "sites" / f"{site}.key"),
    )
    mechanism = evaluation_mechanism(noise_std=DEFAULT_EVALUATION_NOISE_STD, n_noise=2,
                                     bins=20)
    for number in range(1, evaluations + 1):
        ledger.reserve(number, [mechanism], now=dt.datetime.now(dt.UTC),
                       purpose=PURPOSE_EVALUATION)


def test_a_final_round_every_site_declines_for_good_ends_the_study_saying_why(
    tmp_path: Path, processes: list[ManagedProcess]
) -> None:
    files = write_site_files(tmp_path)
    pki = make_pki(tmp_path, SITES)
    study_path = init_study(tmp_path, files, "--rounds", "1", pki=pki)
    assert load_study(study_path).max_evaluations == 2  # 1 training + the final round
    run_medfed("pki", "issue", "--dir", str(pki), "--monitor", "ops")
    # Each site allows 2 evaluations (the study's 2: enrolment passes) and its ledger
    # already holds 2 from an earlier study.
    config = tmp_path / "site.toml"
    config.write_text("[policy]\nmax_evaluations = 2\n")
    run = StudyProcesses(tmp_path, study=study_path, pki=pki, processes=processes)
    for site in SITES:
        state = run.site_state(site)
        state.mkdir(parents=True)
        used_ledger(state, site, pki=pki, evaluations=2)

    coordinator = run.start_coordinator()  # stays up: status is asked after the failure
    agents = {site: run.start_site(site, files[site], "--config", str(config))
              for site in SITES}
    failed = coordinator.wait_event("study_failed", timeout=1300)
    assert failed["level"] == "error"
    reason = str(failed["reason"])
    assert "final evaluation round" in reason and "policy.max_evaluations" in reason
    assert all(site in reason for site in SITES), reason

    for site, proc in agents.items():
        assert proc.wait_exit(timeout=120) != 0, f"{site}:\n{proc.tail(30)}"
        said = proc.tail(8)
        assert "study failed" in said and "policy.max_evaluations" in said, said
        assert not (run.site_state(site) / "model" / "final.safetensors").exists()
    # The evaluation round was opened once, not again and again.
    assert coordinator.alive
    monitor = TlsFiles.for_monitor(pki, "ops")
    status = fetch_status(f"127.0.0.1:{run.port}", ca=monitor.ca, cert=monitor.cert,
                          key=monitor.key, timeout=10)
    assert status["failed"] == reason and not status["finished"]
    assert status["aborted_rounds"] == 1 and status["eta_seconds"] is None
    text = subprocess.run(
        [sys.executable, "-m", "common.commands.status", "status", "--coordinator",
         f"127.0.0.1:{run.port}", "--tls-ca", str(monitor.ca), "--tls-cert",
         str(monitor.cert), "--tls-key", str(monitor.key)],
        capture_output=True, text=True, cwd=REPO, check=True,
    ).stdout
    assert "study FAILED" in text and "policy.max_evaluations" in text and "ETA" not in text

    coordinator.stop()
    assert coordinator.proc.returncode == 1
    store = CoordinatorStore(f"sqlite:///{run.state / 'coordinator.db'}")
    try:
        assert store.get_meta(FAILED_META) == reason
    finally:
        store.close()
    print(json.dumps({"reason": reason}))
