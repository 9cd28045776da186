"""The demo's drafted study reads cells as the sites do (one definition of "missing").

A token the draft calls missing must be accepted as missing by `load_study_table`
(`data check` and training); before they shared `site_agent.data.is_missing`, a numeric
column holding "n/a" was drafted as imputed and then refused as "not a number".
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from common.core.errors import DataError
from common.study import Study
from demo.study import draft_demo_study
from site_agent.data import MISSING_TOKENS, is_missing, load_study_table


def _write(path: Path, rows: list[list[str]]) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows(rows)
    return path


def _draft(files: dict[str, Path]) -> tuple[Study, list[str]]:
    return draft_demo_study(
        files, name="t", label_column="Outcome", patient_column="Patient",
        rounds=2, epsilon=4.0, delta=1e-3, histogram_bins=10,
    )


def _rows(seed: int, tokens: list[str]) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    rows = [["Patient", " Heart rate ", "Ward", "Outcome"]]
    for i in range(40):
        hr = tokens[i % len(tokens)] if i % 5 == 0 else f"{rng.normal(80, 10):.1f}"
        ward = " N/A " if i % 7 == 0 else ("icu" if i % 2 else "general")
        rows.append([f"P{seed}-{i}", hr, ward, "yes" if rng.random() < 0.4 else "no"])
    return rows


def test_is_missing_tokens() -> None:
    for token in MISSING_TOKENS:
        assert is_missing(f"  {token.upper()} ")
    assert not is_missing("0")
    assert not is_missing("-")


def test_drafted_missing_tokens_load_at_the_sites(tmp_path: Path) -> None:
    files = {
        "a": _write(tmp_path / "a.csv", _rows(1, ["n/a", "None", ""])),
        "b": _write(tmp_path / "b.csv", _rows(2, ["NULL", "nan", "NA"])),
    }
    study, notes = _draft(files)
    features = {f.name: f for f in study.features}
    assert features["Heart rate"].type == "numeric"
    assert features["Heart rate"].missing == "impute"
    assert features["Ward"].type == "categorical"
    assert list(features["Ward"].levels or ()) == ["general", "icu"]
    assert any("Heart rate: missing values" in note for note in notes)
    for path in files.values():
        table = load_study_table(path, study)
        assert table.missing_counts()["Heart rate"] == 8
        assert table.missing_counts()["Ward"] == 6


def test_file_without_a_column_is_named(tmp_path: Path) -> None:
    rows = _rows(3, ["na"])
    files = {
        "a": _write(tmp_path / "a.csv", _rows(1, ["na"])),
        "b": _write(tmp_path / "b.csv", [row[:2] + row[3:] for row in rows]),
    }
    with pytest.raises(DataError, match=r"b\.csv.*missing column\(s\) \['Ward'\]"):
        _draft(files)
