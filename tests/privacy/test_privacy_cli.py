"""`medfed privacy` and `medfed ledger` (run as `python -m common.privacy.cli`)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from common.privacy.accountant import Segment, compose_epsilon
from common.privacy.cli import main
from common.privacy.ledger import PrivacyLedger

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_epsilon_of_two_halves_equals_the_whole(capsys: pytest.CaptureFixture[str]) -> None:
    halves = run_json(
        capsys, "privacy", "epsilon", "--delta", "1e-5", "1.0:0.01:500", "1.0:0.01:500"
    )
    whole = run_json(capsys, "privacy", "epsilon", "--delta", "1e-5", "1.0:0.01:1000")
    assert halves == whole
    assert halves["accountant"] == "prv" and halves["delta"] == 1e-5
    assert halves["epsilon"] == compose_epsilon([Segment(1.0, 0.01, 1000)], delta=1e-5)
    rdp = run_json(
        capsys, "privacy", "epsilon", "--delta", "1e-5", "--accountant", "rdp", "1.0:0.01:1000"
    )
    assert rdp["accountant"] == "rdp"
    assert float(rdp["epsilon"]) > float(whole["epsilon"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("segment", "message"),
    [
        ("1.0:0.01", "must be SIGMA:Q:STEPS"),
        ("abc:0.01:10", "SIGMA 'abc' is not a number"),
        ("1.0:x:10", "Q 'x' is not a number"),
        ("1.0:0.01:1.5", "STEPS '1.5' is not an integer"),
        ("1.0:2:10", "sample_rate"),
    ],
)
def test_bad_segment_names_the_argument(
    capsys: pytest.CaptureFixture[str], segment: str, message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["privacy", "epsilon", "--delta", "1e-5", segment])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument SIGMA:Q:STEPS" in err and message in err


def test_bad_delta_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["privacy", "epsilon", "--delta", "2", "1.0:0.01:10"]) == 2
    assert "medfed: error: delta" in capsys.readouterr().err


def test_plan_meets_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys,
        "privacy",
        "plan",
        "--target-epsilon",
        "3",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.02",
        "--steps",
        "300",
        "--accountant",
        "rdp",
    )
    sigma = float(out["noise_multiplier"])  # type: ignore[arg-type]
    spent = compose_epsilon([Segment(sigma, 0.02, 300)], delta=1e-5, accountant="rdp")
    assert 2.9 <= spent <= 3.0


def test_ledger_show_reports_rounds_budget_and_unit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "site.ledger"
    ledger = PrivacyLedger(
        path, site_id="h1", budget_epsilon=2.0, delta=1e-5, privacy_unit="patient"
    )
    ledger.reserve(0, [Segment(1.0, 0.01, 100)], now=T0)
    ledger.reserve(1, [Segment(1.0, 0.01, 100)], now=T0)
    shown = run_json(capsys, "ledger", "show", "--ledger", str(path), "--json")
    assert shown["privacy_unit"] == "patient" and shown["budget_epsilon"] == 2.0
    entries = shown["entries"]
    assert isinstance(entries, list) and [e["round"] for e in entries] == [0, 1]
    assert entries[1]["epsilon_after"] == pytest.approx(ledger.spent())
    assert entries[0]["epsilon_increase"] + entries[1]["epsilon_increase"] == pytest.approx(
        ledger.spent()
    )
    assert shown["remaining_epsilon"] == pytest.approx(2.0 - ledger.spent())
    assert main(["ledger", "show", "--ledger", str(path)]) == 0
    text = capsys.readouterr().out
    assert "patient-level DP" in text and "remaining" in text


def test_ledger_commands_in_a_real_process(tmp_path: Path) -> None:
    path = tmp_path / "site.ledger"
    PrivacyLedger(path, site_id="h1", budget_epsilon=2.0, delta=1e-5).reserve(
        0, [Segment(1.0, 0.01, 100)], now=T0
    )
    ok = subprocess.run(
        [sys.executable, "-m", "common.privacy.cli", "ledger", "verify", "--ledger", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "hash chain and epsilons verified" in ok.stdout
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "common.privacy.cli",
            "ledger",
            "show",
            "--ledger",
            str(tmp_path / "none.ledger"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 2
    assert "no ledger at" in missing.stderr


def test_installed_medfed_command_verifies_and_rejects(tmp_path: Path) -> None:
    """The real `medfed` entry point (all packages' commands loaded) runs ours."""
    medfed = Path(sys.executable).with_name("medfed")
    path = tmp_path / "site.ledger"
    PrivacyLedger(path, site_id="h1", budget_epsilon=2.0, delta=1e-5).reserve(
        0, [Segment(1.0, 0.01, 100)], now=T0
    )
    args = [str(medfed), "ledger", "verify", "--ledger", str(path), "--hashes-only"]
    ok = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE ledger_entries SET round = 5")
    bad = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1
    assert "first problem: entry seq=1: entry_hash does not match" in bad.stderr
