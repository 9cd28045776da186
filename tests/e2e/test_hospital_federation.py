"""Hospital-level DP over real processes, from two `medfed demo --privacy-unit hospital`
runs (a coordinator and three site agents each, SecAgg+, the study served with
`coordinator serve --study`): with two intermediaries per hospital, each site's whole
update is clipped to S and DDGauss-encoded in the SecAgg+ ring, every site's ledger
holds the mechanism of every training round (written before the update left) and the
final model reaches every site; with "auto" intermediaries the coordinator picks v
each round. Each run is built once (a module-scoped fixture, one xdist group each) and
read by the tests of the federation and of the demo's report alike."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.instrumented import instrumented_argv
from common.commands.cli import build_parser
from common.core.processes import Line, ManagedProcess, medfed_argv
from common.privacy import hospital
from common.privacy.ledger import read_ledger
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.releases.bundle import read_bundle
from common.study import load_study
from common.study.hospital_terms import study_terms
from demo.cli import exit_status, tabular_options
from demo.options import DemoOptions
from demo.processes import FederationProcesses
from demo.rounds import RoundFollower
from demo.run import Demo
from site_agent.synthetic import generate_cohort, write_site_csvs
from tests.e2e.harness import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

DEMO_SITES = ["north", "south", "east"]
FIXED = pytest.mark.xdist_group("hospital_demo_fixed_v")
AUTO = pytest.mark.xdist_group("hospital_demo_auto_v")


class InstrumentedProcesses(FederationProcesses):
    """The demo's coordinator and sites run through `bench.instrumented`: the
    coordinator writes each round's unmasked ring sum, each site its ring vector before
    its masks."""

    def service_argv(self, *command: str) -> list[str]:
        flag = ("--debug-write-aggregates" if command[0] == "coordinator"
                else "--debug-write-updates")
        return instrumented_argv(*command, flag)


class ScrapingFollower(RoundFollower):
    """Follows the rounds, scraping the coordinator's metrics once the last training
    round completed (it still serves the final evaluation round then)."""

    scraped: str | None = None

    def record_round(self, line: Line, sites: list[str]) -> None:
        super().record_round(line, sites)
        trained = [row for row in self.rows if not row.evaluation_only]
        if self.scraped is None and len(trained) == self.o.rounds:
            coordinator = self.processes.coordinator
            assert coordinator is not None
            listening = next(e for e in coordinator.lines if e.get("event") == "listening")
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{int(listening['metrics_port'])}/metrics",
                    timeout=10) as resp:
                self.scraped = resp.read().decode()


class InstrumentedDemo(Demo):
    """`medfed demo` whose coordinator and sites run through `bench.instrumented` (with
    `debug_writes`: `InstrumentedProcesses`), scraping the coordinator's metrics after
    the last training round (`ScrapingFollower`)."""

    def __init__(self, options: DemoOptions, *, debug_writes: bool) -> None:
        super().__init__(options)
        if debug_writes:
            self.processes = InstrumentedProcesses(options)
        self.scraping = ScrapingFollower(self.processes, options, say=self.say)
        self.follower = self.scraping

    @property
    def coordinator(self) -> ManagedProcess | None:
        return self.processes.coordinator

    @property
    def scraped(self) -> str | None:
        return self.scraping.scraped


@dataclass
class DemoRun:
    stdout: str
    out: Path
    report: dict[str, Any]
    demo: InstrumentedDemo


def _hospital_demo(folder: Path, *, seed: int, intermediaries: str, clip: str,
                   kill_round: int = 0, debug_writes: bool = False) -> DemoRun:
    """`medfed demo` in hospital mode on three generated CSV sites (its command line
    parsed by the `medfed` parser, the demo run in this process, its stdout captured);
    must end with exit status 0."""
    cohort = generate_cohort(DEMO_SITES, seed=seed, patients_per_site=300)
    write_site_csvs(folder / "data", cohort)
    out = folder / "run"
    args = build_parser("demo").parse_args([
        "demo", "--data", str(folder / "data"), "--label-column", "sepsis",
        "--patient-column", "patient_id", "--out", str(out), "--rounds", "2",
        "--kill-round", str(kill_round), "--delta", "1e-3", "--budget-epsilon", "8",
        "--privacy-unit", "hospital", "--update-clip-norm", clip,
        "--intermediaries", intermediaries, "--no-audit",
    ])
    demo = InstrumentedDemo(tabular_options(args), debug_writes=debug_writes)
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            report = demo.run()
    except BaseException:
        print(stdout.getvalue()[-3000:])  # shown by pytest with the fixture's error
        raise
    assert exit_status(report) == 0, stdout.getvalue()[-3000:]
    return DemoRun(stdout.getvalue(), out, report, demo)


@pytest.fixture(scope="module")
def fixed_v(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """`medfed demo --privacy-unit hospital --intermediaries 2 --update-clip-norm 0.5
    --kill-round 1`, instrumented to write the sums and the sites' ring vectors."""
    return _hospital_demo(tmp_path_factory.mktemp("fixed_v"), seed=3, intermediaries="2",
                          clip="0.5", kill_round=1, debug_writes=True)


