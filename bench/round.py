"""`medfed bench round`: one federated round with SecAgg+ vs plain FedAvg, side by side.

Real processes over mutual TLS on 127.0.0.1: a temporary PKI, one coordinator and N site
agents (`bench.transport_site`'s deterministic double, so an update costs no training
time). Each measured round gets a fresh coordinator (`--rounds 1`) and fresh sites;
secure and plain rounds alternate (S P, P S, S P, ...) so machine load affects both
alike, with the same process count, model size and transport. Sites stay up until the
round is logged as completed, so no process exit competes with the coordinator inside
the timed window.

Dropouts (K sites, both modes, so both sum N - K updates):
- secure rounds: K sites run `--debug-pause-after 1:share_keys` (they advertise
  keys and send their shares, then stop responding); they are dropped at the masked-input
  deadline and the coordinator reconstructs their pairwise masks (the expensive dropout
  case of SecAgg+; Bonawitz et al. 2017, section 4).
- plain rounds: K sites refuse plain aggregation (their policy default), so they never
  upload and are dropped at the upload deadline.

What is timed: the coordinator's round duration from round open to "round completed"
(after unmasking, the optimizer step and the checkpoint), minus the idle time each phase
spent after its last message waiting for its deadline (`deadline_wait_seconds` in the
coordinator's log). That is the cost of a round whose dropouts are detected instantly;
the deadline itself is a configuration choice, reported separately.

Exactness: every round's unmasked ring sum (coordinator `--debug-write-aggregates`;
the coordinator and sites run through `bench.instrumented`, the product has no such flag)
must equal the sum of the surviving sites' plaintext ring vectors (`--debug-write-updates`).
Memory: the coordinator's peak RSS is VmHWM from /proc/PID/status, read after the round;
each surviving site logs its VmRSS just before the model download and its VmHWM after
the round (`site_round_done`), and the worst growth is reported in models (4 d bytes).
Key latency (secure rounds): each site logs `advertised_keys` with the seconds from
receiving the announcement to sending AdvertiseKeys (noise planning runs concurrently);
the bench reports their maximum and median over sites and rounds.
Per-phase breakdown (`breakdown`): the coordinator's `t_*` steps (each phase's first and
last message and its close, the update and the record; deadline waits excluded) and the
slowest surviving site's `t_*` steps, medians over rounds, with both processes' CPU
seconds and the load average at each round's start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from bench.instrumented import instrumented_argv
from common.core.errors import ConfigError, ValidationError
from common.core.parsing import parse_json
from common.protocol import pki
from common.protocol.secagg.params import ThreatModel, choose_parameters

REPO = Path(__file__).resolve().parents[1]
ROUND_TIMEOUT_MARGIN_SECONDS = 120.0


@dataclass
class _Child:
    """A child process whose stdout/stderr JSON lines are queued by reader threads."""

    name: str
    proc: subprocess.Popen[str]
    lines: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    threads: list[threading.Thread] = field(default_factory=list)

    @classmethod
    def start(cls, name: str, argv: list[str], *, env: dict[str, str], log: Path) -> _Child:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
        )
        child = cls(name, proc)
        log_file = log.open("a")
        lock = threading.Lock()
        for stream in (proc.stdout, proc.stderr):
            thread = threading.Thread(
                target=child._read, args=(stream, log_file, lock), daemon=True
            )
            thread.start()
            child.threads.append(thread)
        return child

    def _read(self, stream: TextIO, log_file: TextIO, lock: threading.Lock) -> None:
        for raw in stream:
            with lock:
                log_file.write(raw)
            try:
                item = parse_json(raw)
            except ValidationError:
                continue
            if isinstance(item, dict):
                self.lines.put(item)

    def wait_for(self, predicate: Any, *, timeout: float, what: str) -> dict[str, Any]:
        """The first queued line matching `predicate` (event-driven, bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {self.name}: "
                                   f"{what}")
            try:
                item = self.lines.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode} before {what}"
                    ) from None
                continue
            if predicate(item):
                return item

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for thread in self.threads:
            thread.join(timeout=5)


def _transport_site(*args: str) -> list[str]:
    """`medfed` whose sites run the deterministic double (`bench.transport_site`)."""
    return [sys.executable, "-m", "bench.transport_site", *args]


