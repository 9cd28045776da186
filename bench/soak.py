"""`medfed bench soak` (`make soak`): a long federation under churn, to find leaks.

Real processes over mutual TLS on 127.0.0.1: a temporary PKI, one coordinator and N site
agents (`bench.transport_site`'s deterministic double: rounds cost transport and SecAgg+
only). Every `--kill-every` seconds one site (round robin) is killed with SIGKILL,
wherever its round is, and restarted at once: it rejoins with its state folder, as a
crashed hospital container would. The coordinator runs until `--minutes` have passed.

Printed at the end: rounds completed and aborted, sites killed, the coordinator's RSS and
open file descriptors at the start (after its first completed round, so imports and the
first buffers are in) and at the end, and the RSS growth per round: the least-squares
slope of RSS against round number over the second half of the run (the first half
includes allocator warm-up). A leak shows as a slope that does not fall as the run gets
longer; allocator noise is a few kB either way.

With ``--diagnose FILE`` the coordinator runs under `bench.soak_probe`, which samples
its memory every ``--diagnose-every`` seconds (RSS by mapping kind, glibc's heap in use
and free, SQLite's own allocations, the objects the garbage collector tracks and, with
``--tracemalloc FRAMES``, the Python tracebacks whose memory grew most); FILE gets
the samples, each with the rounds completed when it was taken, and the summary.

The soak fails (exit 1) when a round aborted for a reason other than the injected kills:
an abort counts as caused by a kill only when one of the round's participants was killed
within `ROUND_DEADLINES` phase deadlines before it. Aborts before the first completed
round (start-up on a loaded machine) are reported apart and do not fail the run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.instrumented import instrumented_argv
from common.core.errors import ConfigError
from common.core.parsing import parse_json
from common.core.processes import Line, ManagedProcess
from common.protocol import pki

REPO = Path(__file__).resolve().parents[1]
# A round's whole life in phase deadlines (training, the SecAgg+ phases, selection and
# slack): a kill further back than this did not cause an abort.
ROUND_DEADLINES = 8


@dataclass(frozen=True)
class AbortRecord:
    """One `round_aborted` line of the coordinator, with when the soak read it."""

    round_number: int
    reason: str
    participants: tuple[str, ...]
    at: float  # time.monotonic() when read

    @classmethod
    def from_line(cls, line: Line, *, at: float) -> AbortRecord:
        named = str(line.get("participants", ""))
        return cls(int(line.get("round_number", 0)), str(line.get("reason", "")),
                   tuple(p for p in named.split(",") if p), at)


def unexplained_aborts(
    aborts: list[AbortRecord], kills: list[tuple[str, float]], *, window: float,
    measured_from: float,
) -> list[AbortRecord]:
    """The aborts (read at or after `measured_from`) that no injected kill explains: none
    of the round's participants was killed within `window` seconds before the abort."""
    return [
        abort for abort in aborts
        if abort.at >= measured_from and not any(
            site in abort.participants and abort.at - window <= killed_at <= abort.at
            for site, killed_at in kills
        )
    ]


def proc_rss_bytes(pid: int) -> int:
    """VmRSS of a live process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def least_squares_slope(points: list[tuple[float, float]]) -> float | None:
    """Slope of y against x (None with fewer than 3 points)."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx


