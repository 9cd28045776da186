"""`medfed bench soak --diagnose`: the memory probe and the per-component summary.

The probe reads this process's own /proc files, glibc's mallinfo2 and SQLite's memory
counter; the end-to-end test runs a very short soak with the coordinator under the
probe (real processes over mTLS) and checks that the samples came back paired with
round counts and that the last one was taken after malloc_trim.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import component_slopes
from bench.soak_probe import Probe, mapping_rss, status_fields

REPO = Path(__file__).resolve().parents[2]


def test_probe_sample_splits_this_process_memory(tmp_path: Path) -> None:
    probe = Probe(tmp_path / "probe.jsonl", every=60)
    sample = probe.sample()
    rss = sample["rss"]["VmRSS"]
    assert rss > 0
    # Every mapping kind is resident memory of this process: together at most VmRSS
    # (read a moment apart, so allow a little for pages touched in between).
    kinds = {k: v for k, v in sample["maps"].items() if k != "anon_mmap"}
    assert sum(kinds.values()) <= rss + (4 << 20)
    assert sample["maps"]["anon_mmap"] == kinds["anon_1m"] + kinds["anon_other"]
    assert sample["malloc"]["uordblks"] > 0
    assert sample["gc"]["objects"] >= sum(n for _, n in sample["gc"]["top"]) > 0


def test_probe_reads_the_sqlite_library_python_uses(tmp_path: Path) -> None:
    probe = Probe(tmp_path / "probe.jsonl", every=60)
    before = probe.sample()["sqlite"]["memory_used"]
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x BLOB)")
    conn.executemany("INSERT INTO t VALUES (?)", [(b"x" * 1000,) for _ in range(500)])
    during = probe.sample()["sqlite"]["memory_used"]
    conn.close()
    assert during > before  # the page cache of the table above is counted


def test_mapping_and_status_readers_agree_on_units() -> None:
    maps = mapping_rss()
    assert maps["file"] > 0  # the interpreter and its libraries
    assert status_fields()["VmRSS"] >= maps["file"] - (4 << 20)


def test_component_slopes_fit_the_second_half_and_skip_the_final_sample() -> None:
    samples = [
        {"seq": i, "rounds_completed": 100 * (i + 1), "final": False,
         "rss": {"VmRSS": 1000 + (10 * 100 * i if i < 5 else 10 * 100 * 4)},
         "gc": {"objects": 50}}
        for i in range(10)
    ]
    samples.append({"seq": 10, "rounds_completed": 1100, "final": True,
                    "rss": {"VmRSS": 10**9}, "gc": {"objects": 10**6}})
    slopes = component_slopes(samples)
    # RSS grew 10 bytes/round over the first half and stayed flat over the second.
    assert slopes["rss"]["per_round_second_half"] == pytest.approx(0.0)
    assert slopes["rss"]["first"] == 1000 and slopes["rss"]["last"] == 5000
    assert slopes["gc_objects"]["per_round_second_half"] == pytest.approx(0.0)
    assert "sqlite_memory_used" not in slopes  # not in these samples


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_soak_diagnose_pairs_probe_samples_with_rounds(tmp_path: Path) -> None:
    out = tmp_path / "diagnosis.json"
    completed = subprocess.run(
        [sys.executable, "-m", "common.cli", "bench", "soak", "--sites", "3",
         "--minutes", "0.25", "--kill-every", "10", "--dim", "100",
         "--diagnose", str(out), "--diagnose-every", "3", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=280, check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads(out.read_text())
    samples = report["samples"]
    assert samples and samples[-1]["final"] is True
    assert samples[-1]["rss_after_malloc_trim"] > 0
    assert [s["seq"] for s in samples] == list(range(len(samples)))
    assert all(s["rounds_completed"] is not None for s in samples)
    assert report["result"]["rounds_completed"] >= samples[-1]["rounds_completed"] >= 1
    assert "sqlite_memory_used" in report["result"]["components"]