def proc_status_bytes(pid: int, key: str) -> int:
    """A `kB` field of /proc/PID/status (VmRSS, VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {key}")


def colluders_for(n_sites: int, dropouts: int) -> int:
    """The largest collusion bound (<= the default of 1) that still tolerates `dropouts`."""
    for colluding in (1, 0):
        try:
            choose_parameters(n_sites, ThreatModel(colluding, dropouts))
        except ConfigError:
            continue
        return colluding
    raise ConfigError("dropouts", f"{n_sites} sites cannot tolerate {dropouts} dropouts")


@dataclass(frozen=True)
class RoundMeasurement:
    mode: str  # "secure" or "plain"
    round_seconds: float
    deadline_wait_seconds: float
    survivors: int
    exact: bool
    idle_rss_bytes: int
    peak_rss_bytes: int
    # Per surviving site: its peak RSS (VmHWM after the upload) minus its RSS just
    # before the model download (the site's `site_round_done` log event).
    site_growth_bytes: tuple[int, ...] = ()
    site_before_download_bytes: tuple[int, ...] = ()
    advertise_seconds: tuple[float, ...] = ()  # per site: announcement -> AdvertiseKeys
    # Per-phase breakdown: the coordinator's `t_*` steps (seconds from round open, deadline
    # waits excluded) and CPU seconds; each surviving site's `t_*` steps (seconds from
    # hearing of the round) and CPU seconds.
    coordinator_steps: dict[str, float] = field(default_factory=dict)
    coordinator_cpu_seconds: float = 0.0
    site_steps: tuple[dict[str, float], ...] = ()
    site_cpu_seconds: tuple[float, ...] = ()
    load_average: float = 0.0  # 1-minute load average when the round started

    @property
    def seconds(self) -> float:
        return self.round_seconds - self.deadline_wait_seconds


class RoundBench:
    """Runs single-round federations in a temporary folder."""

    def __init__(self, root: Path, *, sites: int, dim: int, dropouts: int,
                 phase_seconds: float) -> None:
        if sites < 2 or not 0 <= dropouts < sites or dim < 1:
            raise ConfigError("sites", "need sites >= 2, 0 <= dropouts < sites, dim >= 1")
        self.root = root
        self.site_ids = [f"site-{i:02d}" for i in range(sites)]
        self.dim = dim
        self.dropouts = dropouts
        self.phase_seconds = phase_seconds
        self.colluding = colluders_for(sites, dropouts) if dropouts else 1
        self.pki = root / "pki"
        pki.init_ca(self.pki)
        pki.issue_coordinator(self.pki, ["127.0.0.1"])
        for site in self.site_ids:
            pki.issue_site(self.pki, site)
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "MEDFED_COORDINATOR_AGGREGATION__MAX_COLLUDING_SITES": str(self.colluding),
            "MEDFED_SITE_POLICY__MAX_COLLUDING_SITES": str(self.colluding),
        }
        survivors = sites - dropouts
        if survivors < 3:
            # The sites' default floor (policy.min_round_sites = 3) would refuse a sum of
            # fewer sites; small benchmark federations lower it to what they keep.
            self.env["MEDFED_SITE_POLICY__MIN_ROUND_SITES"] = str(max(2, survivors))
        self.runs = 0
        self._idle_rss = 0
        self._sites: list[_Child] = []

    def run_round(self, mode: str) -> RoundMeasurement:
        self.runs += 1
        run_dir = self.root / f"run-{self.runs:02d}-{mode}"
        run_dir.mkdir()
        load = os.getloadavg()[0]
        with self._processes(run_dir, mode) as coordinator:
            completed = coordinator.wait_for(
                lambda e: str(e.get("msg", "")).startswith("round 1 completed"),
                timeout=2 * self.phase_seconds * 6 + ROUND_TIMEOUT_MARGIN_SECONDS,
                what="round 1 completed",
            )
            peak = proc_status_bytes(coordinator.proc.pid, "VmHWM")
            advertise = self._advertise_seconds() if mode == "secure" else ()
            survivors_now = set(str(completed.get("survivors", "")).split(","))
            site_memory = [
                site.wait_for(lambda e: e.get("event") == "site_round_done", timeout=60,
                              what="site_round_done")
                for site in self._sites if site.name in survivors_now
            ]
        total, survivors = self._aggregate(run_dir)
        expected = np.zeros_like(total)
        for site in survivors:
            update = np.fromfile(
                run_dir / site / "debug-updates" / "round-000001.u32", dtype="<u4"
            )
            np.add(expected, update, out=expected)
        exact = bool(np.array_equal(total, expected)) and len(survivors) == len(
            self.site_ids
        ) - self.dropouts
        return RoundMeasurement(
            mode=mode,
            round_seconds=float(completed["round_seconds"]),
            deadline_wait_seconds=float(completed["deadline_wait_seconds"]),
            survivors=len(survivors),
            exact=exact,
            idle_rss_bytes=self._idle_rss,
            peak_rss_bytes=peak,
            site_growth_bytes=tuple(
                int(e["peak_rss_bytes"]) - int(e["rss_before_download_bytes"])
                for e in site_memory
            ),
            site_before_download_bytes=tuple(
                int(e["rss_before_download_bytes"]) for e in site_memory
            ),
            advertise_seconds=advertise,
            coordinator_steps=_steps(completed),
            coordinator_cpu_seconds=float(completed.get("cpu_seconds", 0.0)),
            site_steps=tuple(_steps(e) for e in site_memory),
            site_cpu_seconds=tuple(float(e.get("cpu_seconds", 0.0)) for e in site_memory),
            load_average=load,
        )

    def _advertise_seconds(self) -> tuple[float, ...]:
        """Each site's announcement -> AdvertiseKeys seconds (its `advertised_keys` log)."""
        return tuple(
            float(site.wait_for(lambda e: e.get("event") == "advertised_keys",
                                timeout=60, what="advertised_keys")["seconds"])
            for site in self._sites
        )

    @contextlib.contextmanager
    def _processes(self, run_dir: Path, mode: str) -> Iterator[_Child]:
        deadline = f"{self.phase_seconds:g}"
        coordinator = _Child.start(
            "coordinator",
            instrumented_argv(
                "coordinator", "serve", "--pki", str(self.pki), "--listen", "127.0.0.1:0",
                "--metrics-listen", "127.0.0.1:0", "--state", str(run_dir / "coordinator"),
                "--rounds", "1", "--min-sites", str(len(self.site_ids)),
                "--model-dim", str(self.dim), "--phase-seconds", deadline,
                "--train-seconds", deadline, "--selection-seconds", "0.5",
                "--debug-write-aggregates", "--exit-when-finished", "--linger-seconds", "600",
                *(["--plain"] if mode == "plain" else []),
            ),
            env=self.env, log=run_dir / "coordinator.log",
        )
        children = [coordinator]
        self._sites = []
        try:
            listening = coordinator.wait_for(
                lambda e: e.get("event") == "listening", timeout=120, what="listening"
            )
            self._idle_rss = proc_status_bytes(coordinator.proc.pid, "VmRSS")
            for index, site in enumerate(self.site_ids):
                drops = index >= len(self.site_ids) - self.dropouts
                extra: list[str] = []
                if mode == "secure" and drops:
                    extra = ["--debug-pause-after", "1:share_keys",
                             "--debug-pause-seconds", "3600"]
                elif mode == "plain" and not drops:
                    extra = ["--allow-plain-aggregation"]
                self._sites.append(_Child.start(
                    site,
                    _transport_site(
                        "site", "run", "--pki", str(self.pki), "--site", site,
                        "--coordinator", f"127.0.0.1:{listening['port']}",
                        "--metrics-listen", "127.0.0.1:0", "--state", str(run_dir / site),
                        "--debug-write-updates", *extra,
                    ),
                    env=self.env, log=run_dir / f"{site}.log",
                ))
            yield coordinator
        finally:
            for child in [*reversed(self._sites), *reversed(children)]:
                child.stop()

    @staticmethod
    def _aggregate(run_dir: Path) -> tuple[np.ndarray, list[str]]:
        folder = run_dir / "coordinator" / "aggregates"
        total = np.fromfile(folder / "round-000001.u32", dtype="<u4")
        survivors = (folder / "round-000001.survivors").read_text().split()
        return total, survivors