@dataclass
class SoakRecord:
    """What the coordinator's log lines told us, updated from its reader thread."""

    completed: int = 0
    aborted: int = 0
    aborts: list[AbortRecord] = field(default_factory=list)
    # (round number, coordinator RSS right after that round completed)
    rss_by_round: list[tuple[int, int]] = field(default_factory=list)
    # probe sample number -> (rounds completed, latest round number) when it was taken
    probe_rounds: dict[int, tuple[int, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Soak:
    def __init__(self, root: Path, *, sites: int, dim: int, phase_seconds: float,
                 diagnose_every: float | None = None, tracemalloc_frames: int = 0,
                 sqlite_heap_limit: int = 0) -> None:
        if sites < 3:
            raise ConfigError("--sites", "a soak needs at least 3 sites")
        if dim < 1:
            raise ConfigError("--dim", "must be >= 1")
        self.root = root
        self.site_ids = [f"site-{i:02d}" for i in range(sites)]
        self.dim = dim
        self.phase_seconds = phase_seconds
        self.pki = root / "pki"
        pki.init_ca(self.pki)
        pki.issue_coordinator(self.pki, ["127.0.0.1"])
        for site in self.site_ids:
            pki.issue_site(self.pki, site)
        self.logs = root / "logs"
        self.record = SoakRecord()
        self.coordinator: ManagedProcess | None = None
        self.sites: dict[str, ManagedProcess] = {}
        self.port = 0
        self.restarts = 0
        self.kills: list[tuple[str, float]] = []  # (site, time.monotonic() of the kill)
        self.diagnose_every = diagnose_every
        self.tracemalloc_frames = tracemalloc_frames
        self.sqlite_heap_limit = sqlite_heap_limit
        self.probe_file = root / "probe.jsonl"

    def _on_coordinator_line(self, _name: str, line: Line) -> None:
        event = line.get("event")
        coordinator = self.coordinator
        if event == "round_completed" and coordinator is not None and coordinator.alive:
            try:
                rss = proc_rss_bytes(coordinator.proc.pid)
            except (OSError, RuntimeError):
                return
            with self.record.lock:
                self.record.completed += 1
                self.record.rss_by_round.append((int(line.get("round_number", 0)), rss))
        elif event == "round_aborted":
            abort = AbortRecord.from_line(line, at=time.monotonic())
            with self.record.lock:
                self.record.aborted += 1
                self.record.aborts.append(abort)
        elif event == "probe_sample":
            with self.record.lock:
                last = self.record.rss_by_round[-1][0] if self.record.rss_by_round else 0
                self.record.probe_rounds[int(line["seq"])] = (self.record.completed, last)

    def _coordinator_argv(self, *args: str) -> list[str]:
        if self.diagnose_every is None:
            return instrumented_argv(*args)
        return [
            sys.executable, "-m", "bench.soak_probe", "--out", str(self.probe_file),
            "--every", f"{self.diagnose_every:g}", "--tracemalloc",
            str(self.tracemalloc_frames), "--sqlite-heap-limit", str(self.sqlite_heap_limit),
            "--", *args,
        ]

    def probe_samples(self) -> list[dict[str, Any]]:
        """Ask the probe for its last sample (with malloc_trim) and return them all,
        each with the rounds completed when it was taken."""
        coordinator = self.coordinator
        if coordinator is None or not coordinator.alive:
            return []
        start = len(coordinator.lines)
        coordinator.proc.send_signal(signal.SIGUSR2)
        coordinator.wait_for(
            lambda e: e.get("event") == "probe_sample" and e.get("final") is True,
            timeout=300, what="the probe's last sample", start=start,
        )
        samples = []
        with self.record.lock:
            rounds = dict(self.record.probe_rounds)
        for raw in self.probe_file.read_text().splitlines():
            sample = parse_json(raw)
            completed, last = rounds.get(int(sample["seq"]), (None, None))
            samples.append({"rounds_completed": completed, "round_number": last, **sample})
        return samples

    def start(self) -> None:
        deadline = f"{self.phase_seconds:g}"
        self.coordinator = ManagedProcess(
            "coordinator",
            self._coordinator_argv(
                "coordinator", "serve", "--pki", str(self.pki), "--listen", "127.0.0.1:0",
                "--metrics-listen", "127.0.0.1:0", "--state", str(self.root / "coordinator"),
                "--rounds", "1000000", "--min-sites", str(len(self.site_ids) - 1),
                "--model-dim", str(self.dim), "--phase-seconds", deadline,
                "--train-seconds", deadline, "--selection-seconds", "0.5",
            ),
            log_dir=self.logs, cwd=REPO, on_line=self._on_coordinator_line,
        )
        self.port = int(self.coordinator.wait_event("listening", timeout=120)["port"])
        for site in self.site_ids:
            self._start_site(site)

    def _start_site(self, site: str) -> None:
        self.sites[site] = ManagedProcess(
            site,
            [sys.executable, "-m", "bench.transport_site",
             "site", "run", "--pki", str(self.pki), "--site", site,
             "--coordinator", f"127.0.0.1:{self.port}", "--metrics-listen", "127.0.0.1:0",
             "--state", str(self.root / "sites" / site)],
            log_dir=self.logs, cwd=REPO,
        )

    def kill_and_restart(self, site: str) -> None:
        self.kills.append((site, time.monotonic()))
        self.sites[site].kill9()
        self.sites[site].stop()
        self.restarts += 1
        self._start_site(site)

    def stop(self) -> None:
        for proc in self.sites.values():
            proc.stop()
        if self.coordinator is not None:
            self.coordinator.stop()


def run(*, sites: int, minutes: float, kill_every: float, dim: int,
        phase_seconds: float, workdir: Path | None = None, progress: bool = True,
        diagnose: Path | None = None, diagnose_every: float = 30.0,
        tracemalloc_frames: int = 0, sqlite_heap_limit: int = 0) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="medfed-soak-", dir=workdir) as tmp:
        soak = Soak(
            Path(tmp), sites=sites, dim=dim, phase_seconds=phase_seconds,
            diagnose_every=diagnose_every if diagnose is not None else None,
            tracemalloc_frames=tracemalloc_frames, sqlite_heap_limit=sqlite_heap_limit,
        )
        try:
            soak.start()
            coordinator = soak.coordinator
            if coordinator is None:  # pragma: no cover - start() sets it
                raise RuntimeError("coordinator did not start")
            # The first COMPLETED round, whichever number it has: on a loaded machine
            # round 1 can abort (sites too slow to advertise keys) and never complete.
            coordinator.wait_event("round_completed", timeout=300)
            measured_from = time.monotonic()
            pid = coordinator.proc.pid
            rss_start, fds_start = proc_rss_bytes(pid), open_descriptors(pid)
            started = time.monotonic()
            end = started + minutes * 60
            next_kill = started + kill_every
            victim = 0
            while time.monotonic() < end:
                if not coordinator.alive:
                    raise RuntimeError(f"coordinator exited:\n{coordinator.tail()}")
                now = time.monotonic()
                if now >= next_kill:
                    site = soak.site_ids[victim % len(soak.site_ids)]
                    victim += 1
                    soak.kill_and_restart(site)
                    next_kill += kill_every
                    if progress:
                        with soak.record.lock:
                            done, aborted = soak.record.completed, soak.record.aborted
                        print(
                            f"[{(now - started) / 60:5.1f} min] killed {site}; rounds "
                            f"completed {done}, aborted {aborted}, coordinator RSS "
                            f"{proc_rss_bytes(pid) / 2**20:.1f} MiB, "
                            f"fds {open_descriptors(pid)}",
                            flush=True,
                        )
                time.sleep(min(1.0, max(0.0, min(next_kill, end) - time.monotonic())))
            rss_end, fds_end = proc_rss_bytes(pid), open_descriptors(pid)
            if diagnose is not None:
                samples = soak.probe_samples()
            # Counted after the probe's last sample: rounds go on completing while it is
            # taken, and the totals must cover every sample's count.
            with soak.record.lock:
                completed, aborted = soak.record.completed, soak.record.aborted
                series = list(soak.record.rss_by_round)
                aborts = list(soak.record.aborts)
        finally:
            soak.stop()
    second_half = series[len(series) // 2 :]
    slope = least_squares_slope([(float(r), float(b)) for r, b in second_half])
    whole = least_squares_slope([(float(r), float(b)) for r, b in series])
    result: dict[str, Any] = {
        "sites": sites,
        "minutes": minutes,
        "kill_every_seconds": kill_every,
        "dim": dim,
        "rounds_completed": completed,
        "rounds_aborted": aborted,
        "sites_killed": soak.restarts,
        "rounds_aborted_before_first_completed": sum(a.at < measured_from for a in aborts),
        "unexplained_aborts": [
            {"round_number": a.round_number, "reason": a.reason,
             "participants": list(a.participants)}
            for a in unexplained_aborts(aborts, soak.kills,
                                        window=ROUND_DEADLINES * phase_seconds,
                                        measured_from=measured_from)
        ],
        "coordinator_rss_start_bytes": rss_start,
        "coordinator_rss_end_bytes": rss_end,
        "coordinator_fds_start": fds_start,
        "coordinator_fds_end": fds_end,
        "rss_bytes_per_round_second_half": slope,
        "rss_bytes_per_round_whole_run": whole,
    }
    if diagnose is not None:
        result["components"] = component_slopes(samples)
        final = [s for s in samples if s.get("final")]
        if final:
            result["rss_after_malloc_trim_bytes"] = final[-1].get("rss_after_malloc_trim")
        diagnose.write_text(json.dumps({"result": result, "samples": samples}, indent=1))
    return result


# Memory components a probe sample holds: name -> path into the sample.
COMPONENTS: dict[str, tuple[str, ...]] = {
    "rss": ("rss", "VmRSS"),
    "rss_file": ("rss", "RssFile"),
    "brk_heap": ("maps", "heap"),
    "thread_arenas": ("maps", "arena64m"),
    "anonymous_mmaps": ("maps", "anon_mmap"),
    "malloc_in_use": ("malloc", "uordblks"),
    "malloc_free_kept": ("malloc", "fordblks"),
    "sqlite_memory_used": ("sqlite", "memory_used"),
    "python_traced": ("tracemalloc", "current"),
    "python_blocks": ("gc", "allocated_blocks"),
}


def component_slopes(samples: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per component: its value in the first and last periodic sample and its
    least-squares slope per completed round over the second half of the samples."""
    periodic = [s for s in samples if not s.get("final") and s.get("rounds_completed")]
    out: dict[str, dict[str, float | None]] = {}
    for name, path in COMPONENTS.items():
        points: list[tuple[float, float]] = []
        for sample in periodic:
            value: Any = sample
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, int | float):
                points.append((float(sample["rounds_completed"]), float(value)))
        if points:
            out[name] = {
                "first": points[0][1], "last": points[-1][1],
                "per_round_second_half": least_squares_slope(points[len(points) // 2 :]),
            }
    return out


def component_line(name: str, c: dict[str, float | None]) -> str:
    """One line of the --diagnose summary: first -> last value and the slope."""
    first, last, slope = c["first"] or 0.0, c["last"] or 0.0, c["per_round_second_half"]
    if name == "python_blocks":
        per = "n/a" if slope is None else f"{slope:+.3f} /round"
        return f"    {name:<20} {first:>9.0f}    -> {last:>9.0f}    ({per}, second half)"
    per = "n/a" if slope is None else f"{slope / 1024:+.3f} kB/round"
    return (f"    {name:<20} {first / 1024:>9.0f} kB -> {last / 1024:>9.0f} kB "
            f"({per}, second half)")


def format_result(result: dict[str, Any]) -> str:
    mib = 2**20

    def per_round(value: float | None) -> str:
        return "n/a" if value is None else f"{value / 1024:+.2f} kB/round"

    return "\n".join([
        f"soak: {result['sites']} sites, {result['minutes']:g} min, one site killed every "
        f"{result['kill_every_seconds']:g} s (d={result['dim']})",
        f"  rounds completed {result['rounds_completed']}, aborted {result['rounds_aborted']}, "
        f"sites killed {result['sites_killed']}",
        *[f"  ABORTED WITHOUT A KILL: round {a['round_number']}: {a['reason']}"
          for a in result["unexplained_aborts"]],
        f"  coordinator RSS {result['coordinator_rss_start_bytes'] / mib:.1f} MiB -> "
        f"{result['coordinator_rss_end_bytes'] / mib:.1f} MiB; open fds "
        f"{result['coordinator_fds_start']} -> {result['coordinator_fds_end']}",
        f"  RSS growth: {per_round(result['rss_bytes_per_round_second_half'])} (second half), "
        f"{per_round(result['rss_bytes_per_round_whole_run'])} (whole run)",
        *[component_line(name, c) for name, c in result.get("components", {}).items()],
    ])


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "soak", help="a long federation with a site killed and restarted every minute",
    )
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    parser.add_argument("--dim", type=int, default=10_000, help="model parameters")
    parser.add_argument("--phase-seconds", type=float, default=5.0)
    parser.add_argument("--workdir", type=Path, help="parent of the temporary folder")
    parser.add_argument("--json", action="store_true", help="one JSON object at the end")
    parser.add_argument(
        "--diagnose", type=Path, metavar="FILE",
        help="run the coordinator under bench.soak_probe and write its memory samples here",
    )
    parser.add_argument("--diagnose-every", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument(
        "--tracemalloc", type=int, default=0, metavar="FRAMES",
        help="with --diagnose: trace Python allocations with this many frames (slower)",
    )
    parser.add_argument(
        "--sqlite-heap-limit", type=int, default=0, metavar="BYTES",
        help="with --diagnose: cap SQLite's page cache process-wide (an experiment)",
    )
    parser.set_defaults(func=_main)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _main(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.kill_every <= 0:
        raise ConfigError("--minutes", "--minutes and --kill-every must be positive")
    # SIGTERM (make's ^C, CI) ends the run through the finally blocks: no orphans.
    signal.signal(signal.SIGTERM, _interrupt)
    result = run(
        sites=args.sites, minutes=args.minutes, kill_every=args.kill_every, dim=args.dim,
        phase_seconds=args.phase_seconds, workdir=args.workdir, progress=not args.json,
        diagnose=args.diagnose, diagnose_every=args.diagnose_every,
        tracemalloc_frames=args.tracemalloc, sqlite_heap_limit=args.sqlite_heap_limit,
    )
    print(json.dumps(result) if args.json else format_result(result), flush=True)
    unexplained = result["unexplained_aborts"]
    if unexplained:
        print(f"soak FAILED: {len(unexplained)} round(s) aborted for a reason other than "
              "the injected kills (see above)", file=sys.stderr, flush=True)
        return 1
    return 0
