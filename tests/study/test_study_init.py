"""`medfed study init`: a draft from column names only, odd names survive, no overwrite."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.commands.cli import main_with
from common.commands.study import register
from common.study import encoded_feature_names, load_study

ODD_HEADER = '"Patient ID","Age (yrs)",séx,"lactate ""mmol""","a,b",x.y-z,Outcome\n'


def run(argv: list[str]) -> int:
    return main_with([register], argv)


def write_header_only_file(path: Path) -> Path:
    # A byte-order mark as spreadsheets write it, then a second line that is not even
    # UTF-8: init must stop after the header line, never reading a data value.
    path.write_bytes(b"\xef\xbb\xbf" + ODD_HEADER.encode() + b"\xff\xfe not data\n")
    return path


def test_init_from_header_with_odd_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = write_header_only_file(tmp_path / "export.csv")
    out = tmp_path / "study.toml"
    code = run(
        [
            "study",
            "init",
            "--out",
            str(out),
            "--label-column",
            "Outcome",
            "--patient-column",
            "Patient ID",
            "--header-from",
            str(header),
            "--categorical",
            "séx=F,M",
            "--classes",
            "no,yes",
            "--missing",
            "indicator",
            "--name",
            "pilot",
        ]
    )
    assert code == 0
    assert "wrote" in capsys.readouterr().out
    study = load_study(out)
    assert [f.name for f in study.features] == [
        "Age (yrs)",
        "séx",
        'lactate "mmol"',
        "a,b",
        "x.y-z",
    ]
    assert study.feature("séx").levels == ("F", "M")
    assert study.data.patient_column == "Patient ID" and study.data.label_column == "Outcome"
    assert study.study.classes == ("no", "yes") and study.privacy.unit == "patient"
    assert all(f.missing == "indicator" for f in study.features)
    assert "séx=F" in encoded_feature_names(study)
    text = out.read_text(encoding="utf-8")
    assert text.startswith("# medfed study") and "# missing:" in text
    # Tables start from logistic regression at a step size that converges under clipping.
    assert study.model.name == "logistic" and study.training.learning_rate == 1.0
    # mlp-only fields are not drafted for another model
    assert not any(line.startswith("hidden") for line in text.splitlines())


def test_init_from_feature_list_and_no_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "study.toml"
    argv = ["study", "init", "--out", str(out), "--label-column", "y", "--features", "a,b,c"]
    assert run(argv) == 0
    first = out.read_bytes()
    study = load_study(out)
    assert [f.name for f in study.features] == ["a", "b", "c"]
    assert study.privacy.unit == "record" and study.study.classes == (0, 1)
    assert run(argv) == 2
    assert "already exists" in capsys.readouterr().err
    assert out.read_bytes() == first


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--categorical", "nope=A,B"], "not one of the feature columns"),
        (["--categorical", "a"], "expected COL=L1,L2"),
        (["--classes", "0,1,2", "--categorical", "a=x,,y"], "comma-separated"),
    ],
)
def test_init_refuses_bad_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], words: str
) -> None:
    out = tmp_path / "study.toml"
    argv = ["study", "init", "--out", str(out), "--label-column", "y", "--features", "a,b"]
    assert run(argv + extra) == 2
    assert words in capsys.readouterr().err
    assert not out.exists()


def test_init_checks_label_is_in_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header = write_header_only_file(tmp_path / "export.csv")
    out = tmp_path / "study.toml"
    argv = [
        "study",
        "init",
        "--out",
        str(out),
        "--label-column",
        "outcome",
        "--header-from",
        str(header),
    ]
    assert run(argv) == 2
    assert "'outcome' is not a column" in capsys.readouterr().err


def test_study_check_prints_hash(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "study.toml"
    run(["study", "init", "--out", str(out), "--label-column", "y", "--features", "a"])
    capsys.readouterr()
    assert run(["study", "check", "--study", str(out), "--json"]) == 0
    import json

    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert len(summary["sha256"]) == 64 and summary["features"] == ["a"]
