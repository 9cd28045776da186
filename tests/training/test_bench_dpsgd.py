"""`medfed bench dpsgd` runs all three modes side by side and ends with a JSON line."""

from __future__ import annotations

import json

import pytest

from bench.dpsgd import main


def test_bench_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--epochs", "2", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    for key in ("nonprivate_seconds", "ghost_seconds", "hooks_seconds"):
        assert result[key] > 0
    assert result["ghost_ratio"] == pytest.approx(
        result["ghost_seconds"] / result["nonprivate_seconds"]
    )
    assert result["hooks_ratio"] == pytest.approx(
        result["hooks_seconds"] / result["nonprivate_seconds"]
    )
    assert result["ghost_mode_used"] == "ghost"
    # Book-keeping ghost clipping does far less work per step than per-sample hooks.
    assert result["ghost_seconds"] < result["hooks_seconds"]
    assert any("ghost" in line and "x non-private" in line for line in lines)