@pytest.fixture(scope="module")
def auto_v(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """`medfed demo --privacy-unit hospital --intermediaries auto`."""
    return _hospital_demo(tmp_path_factory.mktemp("auto_v"), seed=4,
                          intermediaries="auto", clip="1.0")


@FIXED
def test_hospital_level_federation(fixed_v: DemoRun) -> None:
    """Two intermediaries per hospital, each trained and clipped alone (S = 0.5)."""
    out = fixed_v.out
    study = load_study(out / "study.toml")
    state = out / "coordinator"
    terms = study_terms(study)
    training_rounds: list[list[int]] = []
    for name in DEMO_SITES:
        _, entries = read_ledger(out / "sites" / name / "privacy-ledger.db")
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
        for name in DEMO_SITES:
            upload = out / "sites" / name / "debug-updates" / f"round-{number:06d}.u32"
            np.add(expected, np.fromfile(upload, "<u4"), out=expected)
        assert np.array_equal(aggregate, expected)

    final = (state / "model" / "final.safetensors").read_bytes()
    for name in DEMO_SITES:
        assert (out / "sites" / name / "model" / "final.safetensors").read_bytes() == final
    bundle = read_bundle(state / "model" / "final.safetensors")
    assert bundle.card.unit == "hospital"
    assert any("hospital-level" in m for m in bundle.card.mechanisms)
    # Three figures on the card: per hospital (v-fold), per intermediary, per patient.
    assert {g.unit for g in bundle.card.group_guarantees} <= {
        "hospital", "intermediary", "patient"}
    whole = [g for g in bundle.card.group_guarantees if g.unit == "hospital"]
    assert len(whole) == len(DEMO_SITES)
    assert all("model updates only" in g.note and "2 intermediaries" in g.note for g in whole)
    assert all("add/remove one intermediary" in g.note for g in bundle.card.group_guarantees
               if g.unit == "intermediary")
    assert all("2S" in g.note for g in bundle.card.group_guarantees if g.unit == "patient")
    assert terms.clip == 0.5
    # `medfed ledger show` names both guarantees plainly.
    shown = subprocess.run(
        medfed_argv("ledger", "show", "--ledger",
                    str(out / "sites" / DEMO_SITES[0] / "privacy-ledger.db"), "--json"),
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
    first_card = next(v for k, v in site_card.items() if k.startswith(f"site {DEMO_SITES[0]}"))
    assert 0 < first_card <= summary["hospital_level_epsilon"] + 1e-9
    assert json.loads((state / "statistics.json").read_text())["round"] < training_rounds[0][0]


@FIXED
def test_demo_hospital_level_row(fixed_v: DemoRun) -> None:
    """`medfed demo --privacy-unit hospital --intermediaries 2`: the federation trains
    with hospital-level DP (two intermediaries per hospital), the table names the row,
    and the report gives each site's hospital-level epsilon (model updates only) next to
    its composed per-patient one.

    Asked to kill a site in round 1 of three, the demo kills nobody (SecAgg+ needs all
    three to unmask: t = 3 at T = 1), says so in one line, prints a line per round, and
    the study finishes with the final model at every site."""
    out = fixed_v.out
    report = json.loads((out / "report.json").read_text())
    lines = fixed_v.stdout.splitlines()
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
    assert "Federated + hospital-level DP" in fixed_v.stdout
    assert "MODEL UPDATES ONLY" in fixed_v.stdout
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


@AUTO
def test_auto_intermediaries_federation(auto_v: DemoRun) -> None:
    """A real SecAgg+ hospital federation under intermediaries = "auto" (300 patients a
    site): round one trains one unit per hospital with the norm coordinate; the
    coordinator decodes the sum of unit norms, picks v by the authors' rule, logs it,
    exports it as a gauge and announces it in round two, where every site trains v
    units and records them."""
    coordinator = auto_v.demo.coordinator
    assert coordinator is not None
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
    assert completed[second]["units"] == len(DEMO_SITES) * v
    assert completed[first]["units"] == len(DEMO_SITES)
    assert second in chosen  # measured again for a round that would follow
    # Scraped once the second training round completed (ScrapingFollower.record_round).
    scraped = auto_v.demo.scraped
    assert scraped is not None
    assert f"medfed_coordinator_hospital_intermediaries {float(chosen[second])}" in scraped
    for name in DEMO_SITES:
        _, entries = read_ledger(auto_v.out / "sites" / name / "privacy-ledger.db")
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
                    str(auto_v.out / "sites" / DEMO_SITES[0] / "privacy-ledger.db"), "--json"),
        capture_output=True, text=True, check=True, cwd=REPO,
    )
    summary = json.loads(shown.stdout.strip().splitlines()[-1])
    assert summary["hospital_level_epsilon"] > 0
    if v > 1:
        assert summary["intermediaries_by_round"] == {str(first): 1, str(second): v}
        assert summary["intermediaries_max"] == v
        assert 0 < summary["intermediary_level_epsilon"] < summary["hospital_level_epsilon"]


@AUTO
def test_demo_auto_intermediaries_row(auto_v: DemoRun) -> None:
    """`medfed demo --privacy-unit hospital --intermediaries auto` runs end to end: the
    row of the privacy/utility table and each round line name the v of every round."""
    out = auto_v.out
    report = json.loads((out / "report.json").read_text())
    chosen = report["hospital"]["intermediaries_by_round"]
    assert report["hospital"]["intermediaries"] == "auto"
    assert len(chosen) == 2 and next(iter(chosen.values())) == 1
    label = "v auto per round " + "/".join(str(v) for v in chosen.values())
    assert any(line.startswith("Federated + hospital-level DP (budget 8; hospital eps ")
               and "per-patient eps " in line and f") + SecAgg+, {label}" in line
               for line in auto_v.stdout.splitlines())
    for number, v in chosen.items():
        assert f"[round {number}] training" in auto_v.stdout
        assert any(line.startswith(f"[round {number}] ") and line.endswith(f"| v={v}")
                   for line in auto_v.stdout.splitlines())
    for site in DEMO_SITES:
        _, entries = read_ledger(out / "sites" / site / "privacy-ledger.db")
        units = {e.round: m.units for e in entries if e.purpose == "training"
                 for m in e.mechanisms if isinstance(m, DistributedDiscreteGaussian)}
        assert {str(r): u for r, u in units.items()} == chosen
