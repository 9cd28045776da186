"""`medfed query init` -> `medfed query check` on a hospital file with its own column
names, string labels and levels, two visits per patient and missing values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.commands.cli import main_with
from common.commands.query import register
from common.releases.analytics.check import check_query
from common.releases.analytics.query import load_query
from common.study import SitePrivacyPolicy, load_study
from site_agent.data import load_study_table
from tests.study.helpers import study_toml, write_hospital_csv


def medfed(*argv: str) -> int:
    return main_with([register], list(argv))


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    study = tmp_path / "study.toml"
    study.write_text(study_toml("sepsis", rounds=2), encoding="utf-8")
    data = write_hospital_csv(tmp_path / "hospital.csv", 80, seed=3)
    return study, data


def test_init_then_check_on_the_sites_file(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    study, data = files
    query = tmp_path / "query.toml"
    assert medfed("query", "init", "--study", str(study), "--name", "first-look",
                  "--out", str(query)) == 0
    assert "wrote" in capsys.readouterr().out
    # The draft filters nothing; narrow it to women as an operator would.
    text = query.read_text(encoding="utf-8").replace(
        '# [[cohort]]\n# feature = "Sex"\n# levels = ["F"]',
        '[[cohort]]\nfeature = "Sex"\nlevels = ["F"]')
    query.write_text(text, encoding="utf-8")

    assert medfed("query", "check", "--study", str(study), "--query", str(query),
                  "--data", str(data), "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["released"] is False
    assert report["units"] == 80
    assert 0 < report["cohort"] < 80  # the women among 80 patients
    assert next(s["name"] for s in report["statistics"]) == "patients"
    assert report["epsilon"] == pytest.approx(1.0)
    assert 0 < report["epsilon_composed"] < report["epsilon"]
    assert report["length"] == sum(s["cells"] for s in report["statistics"])
    assert report["problems"] == []

    assert medfed("query", "check", "--study", str(study), "--query", str(query),
                  "--data", str(data)) == 0
    text_out = capsys.readouterr().out
    assert "nothing is released" in text_out and "80 patients" in text_out


def test_init_to_stdout_and_never_over_an_existing_file(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    study, _ = files
    assert medfed("query", "init", "--study", str(study), "--name", "q") == 0
    printed = capsys.readouterr().out
    assert 'name = "q"' in printed and "[[statistics]]" in printed
    existing = tmp_path / "taken.toml"
    existing.write_text("keep me", encoding="utf-8")
    assert medfed("query", "init", "--study", str(study), "--name", "q",
                  "--out", str(existing)) == 2
    assert "already exists" in capsys.readouterr().err
    assert existing.read_text(encoding="utf-8") == "keep me"


def test_check_names_the_file_and_field_of_a_bad_query(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    study, data = files
    query = tmp_path / "query.toml"
    assert medfed("query", "init", "--study", str(study), "--name", "q",
                  "--out", str(query)) == 0
    capsys.readouterr()
    query.write_text(query.read_text(encoding="utf-8").replace(
        'feature = "Sex"\n', 'feature = "Gender"\n'), encoding="utf-8")
    assert medfed("query", "check", "--study", str(study), "--query", str(query),
                  "--data", str(data)) == 2
    err = capsys.readouterr().err
    assert str(query) in err and "statistics[1].by[0].feature" in err and "Gender" in err


def test_check_refuses_a_query_written_for_another_study(
    files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    study, data = files
    query = tmp_path / "query.toml"
    assert medfed("query", "init", "--study", str(study), "--name", "q",
                  "--out", str(query)) == 0
    other = tmp_path / "other.toml"
    other.write_text(study_toml("sepsis", rounds=3), encoding="utf-8")
    assert load_study(other) != load_study(study)
    capsys.readouterr()
    assert medfed("query", "check", "--study", str(other), "--query", str(query),
                  "--data", str(data)) == 2
    assert "study_sha256" in capsys.readouterr().err


def test_check_against_a_sites_policy(files: tuple[Path, Path], tmp_path: Path) -> None:
    study_path, data = files
    query_path = tmp_path / "query.toml"
    assert medfed("query", "init", "--study", str(study_path), "--name", "q",
                  "--out", str(query_path)) == 0
    study = load_study(study_path)
    query = load_query(query_path, study=study)
    table = load_study_table(data, study)
    generous = SitePrivacyPolicy(epsilon=8.0, delta=1e-3)
    assert check_query(query, table, study=study, policy_or_none=generous).ok
    strict = SitePrivacyPolicy(epsilon=8.0, delta=1e-6, max_epsilon_per_round=0.2)
    report = check_query(query, table, study=study, policy_or_none=strict)
    assert not report.ok
    assert any("above the per-round cap 0.2 (this site's policy.max_epsilon_per_round)" in p
               for p in report.problems)
    assert any("delta" in p for p in report.problems)
