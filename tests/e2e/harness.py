"""Real OS processes for end-to-end tests: a coordinator and site agents over mTLS.

Processes print JSON lines (events on stdout, structured logs on stderr); tests wait on
conditions over those lines (common.processes.ManagedProcess; no sleeps as sync).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common.processes import ManagedProcess, medfed_argv

REPO = Path(__file__).resolve().parents[2]


def run_medfed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(medfed_argv(*args), check=True, capture_output=True, text=True,
                          cwd=REPO)


def make_pki(root: Path, sites: Sequence[str]) -> Path:
    pki = root / "pki"
    run_medfed("pki", "init", "--dir", str(pki))
    run_medfed("pki", "issue", "--dir", str(pki), "--coordinator", "127.0.0.1,localhost")
    for site in sites:
        run_medfed("pki", "issue", "--dir", str(pki), "--site", site)
    return pki


class Federation:
    """One coordinator and its sites, all real processes, in `root`."""

    def __init__(self, root: Path, sites: Sequence[str], *, env: dict[str, str] | None = None):
        self.root = root
        self.sites = list(sites)
        self.env = env or {}
        self.pki = make_pki(root, sites)
        self.logs = root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.coordinator: ManagedProcess | None = None
        self.site_procs: dict[str, ManagedProcess] = {}
        self.port = 0
        self._restarts = 0

    def start_coordinator(self, *extra: str, port: int | None = None,
                          exit_when_finished: bool = True) -> ManagedProcess:
        """`exit_when_finished`: batch behaviour (the process exits after the study);
        False: it stays up as a production coordinator does."""
        listen = f"127.0.0.1:{port if port is not None else 0}"
        batch = ("--exit-when-finished", "--linger-seconds", "3") if exit_when_finished else ()
        self._restarts += 1
        proc = ManagedProcess(
            f"coordinator-{self._restarts}",
            medfed_argv("coordinator", "serve", "--pki", str(self.pki), "--listen", listen,
                   "--metrics-listen", "127.0.0.1:0", "--state", str(self.root / "coordinator"),
                   "--debug-write-aggregates", *batch, *extra),
            env=self.env, log_dir=self.logs, cwd=REPO,
        )
        event = proc.wait_event("listening", timeout=60)
        self.port = int(event["port"])
        self.coordinator = proc
        return proc

    def start_site(self, site: str, *extra: str) -> ManagedProcess:
        proc = ManagedProcess(
            site,
            medfed_argv("site", "run", "--pki", str(self.pki), "--site", site,
                   "--coordinator", f"127.0.0.1:{self.port}", "--metrics-listen", "127.0.0.1:0",
                   "--state", str(self.root / "sites" / site), "--trainer", "test-deterministic",
                   "--debug-write-updates", *extra),
            env=self.env, log_dir=self.logs, cwd=REPO,
        )
        self.site_procs[site] = proc
        return proc

    def stop(self) -> None:
        for proc in self.site_procs.values():
            proc.stop()
        if self.coordinator is not None:
            self.coordinator.stop()

    # ----------------------------------------------------------------- checks
    def aggregate(self, round_number: int) -> tuple[np.ndarray, list[str]]:
        folder = self.root / "coordinator" / "aggregates"
        total = np.fromfile(folder / f"round-{round_number:06d}.u32", dtype="<u4")
        survivors = (folder / f"round-{round_number:06d}.survivors").read_text().split()
        return total, survivors

    def has_aggregate(self, round_number: int) -> bool:
        folder = self.root / "coordinator" / "aggregates"
        return (folder / f"round-{round_number:06d}.u32").exists()

    def site_update(self, site: str, round_number: int) -> np.ndarray:
        path = self.root / "sites" / site / "debug-updates" / f"round-{round_number:06d}.u32"
        return np.fromfile(path, dtype="<u4")

    def assert_exact_sum(self, round_number: int) -> list[str]:
        """The coordinator's unmasked ring sum equals the survivors' plaintext sum."""
        total, survivors = self.aggregate(round_number)
        expected = np.zeros_like(total)
        for site in survivors:
            np.add(expected, self.site_update(site, round_number), out=expected)
        assert np.array_equal(total, expected), f"round {round_number}: aggregate differs"
        return survivors
