"""`medfed bench query-coverage` runs as documented (docs/benchmarks.md) and reports a
coverage that means something: every statistic kind of the query is there, and the
intervals cover the pooled exact answer about as often as they say (95%)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_coverage_benchmark_reports_every_statistic_near_its_nominal_level() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.query_coverage", "--draws", "25", "--patients", "120",
         "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    kinds = {row["statistic"] for row in result["rows"]}
    assert kinds == {"patients", "mortality", "age", "wards", "survival"}
    assert all(sigma > 1 for sigma in result["noise_sigmas"])  # the noise is real
    # ~500 estimates at nominal 0.95: below 0.85 would be a broken interval.
    assert 0.85 <= result["overall_coverage"] <= 1.0
    assert all(row["median_width"] > 0 for row in result["rows"])


def test_a_bad_setting_is_refused_naming_the_flag() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.query_coverage", "--draws", "0"],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "--draws" in done.stderr
