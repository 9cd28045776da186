"""`medfed bench ddgauss` runs end to end at a small size and reports what the docs quote."""

from __future__ import annotations

import json

import pytest

from bench.ddgauss import STEPS, main


def test_bench_ddgauss_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dims", "1000", "3000", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    first, second = report["results"]
    assert (first["padded_dim"], second["padded_dim"]) == (1024, 4096)
    assert first["wire_bytes_per_site"] == 1024 * 4 and first["ring_dtype"] == "uint32"
    assert first["log2_wrap_probability"] <= -40
    assert set(first["seconds"]) == set(STEPS)


def test_bench_ddgauss_in_round_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    """`--in-round`: the hospital round's site encode (limbs included) and coordinator
    decode beside the plain 32-bit ring's, with bytes and ratios, in one run."""
    assert main(["--dims", "3000", "--repeats", "1", "--in-round", "--json"]) == 0
    out = capsys.readouterr().out
    assert "in-round d = 3,000" in out
    (row,) = json.loads(out.strip().splitlines()[-1])["in_round"]
    assert row["padded_dim"] == 4096 and row["limbs"] == 1
    assert row["wire_bytes"] == {"hospital": 4096 * 4, "plain": 3000 * 4}
    assert row["bytes_ratio"] == pytest.approx(4096 / 3000)
    assert row["log2_wrap_probability"] <= -40
    for mode in ("hospital", "plain"):
        assert set(row["cpu_seconds"][mode]) == {"site_encode", "coordinator_decode"}
