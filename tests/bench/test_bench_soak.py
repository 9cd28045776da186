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

from bench.soak import AbortRecord, component_slopes, unexplained_aborts
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
    assert sample["gc"]["allocated_blocks"] > 0


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
         "gc": {"allocated_blocks": 50}}
        for i in range(10)
    ]
    samples.append({"seq": 10, "rounds_completed": 1100, "final": True,
                    "rss": {"VmRSS": 10**9}, "gc": {"allocated_blocks": 10**6}})
    slopes = component_slopes(samples)
    # RSS grew 10 bytes/round over the first half and stayed flat over the second.
    assert slopes["rss"]["per_round_second_half"] == pytest.approx(0.0)
    assert slopes["rss"]["first"] == 1000 and slopes["rss"]["last"] == 5000
    assert slopes["python_blocks"]["per_round_second_half"] == pytest.approx(0.0)
    assert "sqlite_memory_used" not in slopes  # not in these samples


def _aborted(round_number: int, reason: str, participants: str, *, at: float) -> AbortRecord:
    """A `round_aborted` line as the coordinator logs it (coordinator/round_events.py)."""
    line = {"level": "warning", "event": "round_aborted", "round_number": round_number,
            "participants": participants, "reason": reason,
            "message": f"round {round_number} aborted: {reason}"}
    return AbortRecord.from_line(line, at=at)


def test_an_abort_right_after_a_participant_was_killed_is_explained() -> None:
    aborts = [_aborted(40, "too_few_participants: no site uploaded",
                       "site-00,site-01,site-02", at=100.0)]
    assert unexplained_aborts(aborts, [("site-01", 95.0)], window=40.0,
                              measured_from=10.0) == []


def test_an_abort_no_kill_explains_fails_the_soak() -> None:
    not_a_participant = _aborted(41, "round_abandoned: round ended", "site-00,site-02",
                                 at=100.0)
    killed_long_before = _aborted(42, "wrong_session: session id does not match",
                                  "site-00,site-01,site-02", at=300.0)
    killed_after = _aborted(43, "round_abandoned: round ended", "site-00,site-01",
                            at=400.0)
    kills = [("site-01", 95.0), ("site-01", 410.0)]
    found = unexplained_aborts([not_a_participant, killed_long_before, killed_after], kills,
                               window=40.0, measured_from=10.0)
    assert [a.round_number for a in found] == [41, 42, 43]
    assert found[0].participants == ("site-00", "site-02")


def test_aborts_before_the_first_completed_round_do_not_fail_the_soak() -> None:
    warm_up = _aborted(1, "too_few_participants: fewer sites advertised keys", "site-00",
                       at=5.0)
    assert unexplained_aborts([warm_up], [], window=40.0, measured_from=10.0) == []


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_soak_diagnose_pairs_probe_samples_with_rounds(tmp_path: Path) -> None:
    out = tmp_path / "diagnosis.json"
    completed = subprocess.run(
        [sys.executable, "-m", "common.commands.cli", "bench", "soak", "--sites", "3",
         "--minutes", "0.25", "--kill-every", "10", "--dim", "100",
         "--diagnose", str(out), "--diagnose-every", "3", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=280, check=False,
    )
    # Exit 0 also means no round aborted for a reason other than the injected kills.
    assert completed.returncode == 0, completed.stdout + completed.stderr
    report = json.loads(out.read_text())
    assert report["result"]["unexplained_aborts"] == []
    samples = report["samples"]
    assert samples and samples[-1]["final"] is True
    assert samples[-1]["rss_after_malloc_trim"] > 0
    assert [s["seq"] for s in samples] == list(range(len(samples)))
    assert all(s["rounds_completed"] is not None for s in samples)
    assert report["result"]["rounds_completed"] >= samples[-1]["rounds_completed"] >= 1
    assert "sqlite_memory_used" in report["result"]["components"]
