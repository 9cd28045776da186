"""Real OS processes for end-to-end tests: a coordinator and site agents over mTLS.

Processes print JSON lines (events on stdout, structured logs on stderr); reader threads
collect them and tests wait on conditions over those lines (no sleeps as sync).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def medfed(*args: str) -> list[str]:
    return [sys.executable, "-m", "common.cli", *args]


def run_medfed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(medfed(*args), check=True, capture_output=True, text=True, cwd=REPO)


class Process:
    """A child process whose stdout/stderr JSON lines are collected as events."""

    def __init__(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                 log_dir: Path) -> None:
        self.name = name
        self.lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._log = open(log_dir / f"{name}.log", "a")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env=full_env,
        )
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr,), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream: Any) -> None:
        for raw in stream:
            self._log.write(raw)
            self._log.flush()
            try:
                item = json.loads(raw)
            except ValueError:
                item = {"text": raw.rstrip()}
            if not isinstance(item, dict):
                item = {"text": raw.rstrip()}
            with self._cond:
                self.lines.append(item)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], *, timeout: float,
                 what: str) -> dict[str, Any]:
        """Block until a line satisfies `predicate` (event-driven, bounded by timeout)."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for item in self.lines[seen:]:
                    if predicate(item):
                        return item
                seen = len(self.lines)
                if self.proc.poll() is not None and all(not t.is_alive() for t in self._threads):
                    raise AssertionError(f"{self.name} exited ({self.proc.returncode}) "
                                         f"before: {what}\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for {self.name}: {what}\n"
                                         f"{self.tail()}")
                self._cond.wait(min(remaining, 1.0))

    def wait_log(self, fragment: str, *, timeout: float = 60) -> dict[str, Any]:
        return self.wait_for(lambda e: fragment in str(e.get("msg", e.get("text", ""))),
                             timeout=timeout, what=repr(fragment))

    def wait_event(self, event: str, *, timeout: float = 60, **fields: Any) -> dict[str, Any]:
        return self.wait_for(
            lambda e: e.get("event") == event and all(e.get(k) == v for k, v in fields.items()),
            timeout=timeout, what=f"event {event} {fields}",
        )

    def tail(self, n: int = 15) -> str:
        with self._cond:
            return "\n".join(json.dumps(x) for x in self.lines[-n:])

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill9()
        for t in self._threads:
            t.join(timeout=5)
        self._log.close()

    def wait_exit(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)


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
        self.coordinator: Process | None = None
        self.site_procs: dict[str, Process] = {}
        self.port = 0
        self._restarts = 0

    def start_coordinator(self, *extra: str, port: int | None = None) -> Process:
        listen = f"127.0.0.1:{port if port is not None else 0}"
        self._restarts += 1
        proc = Process(
            f"coordinator-{self._restarts}",
            medfed("coordinator", "serve", "--pki", str(self.pki), "--listen", listen,
                   "--metrics-listen", "127.0.0.1:0", "--state", str(self.root / "coordinator"),
                   "--debug-write-aggregates", "--linger-seconds", "3", *extra),
            env=self.env, log_dir=self.logs,
        )
        event = proc.wait_event("listening", timeout=60)
        self.port = int(event["port"])
        self.coordinator = proc
        return proc

    def start_site(self, site: str, *extra: str) -> Process:
        proc = Process(
            site,
            medfed("site", "run", "--pki", str(self.pki), "--site", site,
                   "--coordinator", f"127.0.0.1:{self.port}", "--metrics-listen", "127.0.0.1:0",
                   "--state", str(self.root / "sites" / site), "--trainer", "test-deterministic",
                   "--debug-write-updates", *extra),
            env=self.env, log_dir=self.logs,
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
