"""`medfed bench round` end to end: real coordinator and site processes over mTLS.

Small (3 sites, d = 1000, one dropout, one round per mode) so it stays well under 40 s;
what it checks is that the benchmark really ran both modes and that the secure round's
unmasked aggregate equals the survivors' plaintext sum (the benchmark's own check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.round import colluders_for, proc_status_bytes

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_bench_round_small_federation_is_exact() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "common.commands.cli", "bench", "round", "--sites", "3",
         "--dim", "1000",
         "--dropouts", "1", "--rounds", "1", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=110, check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["exact"] is True
    assert result["sites"] == 3 and result["dropouts"] == 1
    # One dropout among 3 sites needs t = 2, which a collusion bound of 1 does not allow.
    assert result["max_colluding_sites"] == 0
    assert result["secure_seconds"] > 0 and result["plain_seconds"] > 0
    assert result["ratio"] == pytest.approx(result["secure_seconds"] / result["plain_seconds"])
    # Both modes dropped their site at a deadline, and that idle wait was measured.
    assert result["secure_deadline_wait_seconds"][0] > 0
    assert result["plain_deadline_wait_seconds"][0] > 0
    assert result["coordinator_peak_rss_bytes"] >= result["coordinator_idle_rss_bytes"] > 0
    assert result["model_bytes"] == 4000
    # Every surviving site reported its memory around the model-sized work.
    assert result["site_rss_before_download_bytes"] > 0
    assert result["site_peak_growth_bytes"] >= 0
    assert result["site_peak_growth_models"] == pytest.approx(
        result["site_peak_growth_bytes"] / 4000
    )
    # The per-phase breakdown: every secure phase closed, in order, and both modes
    # timed the sites' steps and the processes' CPU.
    secure, plain = result["breakdown"]["secure"], result["breakdown"]["plain"]
    closes = [secure["coordinator_steps"][f"{phase}.closed"] for phase in (
        "advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask")]
    assert closes == sorted(closes)
    assert closes[-1] <= secure["coordinator_steps"]["recorded"]
    assert "masked_input.closed" in plain["coordinator_steps"]
    assert "advertise_keys.closed" not in plain["coordinator_steps"]
    for step in ("roster", "shares", "masked", "uploaded", "recorded"):
        assert step in secure["slowest_site_steps"]
    assert "recorded" in plain["slowest_site_steps"] and "masked" not in plain[
        "slowest_site_steps"]
    assert secure["coordinator_cpu_seconds"] > 0 and plain["site_cpu_seconds"] > 0
    assert len(result["load_average"]) == 2


def test_colluders_for_picks_the_largest_bound_that_tolerates_the_dropouts() -> None:
    assert colluders_for(10, 2) == 1
    assert colluders_for(3, 1) == 0


def test_proc_status_reads_this_process_memory() -> None:
    rss = proc_status_bytes(os.getpid(), "VmRSS")
    assert proc_status_bytes(os.getpid(), "VmHWM") >= rss > 0  # the peak is read after
