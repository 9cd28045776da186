"""`medfed demo`: the whole product on one machine, in a few minutes.

A PKI, one coordinator and five site agents as separate processes over mutual TLS on
127.0.0.1, each site with its own non-IID slice of the embedded synthetic sepsis cohort
(or one CSV per site from ``--data``), its own privacy ledger and an epsilon budget.
Several rounds of DP-SGD with SecAgg+; where the federation can survive a dropout (see
`dropout_decision`), one site is killed mid-round (its masks are recovered) and
restarted with its ledger. Then the privacy/utility table of seed 002:
centralized non-private vs federated non-private vs federated with DP and secure
aggregation, each site's epsilon against its budget (training and evaluation apart),
and the membership-inference audit line (coordinator/demo_audit.py; `--no-audit`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.config import DEFAULT_COUNT_EPSILON, AggregationSection, SitePolicySection
from common.errors import ConfigError, StateError
from common.processes import Line, ManagedProcess, medfed_argv
from common.secagg.params import round_floor

HISTOGRAM_BINS = 50
COUNT_EPSILON = DEFAULT_COUNT_EPSILON  # the sites' default count_epsilon
AGGREGATION_CLIP = 0.5
WAIT_NOTE_SECONDS = 30.0
"""With no round event for this long, the demo prints what it is waiting for."""


@dataclass
class DemoOptions:
    out: Path = Path("demo-run")
    sites: int = 5
    rounds: int = 4
    patients_per_site: int = 100_000
    seed: int = 7
    budget_epsilon: float = 8.0
    delta: float = 1e-5
    kill_round: int = 2
    data: Path | None = None
    label_column: str = "sepsis"
    patient_column: str | None = "patient_id"
    local_epochs: int = 1
    learning_rate: float = 0.5
    batch_size: int = 2048
    phase_seconds: float = 30.0
    quiet: bool = False
    # "hospital": hospital-level DP on the model updates (issue 13), no DP-SGD beneath.
    privacy_unit: str = "auto"
    update_clip_norm: float = 1.0
    # v per hospital, or "auto" (the adaptive rule, issue 13 s.2); needs --data: a study
    # carries it.
    intermediaries: int | str = 1
    audit: bool = True


@dataclass
class RoundRow:
    round: int
    participants: list[str]
    dropped: list[str]
    secure_aggregation: bool
    auc: float | None
    evaluation_only: bool
    epsilon: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    intermediaries: int | None = None  # v of a hospital-level round (issue 13 s.2)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run a whole federation on this machine and print the privacy/utility table",
    )
    d = DemoOptions()
    parser.add_argument("--out", type=Path, default=d.out, help="output folder (demo-run)")
    parser.add_argument("--data", type=Path, help="folder with one CSV per site (stem = site)")
    parser.add_argument("--label-column", default=d.label_column)
    parser.add_argument("--patient-column", default=None,
                        help="patient id column (patient-level DP); default for the "
                        "synthetic cohort: patient_id")
    parser.add_argument("--sites", type=int, default=d.sites)
    parser.add_argument("--rounds", type=int, default=d.rounds)
    parser.add_argument("--patients-per-site", type=int, default=d.patients_per_site)
    parser.add_argument("--budget-epsilon", type=float, default=d.budget_epsilon)
    parser.add_argument("--delta", type=float, default=d.delta)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--kill-round", type=int, default=d.kill_round,
                        help="round in which one site is killed (0: none)")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--privacy-unit", choices=["auto", "hospital"], default="auto",
                        help="hospital: each site's whole update clipped to "
                        "--update-clip-norm and noised in the SecAgg ring (DDGauss)")
    parser.add_argument("--update-clip-norm", type=float, default=d.update_clip_norm)
    parser.add_argument("--intermediaries", type=_intermediaries, default=d.intermediaries,
                        help="hospital-level DP: v disjoint patient groups per hospital, "
                        "each clipped alone, or 'auto': v chosen every round by the rule "
                        "of Jiang et al. 2023 (needs --data). Default 1: the budget caps "
                        "the hospital-level epsilon; v > 1 or auto make it v-fold")
    parser.add_argument("--no-audit", dest="audit", action="store_false",
                        help="skip the membership-inference audit (about 30 s on 2 cores)")
    imaging = parser.add_argument_group("imaging (--task imaging)")
    imaging.add_argument("--task", choices=["tabular", "imaging"], default="tabular",
                         help="tabular: the sepsis cohort (default); imaging: five hospitals' "
                         "synthetic image folders (PNG and DICOM) with an images study")
    imaging.add_argument("--model", default="cnn",
                         help="images study model: cnn, resnet18-gn or densenet121-gn")
    imaging.add_argument("--image-size", type=int, default=28)
    imaging.add_argument("--device", default="auto",
                         help="auto (cuda when present), cpu, cuda or cuda:N")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.task == "imaging":
        return _main_imaging(args)
    patient_column = args.patient_column
    if args.data is None and patient_column is None:
        patient_column = "patient_id"
    options = DemoOptions(
        out=args.out,
        sites=args.sites,
        rounds=args.rounds,
        patients_per_site=args.patients_per_site,
        seed=args.seed,
        budget_epsilon=args.budget_epsilon,
        delta=args.delta,
        kill_round=args.kill_round,
        data=args.data,
        label_column=args.label_column,
        patient_column=patient_column,
        quiet=args.quiet,
        privacy_unit=args.privacy_unit,
        update_clip_norm=args.update_clip_norm,
        intermediaries=args.intermediaries,
        audit=args.audit,
    )
    validate_options(options)
    report = Demo(options).run()
    return 0 if report["final"].get("auc") is not None else 1


def _main_imaging(args: argparse.Namespace) -> int:
    """`--task imaging` (coordinator.demo_imaging): flags left at the tabular defaults
    take the imaging defaults instead."""
    from coordinator.demo_imaging import IMAGING_DEFAULTS, ImagingDemo

    if args.data is not None:
        raise ConfigError("--data", "--task imaging runs on the synthetic imaging cohort")
    defaults = DemoOptions()
    chosen = {
        name: value if getattr(args, name, getattr(defaults, name)) == getattr(defaults, name)
        else getattr(args, name)
        for name, value in IMAGING_DEFAULTS.items()
    }
    options = DemoOptions(
        out=args.out, sites=args.sites, seed=args.seed, budget_epsilon=args.budget_epsilon,
        kill_round=args.kill_round, label_column="label", patient_column="patient_id",
        quiet=args.quiet, **chosen,
    )
    validate_options(options)
    demo = ImagingDemo(options, model=args.model, image_size=args.image_size,
                       device=args.device)
    report = demo.run()
    return 0 if report["final"].get("auc") is not None else 1


def _intermediaries(text: str) -> int | str:
    """--intermediaries: a positive integer or "auto"."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def validate_options(o: DemoOptions) -> None:
    if not 3 <= o.sites <= 20:
        raise ConfigError("--sites", "the demo runs 3 to 20 sites")
    if o.rounds < 1:
        raise ConfigError("--rounds", "must be >= 1")
    if o.kill_round < 0 or o.kill_round > o.rounds:
        raise ConfigError("--kill-round", f"must be between 0 and --rounds ({o.rounds})")
    if o.intermediaries != 1 and (o.privacy_unit != "hospital" or o.data is None):
        raise ConfigError("--intermediaries", "needs --privacy-unit hospital and --data")
    if o.data is not None and not o.data.is_dir():
        raise ConfigError("--data", f"{o.data} is not a folder")