def _steps(event: dict[str, Any]) -> dict[str, float]:
    """The `t_<step>` fields of a log event, by step."""
    return {key[2:]: float(value) for key, value in event.items()
            if key.startswith("t_") and isinstance(value, int | float)}


def breakdown(measured: list[RoundMeasurement]) -> dict[str, Any]:
    """Per mode, the median over rounds of each coordinator step and of each site step
    at the slowest surviving site (the one the round waits for), and CPU seconds."""
    out: dict[str, Any] = {}
    for mode in ("secure", "plain"):
        rounds = [m for m in measured if m.mode == mode]
        coordinator = {
            step: round(statistics.median(m.coordinator_steps[step] for m in rounds
                                          if step in m.coordinator_steps), 4)
            for step in sorted({s for m in rounds for s in m.coordinator_steps})
        }
        site = {
            step: round(statistics.median(
                max(st[step] for st in m.site_steps if step in st)
                for m in rounds if any(step in st for st in m.site_steps)
            ), 4)
            for step in sorted({s for m in rounds for st in m.site_steps for s in st})
        }
        out[mode] = {
            "coordinator_steps": dict(sorted(coordinator.items(), key=lambda kv: kv[1])),
            "slowest_site_steps": dict(sorted(site.items(), key=lambda kv: kv[1])),
            "coordinator_cpu_seconds": round(
                statistics.median(m.coordinator_cpu_seconds for m in rounds), 4),
            "site_cpu_seconds": round(statistics.median(
                c for m in rounds for c in m.site_cpu_seconds), 4) if any(
                m.site_cpu_seconds for m in rounds) else 0.0,
        }
    return out


