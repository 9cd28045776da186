"""`medfed bench dpsgd` runs all three modes side by side and ends with a JSON line."""

from __future__ import annotations

import json

import pytest

from bench.dpsgd import main
from site_agent.grad_sample_mode import pick_faster_mode


def check_auto(result: dict[str, object], lines: list[str]) -> None:
    """`auto` is what a site's trainer measured and picked, printed beside the figures."""
    measured = result["auto_measured_step_seconds"]
    assert isinstance(measured, dict) and set(measured) == {"ghost", "hooks"}
    assert result["auto_mode"] == pick_faster_mode(measured)
    faster = min(("ghost", "hooks"), key=lambda m: result[f"{m}_cpu_seconds"])  # type: ignore[arg-type]
    assert result["auto_is_faster"] == (result["auto_mode"] == faster)
    assert result["auto_cost_vs_faster"] >= 1.0  # type: ignore[operator]
    auto_line = next(line for line in lines if line.strip().startswith(f"{result['auto_mode']} "))
    assert "<- auto" in auto_line
    assert any(f"picked {result['auto_mode']}" in line for line in lines)


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
    assert result["model"] == "mlp"
    check_auto(result, lines)
    assert result["ghost_cpu_ratio"] > 0 and result["hooks_cpu_ratio"] > 0
    assert any("ghost" in line and "x non-private" in line for line in lines)


def test_bench_image_model_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "cnn", "--image-size", "16", "--batch-size", "32", "--batches", "2"]
    assert main([*argv, "--epochs", "1", "--max-physical-batch-size", "16", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["model"] == "cnn" and result["input"] == "16x16 images"
    assert result["records"] == 64 and result["steps_per_epoch"] == 2
    check_auto(result, lines)
    for key in ("nonprivate_seconds", "ghost_seconds", "hooks_seconds"):
        assert result[key] > 0


def test_bench_patient_level_through_auto(capsys: pytest.CaptureFixture[str]) -> None:
    """`--privacy-unit patient` times the path auto takes on data with patient ids."""
    argv = ["--privacy-unit", "patient", "--model", "cnn", "--image-size", "16",
            "--batch-size", "16", "--batches", "8"]
    assert main([*argv, "--epochs", "1", "--max-physical-batch-size", "8", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["privacy_unit"] == "patient"
    assert result["patient_mode_used"] == "ghost-per-patient"
    assert result["records"] == 128 and result["patients"] < result["records"]
    # Per record forwarded: a patient-level epoch forwards a random share of the records.
    assert result["patient_ratio"] == pytest.approx(
        result["patient_seconds_per_record"] / result["nonprivate_seconds_per_record"]
    )
    for mode in ("nonprivate", "patient"):
        assert result[f"{mode}_seconds"] > 0 and result[f"{mode}_peak_mib"] >= 0
    assert any("patient" in line and "x non-private" in line and "MiB peak" in line
               for line in lines)