@dataclass(frozen=True)
class FederationTerms:
    """The SecAgg+ terms the demo gives its coordinator ([aggregation]) and its sites
    ([policy]), and the line saying why when they differ from the product's defaults."""

    aggregation: AggregationSection
    policy: SitePolicySection
    note: str | None = None


def federation_terms(n_sites: int, *, histogram_bins: int) -> FederationTerms:
    """The product's defaults (T = 1 colluding site, rounds of at least 3 sites) from 3
    sites on. Two sites cannot meet them: a sum of two hands each site the other's
    (DP-noised) update by subtraction, so the demo runs them with T = 0 and a round floor
    of 2 and says so."""
    if n_sites < 2:
        raise ConfigError("--data", f"a federation needs at least 2 site CSVs, found {n_sites}")
    if n_sites >= 3:
        return FederationTerms(
            AggregationSection(clip=AGGREGATION_CLIP, histogram_bins=histogram_bins),
            SitePolicySection(),
        )
    return FederationTerms(
        AggregationSection(clip=AGGREGATION_CLIP, histogram_bins=histogram_bins,
                           max_colluding_sites=0),
        SitePolicySection(min_round_sites=2, max_colluding_sites=0),
        note=("2 sites: the secure sum of two hands each site the other's DP-noised "
              "update (its own subtracted), so the demo assumes no colluding site "
              "(max_colluding_sites = 0) and lets rounds of 2 sites run "
              "(policy.min_round_sites = 2); a real federation should have at least 3"),
    )


@dataclass(frozen=True)
class DropoutDecision:
    """Whether the demo kills one site mid-round, and the line that says why."""

    inject: bool
    threshold: int
    floor: int
    line: str


def dropout_decision(n_sites: int, *, aggregation: AggregationSection,
                     policy: SitePolicySection) -> DropoutDecision:
    """Inject a dropout only where a round of `n_sites` survives losing one site: with
    SecAgg+ the n - 1 survivors must still hold t Shamir shares to unmask (t from
    `coordinator.selection.round_parameters`, the coordinator's own choice for these
    terms), and no survivor may refuse a sum of n - 1 sites (its round floor,
    max(min_round_sites, max_colluding_sites + 2)). The killed site is restarted before
    the next round's selection, so the coordinator's min_sites (every site) still holds
    then."""
    from coordinator.selection import round_parameters

    threshold, _neighbours = round_parameters(n_sites, aggregation)
    floor = round_floor(min_round_sites=policy.min_round_sites,
                        max_colluding_sites=max(policy.max_colluding_sites,
                                                aggregation.max_colluding_sites))
    survivors = n_sites - 1
    if aggregation.secure_aggregation and survivors < threshold:
        return DropoutDecision(
            False, threshold, floor,
            f"[fault] no dropout injected: with {n_sites} sites SecAgg+ needs t = "
            f"{threshold} of them to unmask (max_colluding_sites = "
            f"{aggregation.max_colluding_sites}), so a killed site would abort the round; "
            "every site stays up",
        )
    if survivors < floor:
        return DropoutDecision(
            False, threshold, floor,
            f"[fault] no dropout injected: the sites refuse sums of fewer than {floor} "
            f"sites, and {survivors} would be left",
        )
    return DropoutDecision(
        True, threshold, floor,
        f"[fault] one site will be killed mid-round: the {survivors} survivors still hold "
        f"t = {threshold} shares to unmask it, then it is restarted with its ledger",
    )


