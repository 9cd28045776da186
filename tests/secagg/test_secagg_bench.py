"""`medfed bench secagg` runs a real round and reports an exact, well-formed result."""

from __future__ import annotations

import json

import pytest

from bench.secagg import CLIENT_PHASES
from bench.secagg import main as bench_main
from common.commands.cli import main as medfed_main


@pytest.mark.parametrize(
    ("args", "survivors"),
    [
        (["--sites", "5", "--dim", "2000", "--dropouts", "1"], 5),
        (["--sites", "5", "--dim", "2000", "--dropouts", "1", "--drop-after", "shares"], 4),
        (
            [
                *("--sites", "24", "--dim", "500", "--dropouts", "3"),
                *("--neighbors", "auto", "--signature", "ecdsa-p256-sha256"),
            ],
            24,
        ),
    ],
)
def test_bench_secagg_json_reports_an_exact_round(
    args: list[str], survivors: int, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench_main([*args, "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert code == 0
    assert result["exact"] is True
    assert result["survivors"] == survivors
    assert result["sites"] == int(args[1]) and result["dim"] == int(args[3])
    assert result["dropouts"] == int(args[5])
    assert 0 < result["client_seconds"]["mean"] <= result["client_seconds"]["max"]
    assert result["server_seconds"] > 0
    assert 0 < result["client_cpu_seconds"]["mean"] <= result["client_cpu_seconds"]["max"]
    assert set(result["phases"]["client"]) == set(CLIENT_PHASES)
    assert result["server_seconds"] == pytest.approx(sum(result["phases"]["server"].values()))
    if result["sites"] > 20:
        assert result["neighbours"] > 0  # SecAgg+ neighbourhoods, not the complete graph
    assert "exact: True" in "\n".join(lines[:-1])


def test_bench_secagg_rejects_impossible_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """Through the `medfed` entry point: registration and error reporting."""
    # 4 dropouts out of 5 sites leave no threshold that also resists the coordinator.
    code = medfed_main(["bench", "secagg", "--sites", "5", "--dim", "10", "--dropouts", "4"])
    assert code == 2
    assert "threat_model" in capsys.readouterr().err


def test_bench_secagg_scaling_reports_per_client_cost_against_n(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = bench_main(
        ["--scaling", "6,24", "--dim", "200", "--dropouts", "1", "--repeat", "1", "--json"]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(lines[-1])
    assert code == 0
    assert [row["sites"] for row in rows] == [6, 24]
    assert all(row["exact"] for row in rows)
    assert all(row["client_cpu_ms"] > 0 and row["signature_checks"] > 0 for row in rows)
    assert rows[1]["neighbours"] > 0  # 24 sites: SecAgg+ neighbourhoods
    assert "cpu / first" in lines[1]
