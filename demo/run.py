"""The one `Demo`: a PKI, one coordinator and the site agents as real processes, one
site killed mid-round where the federation survives it, the rounds followed from the
coordinator's events; the task (`demo.tabular`, `demo.imaging`) supplies the data, the
baselines, the model and the sites' configuration."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.core.errors import StateError
from common.core.processes import Line, ManagedProcess, medfed_argv
from demo.options import WAIT_NOTE_SECONDS, DemoOptions, RoundRow
from demo.report import baseline_label, dp_auc_text, epsilon_by_site, write_report
from demo.tabular import TabularTask
from demo.tasks import DemoTask
from demo.terms import dropout_decision, federation_terms
from demo.watch import last_error, waiting_for

FINAL_MODEL_SECONDS = 300
"""How long after the last round a site may take to download and store the final model."""

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The environment of the processes the demo starts: the coordinator's model work (the
initial model, the evaluation probe) and a site's training are small enough that
intra-op threads on the machine's few cores only contend with the other processes."""

DEMO_TORCH_THREADS = 1
"""Torch threads for the demo's own trainings (the baselines, the audit, the imaging
demo's exact AUC), which are one site's size or less: one thread, as its site agents
train (OMP_NUM_THREADS=1). Intra-op threads on these small models cost more than they
save: measured on the e2e tests' cohorts (2 cores, loaded), the imaging baselines took
7 CPU-s on one thread against 27 on two, the tabular audit 3.7 against 12.4, each in
less wall time too, with the same audit line."""


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch's intra-op thread count set to `threads` for the block, then restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Demo:
    """`medfed demo`: the federation, its fault and its report, for one task."""

    def __init__(self, options: DemoOptions, *, task: DemoTask | None = None) -> None:
        self.o = options
        self.out = options.out
        self.task: DemoTask = task if task is not None else TabularTask()
        self.procs: dict[str, ManagedProcess] = {}
        self.rows: list[RoundRow] = []
        self.aborted: list[dict[str, Any]] = []
        self.killed: set[ManagedProcess] = set()  # sites this demo killed on purpose
        self.audit: dict[str, Any] = {"skipped": True, "reason": "not run"}
        self.started = time.monotonic()
        self._print_lock = threading.Lock()
        # The study the sites train and its file, which the coordinator serves
        # (`coordinator serve --study`); both set by the task.
        self.study: Any = None
        self.served_study: Path | None = None
        self.statistics_round: int | None = None
        # Each site's split key, made in its state folder before it starts, so the
        # in-process baselines hold out the patients the sites hold out.
        self.split_keys: dict[str, bytes] = {}
        self.port = 0
        # SecAgg+ terms for the coordinator and the sites (set by `run` for its sites).
        self.terms = federation_terms(max(options.sites, 3),
                                      histogram_bins=self.task.histogram_bins)

    def say(self, text: str) -> None:
        if not self.o.quiet:
            with self._print_lock:
                print(text, flush=True)

    # ------------------------------------------------------------------ setup

    def make_pki(self, sites: list[str]) -> Path:
        from common.protocol.pki import init_ca, issue_coordinator, issue_site

        pki = self.out / "pki"
        init_ca(pki)
        issue_coordinator(pki, ["127.0.0.1", "localhost"])
        for site in sites:
            issue_site(pki, site)
        self.say(f"[setup] PKI: federation CA, coordinator and {len(sites)} site certificates "
                 f"in {pki}")
        return pki

    def approve_with_members(self, pki: Path, sites: list[str]) -> None:
        """The study lists its hospitals by public-key SHA-256 ([[members]], as `medfed
        study init --member-from` writes them) and every hospital approves it (`medfed
        site approve`): each site then joins only this study and refuses any round naming
        anyone else, or a member under another key (a CA holder's sybil sites)."""
        from common.protocol.pki import load_certificate, public_key_fingerprint, site_paths
        from common.study import load_study, study_sha256
        from site_agent.approvals import Approvals

        if self.served_study is None:
            raise StateError("the demo's task wrote no study to serve")
        members = "".join(
            f'\n[[members]]\nname = "{site}"\nfingerprint = "'
            f'{public_key_fingerprint(load_certificate(site_paths(pki, site)[0]))}"\n'
            for site in sites)
        with self.served_study.open("a", encoding="utf-8") as handle:
            handle.write("\n# The hospitals of this study and their keys (public-key SHA-256)."
                         + members)
        self.study = load_study(self.served_study)
        for site in sites:
            Approvals(self.site_state(site)).approve_study(self.study)
        self.say(f"[setup] study lists its {len(sites)} hospitals by key; each approved "
                 f"sha256 {study_sha256(self.study)[:16]}... (`medfed site approve`)")

    def start_coordinator(self, pki: Path, n_sites: int) -> ManagedProcess:
        # Every round waits for all sites (the killed one is restarted right after its
        # round), so each hospital's epsilon tells the same story. The served study gives
        # the model (built by the coordinator) and the training settings.
        config = self.out / "coordinator.toml"
        if self.served_study is None:
            raise StateError("the demo's task wrote no study to serve")
        config.write_text(
            f"""rounds = {self.o.rounds}
min_sites = {n_sites}
federation_id = "medfed-demo"

[aggregation]
histogram_bins = {self.terms.aggregation.histogram_bins}
clip = {self.terms.aggregation.clip}
max_colluding_sites = {self.terms.aggregation.max_colluding_sites}

[deadlines]
selection_seconds = 5
round_start_timeout_seconds = 600
train_seconds = 600
phase_seconds = {self.o.phase_seconds}
"""
        )
        proc = ManagedProcess(
            "coordinator",
            self.service_argv(
                "coordinator", "serve", "--config", str(config), "--pki", str(pki),
                "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                "--state", str(self.out / "coordinator"), "--exit-when-finished",
                "--linger-seconds", "5", "--study", str(self.served_study)),
            log_dir=self.out / "logs", env=ONE_THREAD,
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

    def service_argv(self, *command: str) -> list[str]:
        """The argv of a service the demo starts (`coordinator serve`, `site run`):
        `medfed` with this interpreter."""
        return medfed_argv(*command)

    def site_state(self, site: str) -> Path:
        """The site's state folder (ledger, split key)."""
        return self.out / "sites" / site

    def start_site(self, site: str, pki: Path, data: Path | None, *,
                   pause_after: str | None = None) -> ManagedProcess:
        """`medfed site run`; with `pause_after` (ROUND:PHASE), the victim of the fault
        injection: the same command through `bench.instrumented`, the test entry that
        can pause a site after a phase (the product cannot), so the demo kills it there."""
        config = self.out / "sites" / f"{site}.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(self.task.site_config(self, site, data))
        command = ("site", "run", "--config", str(config), "--pki", str(pki),
                   "--site", site, "--coordinator", f"127.0.0.1:{self.port}",
                   "--metrics-listen", "127.0.0.1:0", "--state", str(self.site_state(site)),
                   "--once")
        argv = self.service_argv(*command) if pause_after is None else [
            sys.executable, "-m", "bench.instrumented", *command,
            "--debug-pause-after", pause_after]
        proc = ManagedProcess(
            site, argv, log_dir=self.out / "logs", env=ONE_THREAD,
        )
        self.procs[site] = proc
        return proc

    def privacy_audit(self, datasets: dict[str, Any]) -> dict[str, Any]:
        """Membership-inference audit on one site's records (demo/audit.py)."""
        from demo.audit import demo_audit, skipped
        from site_agent.data import SiteData

        if not self.o.audit:
            return skipped("--no-audit")
        if not all(isinstance(d, SiteData) for d in datasets.values()):
            return skipped("the audit runs on tables; image data is not audited yet")
        self.say("[audit] membership inference on one site's records, without DP and with "
                 f"DP at epsilon {self.o.budget_epsilon:g} ...")
        from site_agent.audit import study_audit_model

        model = study_audit_model(self.study)  # the study's encoding and model
        result = demo_audit(datasets, epsilon=self.o.budget_epsilon, delta=self.o.delta,
                            seed=self.o.seed, model=model)
        self.say(f"[audit] {result.get('line') or 'skipped: ' + str(result.get('reason'))}")
        return result

    def run(self) -> dict[str, Any]:
        """The whole demo, its own trainings on DEMO_TORCH_THREADS threads; the report."""
        with torch_threads(DEMO_TORCH_THREADS):
            return self._run()

    def _run(self) -> dict[str, Any]:
        files = self.task.prepare(self)
        sites = sorted(files)
        pki = self.make_pki(sites)
        self.approve_with_members(pki, sites)
        from site_agent.unit_split import site_split_key

        self.split_keys = {site: site_split_key(self.site_state(site)) for site in sites}
        datasets, _features = self.task.load_datasets(self, files)
        self.say("[baseline] training centralized and federated non-private baselines ...")
        baselines = self.task.baselines(self, datasets)
        for name, m in baselines.items():
            self.say(f"[baseline] {baseline_label(self, name)}: AUC {m['auc']:.3f} (exact)")
        self.audit = self.privacy_audit(datasets)
        self.terms = federation_terms(len(sites), histogram_bins=self.task.histogram_bins)
        if self.terms.note:
            self.say(f"[setup] {self.terms.note}")
        victim = self.plan_fault(sites)
        coordinator = self.start_coordinator(pki, len(sites))
        try:
            for site in sites:
                self.start_site(site, pki, files[site], pause_after=(
                    f"{self.kill_round_number()}:masked_input" if site == victim else None))
            self.say(f"[federation] {len(sites)} site agents started; budget "
                     f"epsilon={self.o.budget_epsilon:g} at delta={self.o.delta:g} each")
            self.say("[federation] AUC = the global model entering each round, measured on every "
                     "site's held-out split through securely summed score histograms")
            self.follow_rounds(coordinator, sites, victim, pki, files)
            self.wait_for_final_models(sites)
        finally:
            for proc in self.procs.values():
                proc.stop()
            coordinator.stop()
        return self.write_report(sites, baselines)

    def wait_for_final_models(self, sites: list[str]) -> None:
        """Each site (`--once`) exits 0 once it stored the study's final model: wait for
        that before stopping anything, so the report never names a model a site lacks."""
        for site in sites:
            proc = self.procs[site]
            try:
                code = proc.wait_exit(timeout=FINAL_MODEL_SECONDS)
            except subprocess.TimeoutExpired:
                raise StateError(
                    f"site {site} did not store the final model within "
                    f"{FINAL_MODEL_SECONDS} s of the last round: {last_error(proc)} "
                    f"(log: {self.out / 'logs' / (site + '.log')})") from None
            if code != 0:
                raise StateError(f"site {site} exited with code {code} after the last round: "
                                 f"{last_error(proc)} (log: {self.out / 'logs' / (site + '.log')})")

    def kill_round_number(self) -> int:
        """The coordinator's number of the `--kill-round`th training round (round 1 is
        the study's federated DP statistics round)."""
        return self.o.kill_round + 1

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
        eps = epsilon_by_site(self, sites)
        auc = line.get("auc")
        row = RoundRow(
            round=int(line["round_number"]),
            participants=participants,
            dropped=dropped,
            secure_aggregation=bool(line.get("secure", True)),
            auc=float(auc) if auc is not None else None,
            evaluation_only=bool(line.get("evaluation_only", False)),
            epsilon=eps,
            metrics={k: line.get(k) for k in ("auc", "sensitivity", "specificity", "ppv",
                                              "auc_interval_low", "auc_interval_high")},
            intermediaries=(int(line["intermediaries"])
                            if line.get("intermediaries") is not None else None),
        )
        self.rows.append(row)
        kind = "final evaluation" if row.evaluation_only else "training"
        auc_text = dp_auc_text(row.metrics) if row.auc is not None else "  -  "
        eps_text = " ".join(f"{s}={e:.2f}" for s, e in eps.items())
        lost = f" ({','.join(dropped)})" if dropped else ""
        split = (f" | v={row.intermediaries}" if row.intermediaries is not None else "")
        self.say(
            f"[round {row.round}] {kind:<16} sites {len(participants)}, dropped "
            f"{len(dropped)}{lost} | AUC {auc_text} | epsilon {eps_text}{split}"
        )

    # ------------------------------------------------------------------ report

    def write_report(self, sites: list[str],
                     baselines: dict[str, dict[str, float]]) -> dict[str, Any]:
        """report.json, the plots and the table (`demo.report`), then the task's own."""
        report = write_report(self, sites, baselines)
        self.task.finish_report(self, report)
        return report
