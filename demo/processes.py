"""The demo's federation as real processes: one coordinator and the site agents, each
with its configuration file and its log, started, restarted, killed and stopped here,
and what to say when one of them fails. The rounds they run are followed by
`demo.rounds`; what each site trains on comes from the task (`demo.tasks`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common.core.config import AggregationSection
from common.core.errors import StateError
from common.core.processes import ManagedProcess, medfed_argv
from demo.options import DemoOptions
from demo.watch import last_error

FINAL_MODEL_SECONDS = 300
"""How long after the last round a site may take to download and store the final model."""

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The environment of the processes the demo starts: the coordinator's model work (the
initial model, the evaluation probe) and a site's training are small enough that
intra-op threads on the machine's few cores only contend with the other processes."""


class FederationProcesses:
    """The coordinator and site agent processes of one demo run, under ``options.out``
    (configuration files, state folders and logs)."""

    def __init__(self, options: DemoOptions) -> None:
        self.o = options
        self.out = options.out
        self.coordinator: ManagedProcess | None = None
        self.port = 0  # the coordinator's, once it listens
        self.site_agents: dict[str, ManagedProcess] = {}
        self.killed: set[ManagedProcess] = set()  # sites this demo killed on purpose
        # Each site's `site run` command, to restart it as it was started.
        self._site_commands: dict[str, tuple[str, ...]] = {}

    def service_argv(self, *command: str) -> list[str]:
        """The argv of a service the demo starts (`coordinator serve`, `site run`):
        `medfed` with this interpreter."""
        return medfed_argv(*command)

    def site_state(self, site: str) -> Path:
        """The site's state folder (ledger, split key)."""
        return self.out / "sites" / site

    def log(self, name: str) -> Path:
        """The log file of the process `name` ("coordinator" or a site)."""
        return self.out / "logs" / f"{name}.log"

    def start_coordinator(self, pki: Path, *, n_sites: int, study: Path,
                          aggregation: AggregationSection) -> ManagedProcess:
        """`coordinator serve --study` on a free port of 127.0.0.1; returns once it
        listens. Every round waits for all sites (the killed one is restarted right after
        its round), so each hospital's epsilon tells the same story. The served study
        gives the model (built by the coordinator) and the training settings."""
        config = self.out / "coordinator.toml"
        config.write_text(
            f"""rounds = {self.o.rounds}
min_sites = {n_sites}
federation_id = "medfed-demo"

[aggregation]
histogram_bins = {aggregation.histogram_bins}
clip = {aggregation.clip}
max_colluding_sites = {aggregation.max_colluding_sites}

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
                "--linger-seconds", "5", "--study", str(study)),
            log_dir=self.out / "logs", env=ONE_THREAD,
        )
        try:
            event = proc.wait_event("listening", timeout=300)
        except RuntimeError:
            state = ("exited with code " + str(proc.proc.returncode) if not proc.alive
                     else "did not start listening within 300 s")
            proc.stop()
            raise StateError(f"the coordinator {state}: {last_error(proc)} "
                             f"(log: {self.log('coordinator')})") from None
        self.port = int(event["port"])
        self.coordinator = proc
        return proc

    def start_site(self, site: str, pki: Path, config: str, *,
                   pause_after: str | None = None) -> ManagedProcess:
        """`medfed site run --once` with the site configuration `config` (TOML); with
        `pause_after` (ROUND:PHASE), the victim of the fault injection: the same command
        through `bench.instrumented`, the test entry that can pause a site after a phase
        (the product cannot), so the demo kills it there."""
        path = self.out / "sites" / f"{site}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config)
        command = ("site", "run", "--config", str(path), "--pki", str(pki),
                   "--site", site, "--coordinator", f"127.0.0.1:{self.port}",
                   "--metrics-listen", "127.0.0.1:0", "--state", str(self.site_state(site)),
                   "--once")
        self._site_commands[site] = command
        argv = self.service_argv(*command) if pause_after is None else [
            sys.executable, "-m", "bench.instrumented", *command,
            "--debug-pause-after", pause_after]
        return self._launch(site, argv)

    def restart_site(self, site: str) -> ManagedProcess:
        """The site's `site run` again, with its state (its ledger) and without a pause."""
        return self._launch(site, self.service_argv(*self._site_commands[site]))

    def _launch(self, site: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(site, argv, log_dir=self.out / "logs", env=ONE_THREAD)
        self.site_agents[site] = proc
        return proc

    def kill_paused(self) -> list[str]:
        """`kill -9` every running site that said it paused (the fault victim, after
        the phase it was told to pause after); the sites killed."""
        killed = []
        for site, proc in self.site_agents.items():
            if proc.alive and any(x.get("event") == "paused" for x in list(proc.lines)):
                self.killed.add(proc)
                proc.kill9()
                killed.append(site)
        return killed

    def was_killed(self, site: str) -> bool:
        """Whether the demo killed `site` on purpose (any of its processes)."""
        return any(proc.name == site for proc in self.killed)

    def check_sites(self) -> None:
        """Fail fast with the site's own message when a site agent died (bad data,
        refused certificate...) instead of waiting out the round-start timeout."""
        for site, proc in self.site_agents.items():
            if proc in self.killed or proc.alive:
                continue
            code = proc.proc.returncode
            if code not in (0, None):
                raise StateError(f"site {site} exited with code {code}: {last_error(proc)} "
                                 f"(log: {self.log(site)})")

    def site_states(self, sites: list[str]) -> dict[str, str]:
        """Each site agent in a few words: running, killed by the demo, or exited with
        its code, its last error and its log."""
        states = {}
        for site in sites:
            proc = self.site_agents.get(site)
            if proc is None:
                states[site] = "not started"
            elif proc.alive:
                states[site] = "running"
            elif proc in self.killed:
                states[site] = "killed by the demo (not restarted yet)"
            else:
                states[site] = (f"exited with code {proc.proc.returncode}: {last_error(proc)} "
                                f"(log: {self.log(site)})")
        return states

    def coordinator_failure(self, coordinator: ManagedProcess, sites: list[str]) -> str:
        """What failed when the coordinator exits mid-demo: its own error, then every
        site that was not running, each with its log (a bare "fewer than min_sites"
        names no site)."""
        states = self.site_states(sites)
        down = {site: state for site, state in states.items() if state != "running"}
        text = (f"the coordinator exited with code {coordinator.proc.returncode}: "
                f"{last_error(coordinator)} (log: {self.log('coordinator')})")
        if down:
            text += "; sites not running: " + "; ".join(
                f"{site} {state}" for site, state in down.items())
        else:
            text += "; every site agent was still running (site logs: " \
                    f"{self.out / 'logs'})"
        return text

    def wait_for_final_models(self, sites: list[str]) -> None:
        """Each site (`--once`) exits 0 once it stored the study's final model: wait for
        that before stopping anything, so the report never names a model a site lacks."""
        for site in sites:
            proc = self.site_agents[site]
            try:
                code = proc.wait_exit(timeout=FINAL_MODEL_SECONDS)
            except subprocess.TimeoutExpired:
                raise StateError(
                    f"site {site} did not store the final model within "
                    f"{FINAL_MODEL_SECONDS} s of the last round: {last_error(proc)} "
                    f"(log: {self.log(site)})") from None
            if code != 0:
                raise StateError(f"site {site} exited with code {code} after the last round: "
                                 f"{last_error(proc)} (log: {self.log(site)})")

    def stop_all(self) -> None:
        """Stop every site agent, then the coordinator."""
        for proc in self.site_agents.values():
            proc.stop()
        if self.coordinator is not None:
            self.coordinator.stop()
