"""Real OS processes for end-to-end tests: a coordinator and site agents over mTLS.

Processes print JSON lines (events on stdout, structured logs on stderr); tests wait on
conditions over those lines (common.core.processes.ManagedProcess; no sleeps as sync).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.instrumented import instrumented_argv
from common.commands.status import fetch_status
from common.core.processes import ManagedProcess, medfed_argv
from common.protocol import pki
from common.protocol.tls import TlsFiles
from common.study import load_study
from site_agent.approvals import Approvals

REPO = Path(__file__).resolve().parents[2]


def transport_site_argv(*args: str) -> list[str]:
    """argv of `medfed` with the transport benchmarks' deterministic site double
    (`bench.transport_site`: `site run` takes every flag of the product's and the test
    instrumentation's, `bench.instrumented`)."""
    return [sys.executable, "-m", "bench.transport_site", *args]


def service_argv(*args: str) -> list[str]:
    """argv of `medfed ARGS`, through `bench.instrumented` where ARGS ask for its test
    instrumentation (`--debug-*`, `--model-dim`: the product has no such flags)."""
    if any(arg.startswith("--debug-") or arg == "--model-dim" for arg in args):
        return instrumented_argv(*args)
    return medfed_argv(*args)


def run_medfed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(medfed_argv(*args), check=True, capture_output=True, text=True,
                          cwd=REPO)


def make_pki(root: Path, sites: Sequence[str]) -> Path:
    """ROOT/pki as `medfed pki init` and `medfed pki issue --coordinator 127.0.0.1,localhost
    / --site SITE` write it, through the same library calls with the CLI's defaults, in
    this process: a process start per certificate costs seconds on a loaded machine, and
    the commands themselves run in tests/pki/test_pki_cli.py and the README tests."""
    directory = root / "pki"
    pki.init_ca(directory)
    now = dt.datetime.now(dt.UTC)
    pki.issue_coordinator(directory, ["127.0.0.1", "localhost"], now=now)
    for site in sites:
        pki.issue_site(directory, site, now=now)
    return directory


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
            instrumented_argv("coordinator", "serve", "--pki", str(self.pki), "--listen", listen,
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
            transport_site_argv(
                "site", "run", "--pki", str(self.pki), "--site", site,
                "--coordinator", f"127.0.0.1:{self.port}", "--metrics-listen", "127.0.0.1:0",
                "--state", str(self.root / "sites" / site), "--debug-write-updates", *extra),
            env=self.env, log_dir=self.logs, cwd=REPO,
        )
        self.site_procs[site] = proc
        return proc

    def stop(self) -> None:
        for proc in self.site_procs.values():
            proc.stop()
        if self.coordinator is not None:
            self.coordinator.stop()

    def processes(self) -> list[ManagedProcess]:
        """The coordinator (its latest start) and every site, for a failure's report."""
        started = [self.coordinator] if self.coordinator is not None else []
        return [*started, *self.site_procs.values()]

    def site_states(self, monitor: str = "ops") -> dict[str, str]:
        """Each site's state as `medfed status` reports it, asked with a monitor
        certificate (`pki issue --monitor`)."""
        files = TlsFiles.for_monitor(self.pki, monitor)
        status = fetch_status(f"127.0.0.1:{self.port}", ca=files.ca, cert=files.cert,
                              key=files.key, timeout=10)
        return {s["site_id"]: s["state"] for s in status["sites"]}  # type: ignore[attr-defined]

    def until_states(self, condition: Callable[[dict[str, str]], bool], *,
                     timeout: float) -> dict[str, str]:
        """Ask for status until `condition` holds on the site states, or fail at `timeout`."""
        end = time.monotonic() + timeout
        states = self.site_states()
        while not condition(states):
            assert time.monotonic() < end, f"status never matched; last: {states}"
            states = self.site_states()
        return states

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


# ------------------------------------------------------------------ a study, as processes


def list_members(study: Path, pki_dir: Path, sites: Sequence[str]) -> Path:
    """Append to `study` its [[members]]: each site with the public-key SHA-256 of its
    certificate in `pki_dir`, as `medfed study init --member-from pki/sites/SITE.crt`
    lists them. A site with default settings joins only a study listing its members."""
    members = "".join(
        f'\n[[members]]\nname = "{site}"\nfingerprint = "'
        f'{pki.public_key_fingerprint(pki.load_certificate(pki.site_paths(pki_dir, site)[0]))}"\n'
        for site in sites)
    with study.open("a", encoding="utf-8") as handle:
        handle.write(members)
    return study


PROCESS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""One thread per process: several sites and a coordinator share a 2-core machine."""


class StudyProcesses:
    """A study over real processes, as a hospital consortium runs it: `medfed coordinator
    serve --study STUDY` and one `medfed site run --once` per site on its own file or
    folder. Every process started is appended to `processes` (the `processes` fixture
    stops them), so a failing test leaves nothing running."""

    def __init__(self, root: Path, *, study: Path, pki: Path,
                 processes: list[ManagedProcess]) -> None:
        self.root = root
        self.study = study
        self.pki = pki
        self.processes = processes
        self.logs = root / "logs"
        self.state = root / "coordinator"
        self.port = 0
        self._starts: dict[str, int] = {}

    def start_coordinator(self, *extra: str, min_sites: int = 3) -> ManagedProcess:
        """Waits until it listens; `extra`: more `coordinator serve` flags."""
        proc = ManagedProcess(
            "coordinator",
            service_argv("coordinator", "serve", "--study", str(self.study),
                        "--pki", str(self.pki), "--listen", "127.0.0.1:0",
                        "--metrics-listen", "127.0.0.1:0", "--state", str(self.state),
                        "--min-sites", str(min_sites), "--selection-seconds", "1",
                        "--linger-seconds", "20", *extra),
            log_dir=self.logs, env=PROCESS_ENV, cwd=REPO,
        )
        self.processes.append(proc)
        self.port = int(proc.wait_event("listening", timeout=120)["port"])
        return proc

    def site_state(self, site: str) -> Path:
        return self.root / "sites" / site

    def approve(self, site: str, study: Path | None = None) -> None:
        """The hospital's privacy officer approves `study` (default: the served one), as
        `medfed site approve STUDY --state STATE --yes` pins it."""
        Approvals(self.site_state(site)).approve_study(load_study(study or self.study))

    def start_site(self, site: str, data: Path, *extra: str,
                   approved: bool = True) -> ManagedProcess:
        """`site run --once` on `data`, the served study approved first (`approved`); a
        site started again logs as SITE-2, SITE-3..."""
        if approved:
            self.approve(site)
        self._starts[site] = self._starts.get(site, 0) + 1
        count = self._starts[site]
        proc = ManagedProcess(
            site if count == 1 else f"{site}-{count}",
            service_argv("site", "run", "--pki", str(self.pki), "--site", site,
                        "--coordinator", f"127.0.0.1:{self.port}",
                        "--metrics-listen", "127.0.0.1:0", "--state", str(self.site_state(site)),
                        "--data", str(data), "--once", *extra),
            log_dir=self.logs, env=PROCESS_ENV, cwd=REPO,
        )
        self.processes.append(proc)
        return proc


# ------------------------------------------------------------------ README blocks

README = REPO / "README.md"
README_SITES = ["st-marys", "county", "riverside"]


def readme_blocks() -> dict[str, str]:
    """README.md's shell blocks tagged ``<!-- readme-test: NAME -->``, by name."""
    pattern = re.compile(r"<!-- readme-test: ([\w-]+) -->\n```sh\n(.*?)```", re.S)
    return dict(pattern.findall(README.read_text(encoding="utf-8")))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Readme:
    """Runs README blocks as written, substituting paths, ports, site and file names
    (nothing else), with `medfed` on PATH as a shim to this checkout."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.blocks = readme_blocks()
        shim = root / "bin" / "medfed"
        shim.parent.mkdir()
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m common.commands.cli "$@"\n')
        shim.chmod(0o755)
        self.env = {
            "PATH": f"{shim.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            **PROCESS_ENV,
        }

    def command(self, name: str, site: str = README_SITES[0]) -> str:
        table = {
            "fl.example.org:7443": f"127.0.0.1:{self.port}",
            "fl.example.org": "127.0.0.1",
            "0.0.0.0:7443": f"127.0.0.1:{self.port}",
            "127.0.0.1:9464": "127.0.0.1:0",
            "127.0.0.1:9465": "127.0.0.1:0",
            "/var/lib/medfed-site": str(self.root / "state" / site),
            "/var/lib/medfed": str(self.root / "state" / "coordinator"),
            "/data/encounters.csv": str(self.root / f"{site}.csv"),
            "st-marys.csv": str(self.root / f"{README_SITES[0]}.csv"),
            "deploy/config/": str(REPO / "deploy" / "config") + "/",
            "st-marys": site,
        }
        # One pass, longest match first: nothing is substituted twice.
        pattern = re.compile("|".join(re.escape(k) for k in sorted(table, key=len, reverse=True)))
        return pattern.sub(lambda m: table[m.group(0)], self.blocks[name])

    def run(self, command: str) -> str:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command], cwd=self.root,
            env={**os.environ, **self.env}, capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start(self, name: str, command: str) -> ManagedProcess:
        return ManagedProcess(name, ["bash", "-c", "exec " + command], env=self.env,
                              log_dir=self.root / "logs", cwd=self.root)

    def set_up_pki(self) -> None:
        """The README's PKI blocks: each hospital's key and CSR, the operator's CA,
        coordinator and monitor certificates, and every hospital's CSR signed."""
        for site in README_SITES:
            self.run(self.command("hospital-key", site))
        self.run(self.command("operator-pki"))
        sign = [line for line in self.blocks["operator-pki"].splitlines() if "st-marys" in line]
        for site in README_SITES[1:]:
            self.run("\n".join(line.replace("st-marys", site) for line in sign))