def default_phase_seconds(*, sites: int, dim: int) -> float:
    """A deadline honest sites meet on a loaded 2-core machine (about 1 s per 4 MB sent)."""
    return 2.0 + 1e-6 * sites * dim


def run(*, sites: int, dim: int, dropouts: int, rounds: int,
        phase_seconds: float | None = None, workdir: Path | None = None) -> dict[str, Any]:
    """Alternate secure and plain single-round federations; medians and exactness."""
    phase = phase_seconds or default_phase_seconds(sites=sites, dim=dim)
    with tempfile.TemporaryDirectory(prefix="medfed-bench-round-", dir=workdir) as tmp:
        bench = RoundBench(Path(tmp), sites=sites, dim=dim, dropouts=dropouts,
                           phase_seconds=phase)
        measured: list[RoundMeasurement] = []
        for rep in range(rounds):
            order = ("secure", "plain") if rep % 2 == 0 else ("plain", "secure")
            for mode in order:
                measured.append(bench.run_round(mode))
    growth = [g for m in measured for g in m.site_growth_bytes]
    secure = [m for m in measured if m.mode == "secure"]
    plain = [m for m in measured if m.mode == "plain"]
    secure_s = statistics.median(m.seconds for m in secure)
    plain_s = statistics.median(m.seconds for m in plain)
    return {
        "sites": sites,
        "dim": dim,
        "dropouts": dropouts,
        "rounds": rounds,
        "phase_seconds": phase,
        "max_colluding_sites": bench.colluding,
        "model_bytes": 4 * dim,
        "exact": all(m.exact for m in measured),
        "secure_seconds": secure_s,
        "plain_seconds": plain_s,
        "ratio": secure_s / plain_s,
        "secure_round_seconds": [round(m.round_seconds, 4) for m in secure],
        "secure_deadline_wait_seconds": [round(m.deadline_wait_seconds, 4) for m in secure],
        "plain_round_seconds": [round(m.round_seconds, 4) for m in plain],
        "plain_deadline_wait_seconds": [round(m.deadline_wait_seconds, 4) for m in plain],
        "coordinator_idle_rss_bytes": max(m.idle_rss_bytes for m in measured),
        "coordinator_peak_rss_bytes": max(m.peak_rss_bytes for m in secure),
        "plain_coordinator_peak_rss_bytes": max(m.peak_rss_bytes for m in plain),
        # Site memory over the model-sized work of a round, worst site of any round.
        "site_peak_growth_bytes": max(growth, default=0),
        "site_peak_growth_models": max(growth, default=0) / (4 * dim),
        "site_rss_before_download_bytes": max(
            (b for m in measured for b in m.site_before_download_bytes), default=0
        ),
        **advertise_summary(secure),
        "load_average": [round(m.load_average, 2) for m in measured],
        "breakdown": breakdown(measured),
    }


