"""The one `Demo`: the federation set up (`demo.enrolment`), run as real processes
(`demo.processes`) with one site killed mid-round where the federation survives it, its
rounds followed (`demo.rounds`), then the report (`demo.report`); the task
(`demo.tabular`, `demo.imaging`) supplies the data, the baselines, the model and the
sites' configuration."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.core.errors import StateError
from common.study import study_sha256
from demo.audit import privacy_audit
from demo.enrolment import make_pki, pin_members_and_approve, split_keys
from demo.options import DemoOptions
from demo.processes import FederationProcesses
from demo.report import baseline_label, write_report
from demo.rounds import RoundFollower
from demo.tabular import TabularTask
from demo.tasks import DemoTask
from demo.terms import federation_terms

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
    # torch: loaded only when the demo runs, so `medfed --help` (listing it) stays torch-free
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Demo:
    """`medfed demo` for one task: what the task and the report read of the running
    demo (`demo.tasks.Demo`), and the run from setup to report."""

    def __init__(self, options: DemoOptions, *, task: DemoTask | None = None) -> None:
        self.o = options
        self.out = options.out
        self.task: DemoTask = task if task is not None else TabularTask()
        self.processes = FederationProcesses(options)
        self.follower = RoundFollower(self.processes, options, say=self.say)
        self.audit: dict[str, Any] = {"skipped": True, "reason": "not run"}
        self.started = time.monotonic()
        self._print_lock = threading.Lock()
        # The study the sites train and its file, which the coordinator serves
        # (`coordinator serve --study`); both set by the task.
        self.study: Any = None
        self.served_study: Path | None = None
        # Each site's split key, made in its state folder before it starts, so the
        # in-process baselines hold out the patients the sites hold out.
        self.split_keys: dict[str, bytes] = {}
        # SecAgg+ terms for the coordinator and the sites (set by `run` for its sites).
        self.terms = federation_terms(max(options.sites, 3),
                                      histogram_bins=self.task.histogram_bins)

    def say(self, text: str) -> None:
        if not self.o.quiet:
            with self._print_lock:
                print(text, flush=True)

    def run(self) -> dict[str, Any]:
        """The whole demo, its own trainings on DEMO_TORCH_THREADS threads; the report."""
        with torch_threads(DEMO_TORCH_THREADS):
            return self._run()

    def _run(self) -> dict[str, Any]:
        files = self.task.prepare(self)
        sites = sorted(files)
        if self.served_study is None:
            raise StateError("the demo's task wrote no study to serve")
        pki = self.out / "pki"
        make_pki(pki, sites)
        self.say(f"[setup] PKI: federation CA, coordinator and {len(sites)} site certificates "
                 f"in {pki}")
        states = {site: self.processes.site_state(site) for site in sites}
        self.study = pin_members_and_approve(self.served_study, pki, site_states=states)
        self.say(f"[setup] study lists its {len(sites)} hospitals by key; each approved "
                 f"sha256 {study_sha256(self.study)[:16]}... (`medfed site approve`)")
        self.split_keys = split_keys(states)
        datasets, _features = self.task.load_datasets(self, files)
        self.say("[baseline] training centralized and federated non-private baselines ...")
        baselines = self.task.baselines(self, datasets)
        for name, m in baselines.items():
            self.say(f"[baseline] {baseline_label(self, name)}: AUC {m['auc']:.3f} (exact)")
        self.audit = privacy_audit(self, datasets)
        self.terms = federation_terms(len(sites), histogram_bins=self.task.histogram_bins)
        if self.terms.note:
            self.say(f"[setup] {self.terms.note}")
        victim = self.follower.plan_fault(sites, self.terms)
        coordinator = self.processes.start_coordinator(
            pki, n_sites=len(sites), study=self.served_study,
            aggregation=self.terms.aggregation)
        self.say(f"[setup] coordinator listening on 127.0.0.1:{self.processes.port} "
                 "(mTLS only)")
        try:
            kill_at = f"{self.follower.kill_round_number()}:masked_input"
            for site in sites:
                config = self.task.site_config(self, site, files[site])
                self.processes.start_site(site, pki, config,
                                          pause_after=kill_at if site == victim else None)
            self.say(f"[federation] {len(sites)} site agents started; budget "
                     f"epsilon={self.o.budget_epsilon:g} at delta={self.o.delta:g} each")
            self.say("[federation] AUC = the global model entering each round, measured on every "
                     "site's held-out split through securely summed score histograms")
            self.follower.follow(coordinator, sites, victim)
            self.processes.wait_for_final_models(sites)
        finally:
            self.processes.stop_all()
        report = write_report(self, sites, baselines)
        self.task.finish_report(self, report)
        return report
