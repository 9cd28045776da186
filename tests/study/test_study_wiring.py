"""Settings of a study run: the coordinator takes its model and
training settings from the study, a site never trains on synthetic data unless asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import CoordinatorSettings, SiteSettings, load_settings
from common.errors import ConfigError
from coordinator.study_run import StudyRun
from site_agent.training_data import load_configured_data
from tests.study.helpers import hospital_study


def _site(tmp_path: Path, **data: object) -> SiteSettings:
    return load_settings(SiteSettings, overrides={
        "site": "alpha", "coordinator": "127.0.0.1:9", "state": tmp_path, "pki": tmp_path,
        "data": data,
    })


def test_a_study_and_a_model_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        load_settings(CoordinatorSettings, overrides={
            "pki": tmp_path, "state": tmp_path, "study": tmp_path / "study.toml",
            "model": {"dim": 10},
        })


def test_the_study_gives_rounds_and_training_settings(tmp_path: Path) -> None:
    study = hospital_study()
    settings = load_settings(CoordinatorSettings, overrides={
        "pki": tmp_path, "state": tmp_path, "study": tmp_path / "study.toml", "rounds": 99,
    })
    effective = StudyRun(study=study, state=tmp_path).settings(settings)
    assert effective.rounds == study.study.rounds
    assert effective.training.learning_rate == study.training.learning_rate
    assert effective.aggregation.histogram_bins == study.privacy.evaluation.histogram_bins
    assert effective.optimizer.name == study.training.server_optimizer
    layout, flat = StudyRun(study=study, state=tmp_path).initial_model()
    assert flat.size == sum(spec.elements for spec in layout)


def test_a_different_study_on_the_same_state_is_refused(tmp_path: Path) -> None:
    first = tmp_path / "a.toml"
    first.write_text('[study]\nname = "a"\nrounds = 2\n[data]\nlabel_column = "y"\n'
                     '[[features]]\nname = "x"\n[privacy]\nunit = "record"\n')
    StudyRun.open(first, tmp_path / "state")
    second = tmp_path / "b.toml"
    second.write_text(first.read_text().replace("rounds = 2", "rounds = 3"))
    with pytest.raises(ConfigError, match="new --state"):
        StudyRun.open(second, tmp_path / "state")
    StudyRun.open(first, tmp_path / "state")  # the same study resumes


def test_no_synthetic_data_unless_asked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--synthetic"):
        load_configured_data(_site(tmp_path, synthetic_cohort_seed=3))
    with pytest.raises(ConfigError, match="exclude each other"):
        _site(tmp_path, synthetic=True, path=tmp_path / "own.csv")
    data = load_configured_data(_site(tmp_path, synthetic=True, synthetic_patients=60))
    assert len(data) > 0