def advertise_summary(secure: list[RoundMeasurement]) -> dict[str, float]:
    """Announcement -> AdvertiseKeys over every site of every secure round (target
    <= 1 s at every site: key phases never wait for noise calibration)."""
    seconds = [s for m in secure for s in m.advertise_seconds]
    if not seconds:
        return {}
    return {"advertise_keys_max_seconds": max(seconds),
            "advertise_keys_median_seconds": statistics.median(seconds)}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sites", type=int, default=10, help="site agent processes")
    parser.add_argument("--dim", type=int, default=1_000_000, help="model parameters (float32)")
    parser.add_argument("--dropouts", type=int, default=2, help="sites dropped in every round")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per mode")
    parser.add_argument(
        "--phase-seconds", type=float, default=None,
        help="phase deadline (default 2 s + 1 s per 10^6 elements sent); its idle part is "
        "excluded from the timing",
    )
    parser.add_argument("--json", action="store_true", help="last line is a JSON object")


def main_from_args(args: argparse.Namespace) -> int:
    result = run(sites=args.sites, dim=args.dim, dropouts=args.dropouts, rounds=args.rounds,
                 phase_seconds=args.phase_seconds)
    mib = 1 << 20
    print(
        f"federated round, {result['sites']} site processes, d={result['dim']} "
        f"({result['model_bytes'] / mib:.1f} MiB float32), {result['dropouts']} dropouts, "
        f"mTLS on 127.0.0.1, median of {result['rounds']} round(s) per mode "
        f"(deadline idle excluded; phase deadline {result['phase_seconds']:g} s)"
    )
    print(f"  plain FedAvg    {result['plain_seconds']:8.3f} s")
    print(f"  SecAgg+         {result['secure_seconds']:8.3f} s   {result['ratio']:.2f}x plain")
    print(f"  exact sum of survivors: {result['exact']}")
    loads = result["load_average"]
    print(f"  1-minute load average at round starts: {min(loads):.1f} to {max(loads):.1f}")
    for mode, parts in result["breakdown"].items():
        print(f"  {mode}: coordinator CPU {parts['coordinator_cpu_seconds']:.3f} s, "
              f"site CPU {parts['site_cpu_seconds']:.3f} s (medians)")
        print("    coordinator: " + ", ".join(
            f"{step} {sec:.3f}" for step, sec in parts["coordinator_steps"].items()))
        print("    slowest site: " + ", ".join(
            f"{step} {sec:.3f}" for step, sec in parts["slowest_site_steps"].items()))
    if "advertise_keys_max_seconds" in result:
        print(
            f"  announcement -> AdvertiseKeys per site: max "
            f"{result['advertise_keys_max_seconds']:.3f} s, median "
            f"{result['advertise_keys_median_seconds']:.3f} s"
        )
    print(
        f"  coordinator RSS: idle {result['coordinator_idle_rss_bytes'] / mib:.0f} MiB, "
        f"peak {result['coordinator_peak_rss_bytes'] / mib:.0f} MiB secure, "
        f"{result['plain_coordinator_peak_rss_bytes'] / mib:.0f} MiB plain"
    )
    print(
        f"  site peak RSS above its RSS before the download: "
        f"{result['site_peak_growth_bytes'] / mib:.0f} MiB = "
        f"{result['site_peak_growth_models']:.2f} models (worst site; "
        f"RSS before download {result['site_rss_before_download_bytes'] / mib:.0f} MiB)"
    )
    if args.json:
        print(json.dumps(result))
    return 0 if result["exact"] else 1


def register(bench_subparsers: Any) -> None:
    """Add ``round`` to ``medfed bench``."""
    parser = bench_subparsers.add_parser(
        "round", help="SecAgg+ vs plain FedAvg round over mTLS with real processes"
    )
    _add_arguments(parser)
    parser.set_defaults(func=main_from_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="medfed bench round", description=__doc__)
    _add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
