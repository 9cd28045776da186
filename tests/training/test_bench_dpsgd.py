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
    assert result["model"] == "mlp" and result["auto_mode"] == "ghost"
    assert result["ghost_cpu_ratio"] > 0 and result["hooks_cpu_ratio"] > 0
    assert any("ghost" in line and "x non-private" in line for line in lines)


def test_bench_image_model_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "cnn", "--image-size", "16", "--batch-size", "32", "--batches", "2"]
    assert main([*argv, "--epochs", "1", "--max-physical-batch-size", "16", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["model"] == "cnn" and result["input"] == "16x16 images"
    assert result["records"] == 64 and result["steps_per_epoch"] == 2
    assert result["auto_mode"] == "hooks"  # small conv net (docs/benchmarks.md)
    for key in ("nonprivate_seconds", "ghost_seconds", "hooks_seconds"):
        assert result[key] > 0
    assert "<- auto" in next(line for line in lines if line.strip().startswith("hooks"))