class Demo:
    histogram_bins = HISTOGRAM_BINS
    """Score bins of the federation's DP evaluation histogram (a subclass may change it)."""

    def __init__(self, options: DemoOptions) -> None:
        self.o = options
        self.out = options.out
        self.procs: dict[str, ManagedProcess] = {}
        self.rows: list[RoundRow] = []
        self.aborted: list[dict[str, Any]] = []
        self.killed: set[ManagedProcess] = set()  # sites this demo killed on purpose
        self.audit: dict[str, Any] = {"skipped": True, "reason": "not run"}
        self.started = time.monotonic()
        self._print_lock = threading.Lock()
        # `--data DIR`: the study the coordinator serves (`coordinator serve --study`).
        self.served_study: Path | None = None
        self.statistics_round: int | None = None
        # SecAgg+ terms for the coordinator and the sites (set by `run` for its sites).
        self.terms = federation_terms(max(options.sites, 3), histogram_bins=self.histogram_bins)

    def say(self, text: str) -> None:
        if not self.o.quiet:
            with self._print_lock:
                print(text, flush=True)

    # ------------------------------------------------------------------ setup
    def prepare(self) -> dict[str, Path | None]:
        """Site ids and their data files (None: the site's slice of the embedded cohort)."""
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        if self.o.data is not None:
            files: dict[str, Path | None] = {
                p.stem: p.resolve() for p in sorted(self.o.data.glob("*.csv"))
            }
            if len(files) < 2:
                raise ConfigError("--data", f"need at least 2 site CSVs (one per site) in "
                                            f"{self.o.data}, found {len(files)}")
            self.draft_study({site: path for site, path in files.items() if path})
            return files
        from site_agent.synthetic import site_names

        names = site_names(self.o.sites)
        self.say(f"[setup] synthetic sepsis cohort: {len(names)} hospitals x "
                 f"{self.o.patients_per_site:,} patients, several encounters each, "
                 f"non-IID ({', '.join(names)}); each site generates only its own slice")
        return dict.fromkeys(names)

    def draft_study(self, files: dict[str, Path]) -> None:
        """`--data DIR`: the study every site is enrolled into (coordinator.demo_study)."""
        from common.study_cli import render_study_toml
        from coordinator.demo_study import draft_demo_study

        study, notes = draft_demo_study(
            files, name="medfed-demo", label_column=self.o.label_column,
            patient_column=self.o.patient_column, rounds=self.o.rounds,
            epsilon=self.o.budget_epsilon, delta=self.o.delta, histogram_bins=HISTOGRAM_BINS,
        )
        if self.o.privacy_unit == "hospital":
            study = hospital_study(study, self.o)
        self.served_study = self.out / "study.toml"
        self.served_study.write_text(render_study_toml(study), encoding="utf-8")
        self.study = study
        self.say(f"[setup] study {self.served_study}: {len(study.features)} features, "
                 f"label {self.o.label_column!r}, {study.privacy.unit}-level DP; served with "
                 "`coordinator serve --study`, sites enrolled into it")
        for note in notes:
            self.say(f"[setup]   {note} (read from the demo's files; a real study declares it)")

    def load_datasets(self, files: dict[str, Path | None]) -> tuple[dict[str, Any], list[str]]:
        """The same records the sites train on, for the in-process baselines."""
        from site_agent.synthetic import FEATURES, generate_cohort

        sites = sorted(files)
        if self.o.data is None:
            cohort = generate_cohort(sites, seed=self.o.seed,
                                     patients_per_site=self.o.patients_per_site)
            return cohort, list(FEATURES)
        from coordinator.demo_study import exact_statistics
        from site_agent.data import Preprocessor, load_study_table

        tables = {s: load_study_table(p, self.study) for s, p in files.items() if p}
        preprocess = Preprocessor(self.study, exact_statistics(tables, self.study,
                                                               seed=self.o.seed))
        datasets = {s: preprocess.site_data(t) for s, t in tables.items()}
        return datasets, preprocess.feature_names()

    def baselines(self, datasets: dict[str, Any]) -> dict[str, dict[str, float]]:
        return compute_baselines(datasets, self.o)

    def make_pki(self, sites: list[str]) -> Path:
        from common.pki import init_ca, issue_coordinator, issue_site

        pki = self.out / "pki"
        init_ca(pki)
        issue_coordinator(pki, ["127.0.0.1", "localhost"])
        for site in sites:
            issue_site(pki, site)
        self.say(f"[setup] PKI: federation CA, coordinator and {len(sites)} site certificates "
                 f"in {pki}")
        return pki

    def initial_model(self, n_features: int) -> Path:
        import torch

        from common.modelfile import ModelFile, write_model_file
        from common.models.layout import flatten_parameters, model_layout
        from common.models.tables.mlp import TabularMLP

        torch.manual_seed(self.o.seed)
        model = TabularMLP(n_features)
        path = self.out / "initial-model.mfm"
        write_model_file(path, ModelFile(model_layout(model), flatten_parameters(model)))
        return path

    # -------------------------------------------------------------- federation
    def start_coordinator(self, pki: Path, model: Path | None, n_sites: int) -> ManagedProcess:
        # Every round waits for all sites (the killed one is restarted right after its
        # round), so each hospital's epsilon tells the same story.
        config = self.out / "coordinator.toml"
        study_args: tuple[str, ...] = ()
        if self.served_study is not None or model is None:
            # The study gives the model (built by the coordinator) and training settings.
            if self.served_study is None:
                raise StateError("the demo has neither an initial model nor a study")
            model_and_training = ""
            study_args = ("--study", str(self.served_study))
        else:
            model_and_training = f"""[model]
init_file = "{model.resolve()}"

[training]
local_epochs = {self.o.local_epochs}
learning_rate = {self.o.learning_rate}
final_evaluation = true
"""
        config.write_text(
            f"""rounds = {self.o.rounds}
min_sites = {n_sites}
federation_id = "medfed-demo"

{model_and_training}
[aggregation]
histogram_bins = {self.terms.aggregation.histogram_bins}
clip = {self.terms.aggregation.clip}
max_colluding_sites = {self.terms.aggregation.max_colluding_sites}
{hospital_aggregation(self.o)}
[deadlines]
selection_seconds = 5
round_start_timeout_seconds = 600
train_seconds = 600
phase_seconds = {self.o.phase_seconds}
"""
        )
        proc = ManagedProcess(
            "coordinator",
            medfed_argv("coordinator", "serve", "--config", str(config), "--pki", str(pki),
                        "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                        "--state", str(self.out / "coordinator"), "--exit-when-finished",
                        "--linger-seconds", "5", *study_args),
            log_dir=self.out / "logs",
        )
        try:
            event = proc.wait_event("listening", timeout=300)
        except RuntimeError:
            state = ("exited with code " + str(proc.proc.returncode) if not proc.alive
                     else "did not start listening within 300 s")
            proc.stop()
            raise StateError(f"the coordinator {state}: {last_error(proc)} "
                             f"(log: {self.out / 'logs' / 'coordinator.log'})") from None
        self.port = int(event["port"])
        self.say(f"[setup] coordinator listening on 127.0.0.1:{self.port} (mTLS only)")
        return proc

    def start_site(self, site: str, pki: Path, data: Path | None, *extra: str) -> ManagedProcess:
        config = self.out / "sites" / f"{site}.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        if self.served_study is not None:
            # The study (label, patient column, features) comes at enrolment.
            source = f'path = "{data}"\nsplit_seed = {self.o.seed}\n'
        elif data is None:
            source = (f"synthetic = true\nsynthetic_cohort_seed = {self.o.seed}\n"
                      f"split_seed = {self.o.seed}\n"
                      f"synthetic_patients = {self.o.patients_per_site}\n")
        else:
            patient = (f'patient_column = "{self.o.patient_column}"\n'
                       if self.o.patient_column else "")
            source = (f'path = "{data}"\nlabel_column = "{self.o.label_column}"\n'
                      f"split_seed = {self.o.seed}\n{patient}")
        config.write_text(
            f"""[data]
{source}
[privacy]
budget_epsilon = {self.o.budget_epsilon}
delta = {self.o.delta}
{'privacy_unit = "hospital"' if self.o.privacy_unit == "hospital" else ""}

[policy]
min_round_sites = {self.terms.policy.min_round_sites}
max_colluding_sites = {self.terms.policy.max_colluding_sites}
# Without a study (the synthetic cohort) a site plans its noise for its own
# planned_rounds: the demo's rounds, so the budget is spent by the demo's end.
planned_rounds = {self.o.rounds}

[training]
batch_size = {self.o.batch_size}
max_physical_batch_size = 4096
device = "cpu"
"""
        )
        proc = ManagedProcess(
            site,
            medfed_argv("site", "run", "--config", str(config), "--pki", str(pki),
                        "--site", site, "--coordinator", f"127.0.0.1:{self.port}",
                        "--metrics-listen", "127.0.0.1:0",
                        "--state", str(self.out / "sites" / site), *extra),
            log_dir=self.out / "logs",
            env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        )
        self.procs[site] = proc
        return proc

    def privacy_audit(self, datasets: dict[str, Any]) -> dict[str, Any]:
        """Membership-inference audit on one site's records (coordinator/demo_audit.py)."""
        from coordinator.demo_audit import demo_audit, skipped
        from site_agent.data import SiteData

        if not self.o.audit:
            return skipped("--no-audit")
        if not all(isinstance(d, SiteData) for d in datasets.values()):
            return skipped("the audit runs on tables; image data is not audited yet")
        self.say("[audit] membership inference on one site's records, without DP and with "
                 f"DP at epsilon {self.o.budget_epsilon:g} ...")
        model = None
        if self.served_study is not None:  # `--data`: the study's encoding and model
            from site_agent.audit import study_audit_model

            model = study_audit_model(self.study)
        result = demo_audit(datasets, epsilon=self.o.budget_epsilon, delta=self.o.delta,
                            seed=self.o.seed, model=model)
        self.say(f"[audit] {result.get('line') or 'skipped: ' + str(result.get('reason'))}")
        return result

    def epsilon_by_purpose(self, sites: list[str]) -> dict[str, dict[str, float]]:
        """Each site's epsilon per ledger purpose (training, evaluation, statistics,
        count), each purpose's entries composed ALONE: they do not add up to the total."""
        from common.privacy.accountant import account
        from common.privacy.ledger import read_ledger

        out: dict[str, dict[str, float]] = {}
        for site in sites:
            path = self.out / "sites" / site / "privacy-ledger.db"
            if not path.exists():
                out[site] = {}
                continue
            header, entries = read_ledger(path)
            grouped: dict[str, list[Any]] = {}
            for entry in entries:
                mechanisms = getattr(entry, "mechanisms", entry.segments)
                grouped.setdefault(getattr(entry, "purpose", "training"), []).extend(mechanisms)
            out[site] = {
                purpose: account(ms, delta=header.delta, accountant=header.accountant).epsilon
                for purpose, ms in sorted(grouped.items())
            }
        return out

    def epsilon_by_site(self, sites: list[str]) -> dict[str, float]:
        from common.privacy.ledger import read_ledger

        spent = {}
        for site in sites:
            path = self.out / "sites" / site / "privacy-ledger.db"
            if not path.exists():
                spent[site] = 0.0
                continue
            _, entries = read_ledger(path)
            spent[site] = entries[-1].epsilon_after if entries else 0.0
        return spent

    def run(self) -> dict[str, Any]:
        files = self.prepare()
        sites = sorted(files)
        pki = self.make_pki(sites)
        datasets, features = self.load_datasets(files)
        model = None if self.served_study is not None else self.initial_model(len(features))
        self.say("[baseline] training centralized and federated non-private baselines ...")
        baselines = self.baselines(datasets)
        for name, m in baselines.items():
            self.say(f"[baseline] {name:<18} AUC {m['auc']:.3f}")
        self.audit = self.privacy_audit(datasets)
        self.terms = federation_terms(len(sites), histogram_bins=self.histogram_bins)
        if self.terms.note:
            self.say(f"[setup] {self.terms.note}")
        victim = self.plan_fault(sites)
        coordinator = self.start_coordinator(pki, model, len(sites))
        try:
            for site in sites:
                extra: tuple[str, ...] = ()
                if site == victim:
                    extra = ("--debug-pause-after", f"{self.kill_round_number()}:masked_input")
                self.start_site(site, pki, files[site], *extra)
            self.say(f"[federation] {len(sites)} site agents started; budget "
                     f"epsilon={self.o.budget_epsilon:g} at delta={self.o.delta:g} each")
            self.say("[federation] AUC = the global model entering each round, measured on every "
                     "site's held-out split through securely summed score histograms")
            self.follow_rounds(coordinator, sites, victim, pki, files)
        finally:
            for proc in self.procs.values():
                proc.stop()
            coordinator.stop()
        return self.write_report(sites, baselines)

    def kill_round_number(self) -> int:
        """The coordinator's number of the `--kill-round`th training round (with a
        study, round 1 is the federated DP statistics round)."""
        return self.o.kill_round + (1 if self.served_study is not None else 0)

    def plan_fault(self, sites: list[str]) -> str | None:
        """The site to kill mid-round, or None where the federation could not survive
        losing one (`dropout_decision`, said in one line) or `--kill-round 0`."""
        if not self.o.kill_round:
            return None
        decision = dropout_decision(len(sites), aggregation=self.terms.aggregation,
                                    policy=self.terms.policy)
        self.say(decision.line)
        return sites[-1] if decision.inject else None

    def follow_rounds(self, coordinator: ManagedProcess, sites: list[str], victim: str | None,
                      pki: Path, files: dict[str, Path | None]) -> None:
        total = self.o.rounds + 1  # training rounds + the final evaluation round
        done = 0
        restarted = False
        seen = 0
        while done < total:
            line, seen = self._next_round_event(coordinator, seen, sites)
            if (victim is not None and not restarted
                    and any(proc.name == victim for proc in self.killed)):
                # After the round it was killed in (completed or aborted), before the
                # next round's selection, which waits for every site.
                self.start_site(victim, pki, files[victim])
                restarted = True
                self.say(f"[fault] {victim} restarted with its ledger: it rejoins next round")
            if line.get("event") == "round_aborted":
                self.aborted.append({"round": int(line.get("round_number", 0)),
                                     "reason": str(line.get("reason", ""))})
                self.say(f"[round {line.get('round_number')}] aborted: {line.get('reason')}")
                continue
            if line.get("kind") == "statistics":
                self.statistics_round = int(line.get("round_number", 0))
                self.say(f"[round {self.statistics_round}] federated DP statistics: "
                         f"{len(str(line.get('survivors', '')).split(','))} sites released "
                         "noised sums and counts; every site standardises and imputes with "
                         "the same global values")
                continue
            done += 1
            self.record_round(line, sites)

    def _next_round_event(self, coordinator: ManagedProcess, seen: int,
                          sites: list[str]) -> tuple[Line, int]:
        """Wait for the coordinator's next round event; meanwhile kill a paused victim,
        and every WAIT_NOTE_SECONDS without one say what the federation waits for."""
        waiting_since = last_note = time.monotonic()
        while True:
            lines = coordinator.lines
            for index in range(seen, len(lines)):
                if lines[index].get("event") in ("round_completed", "round_aborted"):
                    return lines[index], index + 1
            if not coordinator.alive:
                try:  # its last lines may still be in the pipe
                    return self._last_round_event(coordinator, seen)
                except RuntimeError:
                    raise StateError(self.coordinator_failure(coordinator, sites)) from None
            self.check_sites()
            for site, proc in self.procs.items():
                if proc.alive and any(x.get("event") == "paused" for x in list(proc.lines)):
                    self.killed.add(proc)
                    proc.kill9()
                    self.say(f"[fault] kill -9 {site} mid-round, after it sent its masked "
                             "update: the survivors' Shamir shares will remove its masks")
            now = time.monotonic()
            if now - last_note >= WAIT_NOTE_SECONDS:
                last_note = now
                self.say(f"[wait] {now - waiting_since:.0f} s: "
                         + waiting_for(list(lines), self.site_states(sites)))
            try:
                coordinator.wait_for(
                    lambda e: e.get("event") in ("round_completed", "round_aborted"),
                    timeout=1.0, what="a round event", start=seen,
                )
            except RuntimeError:
                continue

    @staticmethod
    def _last_round_event(coordinator: ManagedProcess, seen: int) -> tuple[Line, int]:
        """A round event an exited coordinator printed from line `seen` on (read to the
        end of its output); RuntimeError when there is none."""
        event = coordinator.wait_for(
            lambda e: e.get("event") in ("round_completed", "round_aborted"),
            timeout=30.0, what="a round event", start=seen,
        )
        return event, next(i for i in range(seen, len(coordinator.lines))
                           if coordinator.lines[i] is event) + 1

    def site_log(self, site: str) -> Path:
        return self.out / "logs" / f"{site}.log"

    def site_states(self, sites: list[str]) -> dict[str, str]:
        """Each site agent in a few words: running, killed by the demo, or exited with
        its code, its last error and its log."""
        states = {}
        for site in sites:
            proc = self.procs.get(site)
            if proc is None:
                states[site] = "not started"
            elif proc.alive:
                states[site] = "running"
            elif proc in self.killed:
                states[site] = "killed by the demo (not restarted yet)"
            else:
                states[site] = (f"exited with code {proc.proc.returncode}: {last_error(proc)} "
                                f"(log: {self.site_log(site)})")
        return states

    def coordinator_failure(self, coordinator: ManagedProcess, sites: list[str]) -> str:
        """What failed when the coordinator exits mid-demo: its own error, then every
        site that was not running, each with its log (a bare "fewer than min_sites"
        names no site)."""
        states = self.site_states(sites)
        down = {site: state for site, state in states.items() if state != "running"}
        text = (f"the coordinator exited with code {coordinator.proc.returncode}: "
                f"{last_error(coordinator)} (log: {self.out / 'logs' / 'coordinator.log'})")
        if down:
            text += "; sites not running: " + "; ".join(
                f"{site} {state}" for site, state in down.items())
        else:
            text += "; every site agent was still running (site logs: " \
                    f"{self.out / 'logs'})"
        return text

    def check_sites(self) -> None:
        """Fail fast with the site's own message when a site agent died (bad data,
        refused certificate...) instead of waiting out the round-start timeout."""
        for site, proc in self.procs.items():
            if proc in self.killed or proc.alive:
                continue
            code = proc.proc.returncode
            if code not in (0, None):
                raise StateError(f"site {site} exited with code {code}: {last_error(proc)} "
                                 f"(log: {self.out / 'logs' / (site + '.log')})")

    def record_round(self, line: Line, sites: list[str]) -> None:
        participants = [s for s in str(line.get("participants", "")).split(",") if s]
        dropped = sorted(
            s for key in ("dropped", "dropped_after_input")
            for s in str(line.get(key, "")).split(",") if s
        )
        eps = self.epsilon_by_site(sites)
        auc = line.get("auc")
        row = RoundRow(
            round=int(line["round_number"]),
            participants=participants,
            dropped=dropped,
            secure_aggregation=bool(line.get("secure", True)),
            auc=float(auc) if auc is not None else None,
            evaluation_only=bool(line.get("evaluation_only", False)),
            epsilon=eps,
            metrics={k: line.get(k) for k in ("auc", "sensitivity", "specificity", "ppv")},
            intermediaries=(int(line["intermediaries"])
                            if line.get("intermediaries") is not None else None),
        )
        self.rows.append(row)
        kind = "final evaluation" if row.evaluation_only else "training"
        auc_text = f"{row.auc:.3f}" if row.auc is not None else "  -  "
        eps_text = " ".join(f"{s}={e:.2f}" for s, e in eps.items())
        lost = f" ({','.join(dropped)})" if dropped else ""
        split = (f" | v={row.intermediaries}" if row.intermediaries is not None else "")
        self.say(
            f"[round {row.round}] {kind:<16} sites {len(participants)}, dropped "
            f"{len(dropped)}{lost} | AUC {auc_text} | epsilon {eps_text}{split}"
        )

    # ------------------------------------------------------------------ report
    def write_report(self, sites: list[str], baselines: dict[str, dict[str, float]]) -> dict[
        str, Any
    ]:
        final_row = self.rows[-1] if self.rows else None
        final_metrics = dict(final_row.metrics) if final_row else {}
        eps = self.epsilon_by_site(sites)
        model = self.model_file()
        report: dict[str, Any] = {
            "sites": sites,
            "privacy_unit": "hospital" if self.o.privacy_unit == "hospital" else (
                "patient" if self.o.patient_column else "record"),
            "delta": self.o.delta,
            "rounds": [
                {
                    "round": r.round,
                    "participants": r.participants,
                    "dropped": r.dropped,
                    "secure_aggregation": r.secure_aggregation,
                    "evaluation_only": r.evaluation_only,
                    "auc": r.auc,
                    "epsilon": r.epsilon,
                    "intermediaries": r.intermediaries,
                }
                for r in self.rows
            ],
            "aborted_rounds": self.aborted,
            "study": str(self.served_study) if self.served_study else None,
            "statistics_round": self.statistics_round,
            "evaluation_round": next(
                (r.round for r in self.rows if r.evaluation_only), None
            ),
            "model": model,
            "threshold": model.get("threshold") if model else None,
            "final": {
                **{k: final_metrics.get(k) for k in ("auc", "sensitivity", "specificity", "ppv")},
                "epsilon": eps,
                # Each purpose composed alone (they do not add up to "epsilon").
                "epsilon_by_purpose": self.epsilon_by_purpose(sites),
                "budget": {s: self.o.budget_epsilon for s in sites},
            },
            "baselines": baselines,
            "privacy_audit": self.audit,
            "seconds": round(time.monotonic() - self.started, 1),
        }
        if self.o.privacy_unit == "hospital":
            report["hospital"] = hospital_report(self.out, sites, self.o)
            report["hospital"]["intermediaries_by_round"] = {
                str(r.round): r.intermediaries for r in self.rows
                if r.intermediaries is not None
            }
        (self.out / "report.json").write_text(json.dumps(report, indent=2, default=_json))
        self.plot(report)
        self.print_table(report)
        return report

    def model_file(self) -> dict[str, Any] | None:
        """The model the study produced: the coordinator's final bundle when there is
        one (with its decision threshold), else its latest checkpoint (no threshold)."""
        import hashlib

        state = self.out / "coordinator"
        bundle = state / "model" / "final.safetensors"
        if bundle.is_file():
            from common.bundle import read_bundle

            threshold = read_bundle(bundle).threshold.value
            return {"path": str(bundle), "kind": "final bundle",
                    "sha256": hashlib.sha256(bundle.read_bytes()).hexdigest(),
                    "threshold": threshold}
        from coordinator.store import CoordinatorStore

        database = state / "coordinator.db"
        if not database.is_file():
            return None
        store = CoordinatorStore(f"sqlite:///{database}")
        try:
            checkpoint = store.latest_checkpoint()
        finally:
            store.close()
        if checkpoint is None:
            return None
        # The store records the digest of the tensor bytes; the report gives the FILE's
        # sha256, which is what someone checking the file they were sent computes.
        return {"path": str(checkpoint.path), "kind": "latest checkpoint (no bundle)",
                "round": checkpoint.round_number,
                "sha256": hashlib.sha256(Path(checkpoint.path).read_bytes()).hexdigest(),
                "threshold": None}

    def _mark_rounds(self, ax: Any, report: dict[str, Any]) -> None:
        """Aborted rounds (red dotted) and the evaluation-only round (shaded)."""
        for index, aborted in enumerate(report["aborted_rounds"]):
            ax.axvline(aborted["round"], color="tab:red", linestyle=":", linewidth=1.2,
                       label="aborted round" if index == 0 else None)
        evaluation = report.get("evaluation_round")
        if evaluation is not None:
            ax.axvspan(evaluation - 0.3, evaluation + 0.3, color="tab:blue", alpha=0.12,
                       label="evaluation-only round")

    def plot(self, report: dict[str, Any]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        rounds = [r for r in report["rounds"] if r["auc"] is not None]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([r["round"] for r in rounds], [r["auc"] for r in rounds], marker="o",
                label="federated, DP + SecAgg+")
        colours = {"centralized_nodp": "tab:gray", "federated_nodp": "tab:green"}
        for name, m in report["baselines"].items():
            ax.axhline(m["auc"], linestyle="--", linewidth=1, color=colours.get(name, "black"),
                       label=name.replace("_", " "))
        self._mark_rounds(ax, report)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round (AUC of the global model entering it)")
        ax.set_ylabel("AUC (federation held-out, secure histograms)")
        # Outside the axes: a legend never hides a line.
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, borderaxespad=0)
        fig.tight_layout()
        fig.savefig(self.out / "auc_by_round.png", dpi=120, bbox_inches="tight")
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(8, 4))
        styles = ("-", "--", "-.", ":")
        markers = ("o", "s", "^", "D", "v", "P", "X", "*")
        # Every site's line starts at (0, 0): nothing spent before the first round.
        # Sites that spend alike would hide each other: each is shifted a little in x.
        xs = [0] + [r["round"] for r in report["rounds"]]
        n_sites = len(report["sites"])
        for index, site in enumerate(report["sites"]):
            shift = 0.12 * (index - (n_sites - 1) / 2) / max(n_sites - 1, 1)
            ys = [0.0] + [r["epsilon"].get(site, 0.0) for r in report["rounds"]]
            ax.plot([x + shift for x in xs], ys, linestyle=styles[index % len(styles)],
                    marker=markers[index % len(markers)], markersize=5, label=site)
        ax.axhline(self.o.budget_epsilon, color="black", linestyle="--", linewidth=1,
                   label="budget")
        self._mark_rounds(ax, report)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=-0.1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round (sites offset slightly so equal spends stay visible)")
        ax.set_ylabel(f"epsilon spent (delta={self.o.delta:g}, composed)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, borderaxespad=0)
        fig.tight_layout()
        fig.savefig(self.out / "epsilon_by_round.png", dpi=120, bbox_inches="tight")
        plt.close(fig)

    def print_table(self, report: dict[str, Any]) -> None:
        cols = ("auc", "sensitivity", "specificity", "ppv")
        rows = [
            ("Centralized (no DP)", report["baselines"]["centralized_nodp"]),
            ("Federated (no DP)", report["baselines"]["federated_nodp"]),
            (f"Federated + DP (eps<={self.o.budget_epsilon:g}) + SecAgg+"
             if "hospital" not in report else
             f"Federated + hospital-level DP (budget {self.o.budget_epsilon:g}; "
             f"{hospital_figures(report['hospital'])}) "
             "+ SecAgg+" + intermediaries_label(report["hospital"]),
             report["final"]),
        ]
        width = max(len(r[0]) for r in rows) + 2
        self.say("")
        self.say(f"{'Metric':<{width}}" + "".join(f"{c.upper():>13}" for c in cols))
        for name, metrics in rows:
            values = "".join(
                f"{metrics[c]:>13.3f}" if isinstance(metrics.get(c), float) else f"{'-':>13}"
                for c in cols
            )
            self.say(f"{name:<{width}}{values}")
        audit = report.get("privacy_audit") or {}
        if audit.get("skipped", True):
            self.say(f"membership inference AUC: not measured ({audit.get('reason', '-')})")
        else:
            self.say(f"{audit['line']} (one-run audit on {audit['site']}: epsilon lower bound "
                     f"{audit['no_dp']['epsilon_lower_bound']:.2f} without DP, "
                     f"{audit['dp']['epsilon_lower_bound']:.2f} with DP at 95%)")
        self.say("")
        self.say(f"Privacy ({report['privacy_unit']}-level DP, delta={self.o.delta:g}; "
                 "per purpose: each composed alone):")
        for site in report["sites"]:
            spent = report["final"]["epsilon"][site]
            budget = report["final"]["budget"][site]
            purposes = report["final"].get("epsilon_by_purpose", {}).get(site, {})
            split = ", ".join(f"{p} {e:.2f}" for p, e in purposes.items())
            self.say(f"  {site:<18} epsilon {spent:6.2f} of {budget:g} "
                     f"({100 * spent / budget:4.0f}% of budget)" + (f"; {split}" if split else ""))
        if "hospital" in report:
            self.print_hospital(report["hospital"])
        self.say(f"\nReport: {self.out / 'report.json'}; plots: auc_by_round.png, "
                 f"epsilon_by_round.png ({report['seconds']:.0f} s)")

    def print_hospital(self, hospital: dict[str, Any]) -> None:
        """The three hospital-mode figures per site, each with the relation it holds for
        (the budget rows above are the add/remove-one-unit charge, not per-patient)."""
        v = hospital["intermediaries"]
        if v == "auto":
            largest = max(hospital.get("intermediaries_by_round", {}).values(), default=1)
            fold = f"each round v-fold, largest v {largest}"
        else:
            fold = f"{v}-fold" if v != 1 else "v = 1: same as intermediary-level"
        self.say("  the epsilons above are each budget's charge (model updates at add/remove "
                 "one unit); three figures per site:")
        self.say(f"  {'site':<18} {'hospital':>9} {'intermed.':>9} {'patient':>9}   "
                 f"hospital = add/remove one hospital ({fold}), intermediary = add/remove "
                 "one unit (both MODEL UPDATES ONLY); patient = every release, updates at 2S")
        units = hospital.get("intermediary_epsilon", {})
        patients = hospital.get("per_patient_epsilon", {})
        for site, value in hospital["epsilon"].items():
            unit = units.get(site, value)
            patient = patients.get(site)
            self.say(f"  {site:<18} {value:9.2f} {unit:9.2f} "
                     + (f"{patient:9.2f}" if patient is not None else f"{'-':>9}"))


def waiting_for(coordinator_lines: list[Line], site_states: dict[str, str]) -> str:
    """What the federation waits for, from the coordinator's log lines and the sites'
    states: a round in flight (its number and the coordinator's last line) or the
    selection of the next round, and any site agent that is not running."""
    opened: str | None = None
    for line in coordinator_lines:
        message = str(line.get("msg", ""))
        if line.get("event") in ("round_completed", "round_aborted"):
            opened = None
        elif message.startswith("round ") and " open: " in message:
            opened = message
    if opened is not None:
        last = str(coordinator_lines[-1].get("msg", coordinator_lines[-1].get("text", "")))
        text = f"{opened}; in flight" + (
            f" (coordinator: {last.strip()[:160]})" if last.strip() != opened else "")
    else:
        text = "the coordinator is waiting for sites to join the next round"
    down = [f"{site} {state}" for site, state in site_states.items() if state != "running"]
    running = [site for site, state in site_states.items() if state == "running"]
    text += f"; site agents running: {', '.join(running) or 'none'}"
    if down:
        text += "; " + "; ".join(down)
    return text


def last_error(proc: ManagedProcess) -> str:
    """The most telling line a failed process left: its last error, else its last line."""
    lines = list(proc.lines)
    for line in reversed(lines):
        if str(line.get("level", "")) in ("error", "critical"):
            return str(line.get("msg", line))
    for line in reversed(lines):
        text = str(line.get("msg", line.get("text", ""))).strip()
        if text:
            return text
    return "no output"


def _json(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def compute_baselines(datasets: dict[str, Any], o: DemoOptions) -> dict[str, dict[str, float]]:
    """Centralized and federated non-private baselines, in process (no DP, no SecAgg)."""
    from site_agent.baselines import centralized_nodp, federated_nodp

    return {
        "centralized_nodp": centralized_nodp(datasets, o, bins=HISTOGRAM_BINS),
        "federated_nodp": federated_nodp(datasets, o, bins=HISTOGRAM_BINS),
    }



def hospital_figures(hospital: dict[str, Any]) -> str:
    """The table row's privacy figures under hospital-level DP: the largest hospital-level
    and per-patient epsilon over the sites (the budget caps neither: it is charged at
    add/remove one unit, and the per-patient figure counts the updates at 2S)."""
    whole = max(hospital.get("epsilon", {}).values(), default=0.0)
    patient = max(hospital.get("per_patient_epsilon", {}).values(), default=0.0)
    return f"hospital eps {whole:.2f}, per-patient eps {patient:.2f}"


def intermediaries_label(hospital: dict[str, Any]) -> str:
    """The table row's suffix naming the intermediaries: fixed v, or v per round."""
    v = hospital.get("intermediaries", 1)
    if v == "auto":
        chosen = hospital.get("intermediaries_by_round", {})
        return ", v auto per round " + (
            "/".join(str(x) for x in chosen.values()) if chosen else "-")
    return f", v={v}" if v != 1 else ""


def hospital_aggregation(o: DemoOptions) -> str:
    """The coordinator's [aggregation] lines for hospital-level DP: S and a z planned so
    the demo's rounds of updates fit the sites' budget (`common.privacy.hospital`)."""
    if o.privacy_unit != "hospital":
        return ""
    from common.privacy.hospital import EVALUATION_RESERVE, plan_noise_multiplier

    left = (o.budget_epsilon - COUNT_EPSILON) * (1 - EVALUATION_RESERVE)
    z = plan_noise_multiplier(epsilon=left, delta=o.delta, rounds=o.rounds)
    return f"hospital_clip_norm = {o.update_clip_norm}\nhospital_noise_multiplier = {z}\n"


def hospital_report(out: Path, sites: list[str], o: DemoOptions) -> dict[str, Any]:
    """Each site's three hospital-mode figures from its own ledger
    (`common.privacy.hospital.guarantees`): hospital-level and intermediary-level (model
    updates only) and per-patient (every release, the updates at 2S)."""
    from common.privacy.hospital import guarantees
    from common.privacy.ledger import read_ledger

    epsilon: dict[str, float] = {}
    intermediary: dict[str, float] = {}
    per_patient: dict[str, float] = {}
    for site in sites:
        path = out / "sites" / site / "privacy-ledger.db"
        if not path.exists():
            epsilon[site] = intermediary[site] = per_patient[site] = 0.0
            continue
        header, entries = read_ledger(path)
        pairs = [(e.purpose, tuple(getattr(e, "mechanisms", ()))) for e in entries]
        figures = guarantees(pairs, delta=header.delta, accountant=header.accountant)
        epsilon[site] = figures.hospital
        intermediary[site] = figures.intermediary
        per_patient[site] = figures.per_patient
    return {"epsilon": epsilon, "intermediary_epsilon": intermediary,
            "per_patient_epsilon": per_patient,
            "intermediaries": o.intermediaries, "update_clip_norm": o.update_clip_norm,
            "note": ("hospital-level and intermediary-level epsilon cover the model updates "
                     "only; per-patient composes every release with the updates at 2S; the "
                     "budget (epsilon by site above) is charged at add/remove one unit")}


def hospital_study(study: Any, o: DemoOptions) -> Any:
    """The drafted study under hospital-level DP (issue 13): unit hospital, clip S and
    the intermediaries per hospital; z is planned from the study's epsilon."""
    from common.study import StudyPrivacySection

    privacy = StudyPrivacySection.model_validate({
        **study.privacy.model_dump(), "unit": "hospital",
        "update_clip_norm": o.update_clip_norm, "intermediaries": o.intermediaries,
    })
    return study.model_copy(update={"privacy": privacy})
