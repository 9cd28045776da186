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
