"""Hospital-level DP over real processes: a study with
privacy.unit = "hospital" trains with each site's whole update clipped to S and
DDGauss-encoded in the SecAgg+ ring; every site's ledger holds the mechanism of every
training round (written before the update left), and the final model reaches every site."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from bench.instrumented import instrumented_argv
from common.bundle import read_bundle
from common.privacy import hospital
from common.privacy.ledger import read_ledger
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.processes import ManagedProcess, medfed_argv
from common.study import load_study
from site_agent.synthetic import generate_cohort, write_site_csvs
from tests.e2e.harness import REPO, list_members, make_pki
from tests.e2e.test_study_federation import STUDY
from tests.study.helpers import write_hospital_csv

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SITES = ["alpha", "beta", "gamma"]
# Two intermediaries per hospital: each trained and clipped alone.
HOSPITAL_STUDY = STUDY.replace('rounds = 1', 'rounds = 2').replace(
    'unit = "patient"', 'unit = "hospital"\nupdate_clip_norm = 0.5\nintermediaries = 2')


DEMO_SITES = ["north", "south", "east"]


def _hospital_demo(tmp_path: Path, *, seed: int, intermediaries: str,
                   kill_round: int = 0) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`medfed demo` in hospital mode on three generated CSV sites; must exit 0."""
    cohort = generate_cohort(DEMO_SITES, seed=seed, patients_per_site=300)
    write_site_csvs(tmp_path / "data", cohort)
    out = tmp_path / "run"
    result = subprocess.run(
        medfed_argv(
            "demo", "--data", str(tmp_path / "data"), "--label-column", "sepsis",
            "--patient-column", "patient_id", "--out", str(out), "--rounds", "2",
            "--kill-round", str(kill_round), "--delta", "1e-3", "--budget-epsilon", "8",
            "--privacy-unit", "hospital", "--update-clip-norm", "1.0",
            "--intermediaries", intermediaries, "--no-audit",
        ),
        cwd=REPO, capture_output=True, text=True, timeout=850, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, out


def _run_federation(tmp_path: Path, processes: list[ManagedProcess], study_text: str, *,
                    patients: int = 120) -> ManagedProcess:
    """A coordinator serving `study_text` and three `site run --once` to the end; the
    coordinator (lingering 20 s) is returned."""
    pki = make_pki(tmp_path, SITES)
    study_path = tmp_path / "study.toml"
    study_path.write_text(study_text)
    list_members(study_path, pki, SITES)
    for index, site in enumerate(SITES):
        write_hospital_csv(tmp_path / f"{site}.csv", patients, seed=index + 1)
    logs = tmp_path / "logs"
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    coordinator = ManagedProcess(
        "coordinator",
        instrumented_argv("coordinator", "serve", "--study", str(study_path), "--pki", str(pki),
                          "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                          "--state", str(tmp_path / "coordinator"), "--min-sites", "3",
                          "--selection-seconds", "1", "--debug-write-aggregates",
                          "--linger-seconds", "20"),
        log_dir=logs, env=env, cwd=REPO,
    )
    processes.append(coordinator)
    port = int(coordinator.wait_event("listening", timeout=120)["port"])
    agents = {}
    for name in SITES:
        agents[name] = ManagedProcess(
            name,
            instrumented_argv("site", "run", "--pki", str(pki), "--site", name,
                              "--coordinator", f"127.0.0.1:{port}", "--metrics-listen",
                              "127.0.0.1:0", "--state", str(tmp_path / "sites" / name),
                              "--data", str(tmp_path / f"{name}.csv"), "--debug-write-updates",
                              "--once"),
            log_dir=logs, env=env, cwd=REPO,
        )
        processes.append(agents[name])
    for name, proc in agents.items():
        assert proc.wait_exit(timeout=800) == 0, f"{name}:\n{proc.tail(30)}"
    return coordinator


def test_hospital_level_federation(tmp_path: Path, processes: list[ManagedProcess]) -> None:
    _run_federation(tmp_path, processes, HOSPITAL_STUDY)
    study = load_study(tmp_path / "study.toml")
    state = tmp_path / "coordinator"
    terms = hospital.study_terms(study)
    training_rounds: list[list[int]] = []
    for name in SITES:
        _, entries = read_ledger(tmp_path / "sites" / name / "privacy-ledger.db")
        trained = [e for e in entries if e.purpose == "training"]
        training_rounds.append([e.round for e in trained])
        assert len(trained) == 2
        for entry in trained:
            (mechanism,) = entry.mechanisms  # no DP-SGD underneath in hospital mode
            assert isinstance(mechanism, DistributedDiscreteGaussian)
            assert mechanism.contributors == 2  # round-size floor 3 minus 1 colluder
            assert mechanism.units == 2  # per-intermediary sensitivity, 2 per hospital
    assert training_rounds[0] == training_rounds[1] == training_rounds[2]

    # Each round's sum is exactly the sum of the sites' ring words, and decodes to a
    # finite update of norm at most 3 S plus the noise.
    for number in training_rounds[0]:
        aggregate = np.fromfile(state / "aggregates" / f"round-{number:06d}.u32", "<u4")
        expected = np.zeros_like(aggregate)
        for name in SITES:
            upload = tmp_path / "sites" / name / "debug-updates" / f"round-{number:06d}.u32"
            np.add(expected, np.fromfile(upload, "<u4"), out=expected)
        assert np.array_equal(aggregate, expected)

    final = (state / "model" / "final.safetensors").read_bytes()
    for name in SITES:
        assert (tmp_path / "sites" / name / "model" / "final.safetensors").read_bytes() == final
    bundle = read_bundle(state / "model" / "final.safetensors")
    assert bundle.card.unit == "hospital"
    assert any("hospital-level" in m for m in bundle.card.mechanisms)
    # Three figures on the card: per hospital (v-fold), per intermediary, per patient.
    assert {g.unit for g in bundle.card.group_guarantees} <= {
        "hospital", "intermediary", "patient"}
    whole = [g for g in bundle.card.group_guarantees if g.unit == "hospital"]
    assert len(whole) == len(SITES)
    assert all("model updates only" in g.note and "2 intermediaries" in g.note for g in whole)
    assert all("add/remove one intermediary" in g.note for g in bundle.card.group_guarantees
               if g.unit == "intermediary")
    assert all("2S" in g.note for g in bundle.card.group_guarantees if g.unit == "patient")
    assert terms.clip == 0.5
    # `medfed ledger show` names both guarantees plainly.
    shown = subprocess.run(
        medfed_argv("ledger", "show", "--ledger",
                    str(tmp_path / "sites" / "alpha" / "privacy-ledger.db"), "--json"),
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    summary = json.loads(shown.stdout.strip().splitlines()[-1])
    # The hospital is 2-fold: its guarantee is weaker than each intermediary's. A patient
    # changed inside an intermediary that stays in the round moves it by up to 2S: the
    # site's ledger is charged with that per-patient figure (every release), so the
    # budget bounds it.
    assert 0 < summary["intermediary_level_epsilon"] < summary["hospital_level_epsilon"]
    assert summary["charge"] == "record_level"
    assert summary["intermediary_level_epsilon"] < summary["spent_epsilon"]
    assert summary["spent_epsilon"] == pytest.approx(summary["per_patient_epsilon"], rel=1e-9)
    assert summary["spent_epsilon"] <= study.privacy.epsilon
    assert bundle.card.budget_charge == "record_level"
    site_card = {g.note.split(":")[0]: g.epsilon for g in whole}
    # The card is written when the round commits, from the replica the sites have sent
    # so far (their last round's entry arrives with their next poll): at most the ledger's.
    alpha_card = next(v for k, v in site_card.items() if k.startswith("site alpha"))
    assert 0 < alpha_card <= summary["hospital_level_epsilon"] + 1e-9
    assert json.loads((state / "statistics.json").read_text())["round"] < training_rounds[0][0]


def test_demo_hospital_level_row(tmp_path: Path) -> None:
    """`medfed demo --privacy-unit hospital --intermediaries 2`: the federation trains
    with hospital-level DP (two intermediaries per hospital), the table names the row,
    and the report gives each site's hospital-level epsilon (model updates only) next to
    its composed per-patient one.

    Asked to kill a site in round 1 of three, the demo kills nobody (SecAgg+ needs all
    three to unmask: t = 3 at T = 1), says so in one line, prints a line per round, and
    the study finishes with the final model at every site."""
    result, out = _hospital_demo(tmp_path, seed=3, intermediaries="2", kill_round=1)
    report = json.loads((out / "report.json").read_text())
    lines = result.stdout.splitlines()
    faults = [line for line in lines if line.startswith("[fault]")]
    assert len(faults) == 1 and faults[0].startswith("[fault] no dropout injected"), faults
    assert "t = 3" in faults[0]
    for number, kind in ((2, "training"), (3, "training"), (4, "final evaluation")):
        assert any(line.startswith(f"[round {number}] {kind}") for line in lines), lines
    sites = sorted(DEMO_SITES)
    assert report["sites"] == sites
    assert report["aborted_rounds"] == []
    assert all(r["dropped"] == [] and r["participants"] == sites for r in report["rounds"])
    assert report["evaluation_round"] == 4
    final = Path(report["model"]["path"]).read_bytes()
    assert report["model"]["kind"] == "final bundle"
    for site in sites:
        assert (out / "sites" / site / "model" / "final.safetensors").read_bytes() == final
    assert report["privacy_unit"] == "hospital"
    assert "Federated + hospital-level DP" in result.stdout
    assert "MODEL UPDATES ONLY" in result.stdout
    for site in DEMO_SITES:
        hospital_eps = report["hospital"]["epsilon"][site]
        unit_eps = report["hospital"]["intermediary_epsilon"][site]
        patient_eps = report["hospital"]["per_patient_epsilon"][site]
        # A patient's records changed inside an intermediary move it by up to 2S: the
        # budget is charged with that per-patient figure (every release), so it bounds
        # it; the hospital is 2-fold of the intermediary.
        assert 0 < unit_eps < report["final"]["epsilon"][site] <= 8.0
        assert unit_eps < hospital_eps
        assert report["final"]["epsilon"][site] == pytest.approx(patient_eps, rel=1e-9)
        _, entries = read_ledger(out / "sites" / site / "privacy-ledger.db")
        trained = [e for e in entries if e.purpose == "training"]
        assert len(trained) == 2
        assert all(isinstance(m, DistributedDiscreteGaussian) and m.units == 2
                   for e in trained for m in e.mechanisms)


# "auto" intermediaries. 300 patients per site: its DP count
# (std ~34 at the sites' default count epsilon) splits into the largest v (count // 10
# >= 8) with overwhelming probability, so every site trains the announced v.
AUTO_STUDY = STUDY.replace('rounds = 1', 'rounds = 2').replace(
    'unit = "patient"', 'unit = "hospital"\nupdate_clip_norm = 2.0\nintermediaries = "auto"')


def test_auto_intermediaries_federation(tmp_path: Path,
                                        processes: list[ManagedProcess]) -> None:
    """A real SecAgg+ hospital federation under intermediaries = "auto": round one trains
    one unit per hospital with the norm coordinate; the coordinator decodes the sum of
    unit norms, picks v by the authors' rule, logs it, exports it as a gauge and
    announces it in round two, where every site trains v units and records them."""
    coordinator = _run_federation(tmp_path, processes, AUTO_STUDY, patients=300)
    listening = next(e for e in coordinator.lines if e.get("event") == "listening")
    completed = {int(e["round_number"]): e for e in coordinator.lines
                 if e.get("event") == "round_completed" and e.get("kind") == "training"
                 and not e.get("evaluation_only")}
    chosen = {int(e["round_number"]): int(e["next_intermediaries"]) for e in coordinator.lines
              if e.get("event") == "intermediaries_chosen"}
    first, second = sorted(completed)
    assert completed[first]["intermediaries"] == 1  # the documented start
    # "auto" is opt-in and the coordinator says at start-up what it costs.
    assert any(e.get("event") == "hospital_intermediaries_warning"
               and "v-fold" in str(e.get("msg", "")) for e in coordinator.lines)
    v = chosen[first]
    assert 1 <= v <= hospital.MAX_AUTO_INTERMEDIARIES
    # Three hospitals at v = 1: the unit norm sum (at most 3 S) can never rise above its
    # 3-sigma noise margin (12 z S' >= 3.6 S'), so the coordinator says it measured
    # nothing and keeps v rather than act on noise.
    rejected = {int(e["round_number"]) for e in coordinator.lines
                if e.get("event") == "intermediaries_measurement_rejected"}
    assert first in rejected and v == 1
    assert completed[second]["intermediaries"] == v  # announced as chosen
    # Every site trained v units (the decoded weight sum): none was capped by its count.
    assert completed[second]["units"] == len(SITES) * v
    assert completed[first]["units"] == len(SITES)
    assert second in chosen  # measured again for a round that would follow
    with urllib.request.urlopen(
            f"http://127.0.0.1:{int(listening['metrics_port'])}/metrics", timeout=10) as resp:
        scraped = resp.read().decode()
    assert f"medfed_coordinator_hospital_intermediaries {float(chosen[second])}" in scraped
    for name in SITES:
        _, entries = read_ledger(tmp_path / "sites" / name / "privacy-ledger.db")
        trained = {e.round: e for e in entries if e.purpose == "training"}
        assert sorted(trained) == [first, second]
        units = {}
        for number, entry in trained.items():
            (mechanism,) = entry.mechanisms
            assert isinstance(mechanism, DistributedDiscreteGaussian)
            units[number] = mechanism.units
        assert units == {first: 1, second: v}
    shown = subprocess.run(
        medfed_argv("ledger", "show", "--ledger",
                    str(tmp_path / "sites" / "alpha" / "privacy-ledger.db"), "--json"),
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    summary = json.loads(shown.stdout.strip().splitlines()[-1])
    assert summary["hospital_level_epsilon"] > 0
    if v > 1:
        assert summary["intermediaries_by_round"] == {str(first): 1, str(second): v}
        assert summary["intermediaries_max"] == v
        assert 0 < summary["intermediary_level_epsilon"] < summary["hospital_level_epsilon"]


def test_demo_auto_intermediaries_row(tmp_path: Path) -> None:
    """`medfed demo --privacy-unit hospital --intermediaries auto` runs end to end: the
    row of the privacy/utility table and each round line name the v of every round."""
    result, out = _hospital_demo(tmp_path, seed=4, intermediaries="auto")
    report = json.loads((out / "report.json").read_text())
    chosen = report["hospital"]["intermediaries_by_round"]
    assert report["hospital"]["intermediaries"] == "auto"
    assert len(chosen) == 2 and next(iter(chosen.values())) == 1
    label = "v auto per round " + "/".join(str(v) for v in chosen.values())
    assert any(line.startswith("Federated + hospital-level DP (budget 8; hospital eps ")
               and "per-patient eps " in line and f") + SecAgg+, {label}" in line
               for line in result.stdout.splitlines())
    for number, v in chosen.items():
        assert f"[round {number}] training" in result.stdout
        assert any(line.startswith(f"[round {number}] ") and line.endswith(f"| v={v}")
                   for line in result.stdout.splitlines())
    for site in DEMO_SITES:
        _, entries = read_ledger(out / "sites" / site / "privacy-ledger.db")
        units = {e.round: m.units for e in entries if e.purpose == "training"
                 for m in e.mechanisms if isinstance(m, DistributedDiscreteGaussian)}
        assert {str(r): u for r, u in units.items()} == chosen
