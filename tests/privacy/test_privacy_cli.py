"""`medfed privacy` and `medfed ledger` (run as `python -m common.commands.privacy`)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from common.commands.privacy import main
from common.privacy.accountant import Segment, account, compose_epsilon
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import DistributedDiscreteGaussian, Gaussian
from tests.privacy.conftest import Pki

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
    assert "argument MECHANISM" in err and message in err


def test_epsilon_accepts_every_mechanism_kind(capsys: pytest.CaptureFixture[str]) -> None:
    ddg = DistributedDiscreteGaussian(noise_variance_per_site=400.0, contributors=4,
                                      l2_sensitivity=30.0, dimension=1024, l1_sensitivity=90.0)
    expected = account([Segment(1.0, 0.01, 200), Gaussian(8.0, 1.0, 2), ddg], delta=1e-5,
                       accountant="pld")
    out = run_json(capsys, "privacy", "epsilon", "--delta", "1e-5", "--accountant", "pld",
                   "1.0:0.01:200", "gaussian:8:1:2", "ddgauss:400:4:30:1024:90")
    assert out["epsilon"] == expected.epsilon
    assert out["accountant"] == "rdp" and out["requested_accountant"] == "pld"
    assert "distributed discrete Gaussian" in str(out["note"])
    as_json = run_json(capsys, "privacy", "epsilon", "--delta", "1e-5", "--accountant", "pld",
                       '{"kind": "gaussian", "noise_std": 8.0, "l2_sensitivity": 1.0, '
                       '"count": 2}', "sampled_gaussian:1.0:0.01:200",
                       json.dumps(ddg.to_json_dict()))
    assert as_json == out
    plain = run_json(capsys, "privacy", "epsilon", "--delta", "1e-5", "--accountant", "pld",
                     "gaussian:8:1")
    assert plain["accountant"] == "pld" and "note" not in plain


@pytest.mark.parametrize(
    ("mechanism", "message"),
    [
        ("gaussian:1", "gaussian:NOISE_STD:L2_SENSITIVITY[:COUNT]"),
        ("gaussian:x:1", "NOISE_STD 'x' is not a number"),
        ("ddgauss:1:2:3", "ddgauss:VARIANCE_PER_SITE:CONTRIBUTORS"),
        ("ddgauss:4:2.5:3:10", "CONTRIBUTORS must be an integer"),
        ("ddgauss:0.1:2:3:10", "noise_variance_per_site"),
        ('{"kind": "laplace"}', "unknown mechanism kind"),
    ],
)
def test_bad_mechanism_names_the_argument(
    capsys: pytest.CaptureFixture[str], mechanism: str, message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["privacy", "epsilon", "--delta", "1e-5", mechanism])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument MECHANISM" in err and message in err


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


def site_ledger(path: Path, pki_material: Pki, **options: object) -> PrivacyLedger:
    return PrivacyLedger(path, site_id="hospital-a", budget_epsilon=2.0, delta=1e-5,
                         signer=pki_material.signer_a, **options)  # type: ignore[arg-type]


def test_ledger_show_reports_rounds_budget_unit_and_purposes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pki_material: Pki
) -> None:
    path = tmp_path / "site.ledger"
    ledger = site_ledger(path, pki_material, privacy_unit="patient")
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
    ledger.reserve(1, [Gaussian(40.0, 1.0)], now=T0, purpose="evaluation")
    shown = run_json(capsys, "ledger", "show", "--ledger", str(path), "--json")
    assert set(shown["epsilon_by_purpose"]) == {"training", "evaluation"}  # type: ignore[call-overload]
    assert shown["entries"][2]["mechanisms"] == [  # type: ignore[index]
        {"kind": "gaussian", "noise_std": 40.0, "l2_sensitivity": 1.0, "count": 1}]
    assert main(["ledger", "show", "--ledger", str(path)]) == 0
    text = capsys.readouterr().out
    assert "evaluation" in text and "Gaussian: noise std 40" in text


def test_plan_round_from_a_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pki_material: Pki
) -> None:
    path = tmp_path / "site.ledger"
    ledger = PrivacyLedger(path, site_id="hospital-a", budget_epsilon=4.0, delta=1e-5,
                           accountant="pld", signer=pki_material.signer_a)
    ledger.reserve(0, [Segment(1.0, 0.02, 50)], now=T0)
    out = run_json(capsys, "privacy", "plan-round", "--ledger", str(path), "--sample-rate",
                   "0.02", "--steps-per-round", "20", "--remaining-rounds", "4",
                   "--max-epsilon-per-round", "0.3")
    assert out["epsilon_spent"] == pytest.approx(ledger.spent())
    assert float(out["round_epsilon"]) <= 0.3  # type: ignore[arg-type]
    assert float(out["epsilon_after_plan"]) <= 4.0  # type: ignore[arg-type]


def test_ledger_commands_in_a_real_process(tmp_path: Path, pki_material: Pki) -> None:
    path = tmp_path / "site.ledger"
    site_ledger(path, pki_material).reserve(
        0, [Segment(1.0, 0.01, 100)], now=T0
    )
    ok = subprocess.run(
        [sys.executable, "-m", "common.commands.privacy", "ledger", "verify", "--ledger",
         str(path)],
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
            "common.commands.privacy",
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
    assert "no privacy ledger at" in missing.stderr and "Traceback" not in missing.stderr


def test_installed_medfed_command_verifies_and_rejects(
    tmp_path: Path, pki_material: Pki
) -> None:
    """The real `medfed` entry point (all packages' commands loaded) runs ours."""
    medfed = Path(sys.executable).with_name("medfed")
    path = tmp_path / "site.ledger"
    site_ledger(path, pki_material).reserve(
        0, [Segment(1.0, 0.01, 100)], now=T0
    )
    args = [str(medfed), "ledger", "verify", "--ledger", str(path), "--hashes-only"]
    ok = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE ledger_entries SET round = 5")
    bad = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 1
    assert "first problem: entry seq=1: unreadable entry" in bad.stderr

