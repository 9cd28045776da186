"""Settings of a study run: the coordinator takes its model and training settings from
the study; a site trains only under a study, and only its own when it names one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.instrumented import flat_model
from common.core.config import CoordinatorSettings, SiteSettings, load_settings
from common.core.errors import ConfigError
from coordinator.service import start
from coordinator.study_run import StudyRun
from site_agent.datacheck import site_policy
from site_agent.site_training import DpTrainingHook
from tests.study.helpers import hospital_study


def _site(tmp_path: Path, **data: object) -> SiteSettings:
    return load_settings(SiteSettings, overrides={
        "site": "alpha", "coordinator": "127.0.0.1:9", "state": tmp_path, "pki": tmp_path,
        "data": data,
    })


def test_a_study_and_a_model_exclude_each_other(tmp_path: Path) -> None:
    """A flat model without a study (transport tests: `bench.instrumented --model-dim`)
    beside a study is refused before anything starts: the study gives the model."""
    settings = load_settings(CoordinatorSettings, overrides={
        "pki": tmp_path, "state": tmp_path, "study": tmp_path / "study.toml",
    })
    with pytest.raises(ConfigError, match="not both"):
        asyncio.run(start(settings, model_without_study=flat_model(10)))
    assert not (tmp_path / "coordinator.db").exists()


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


def test_a_site_without_a_study_is_told_what_to_pass(tmp_path: Path) -> None:
    """A DP or non-private site whose coordinator serves no study is refused at enrolment,
    naming the coordinator's --study (which study it joins is the approval's:
    tests/study/test_study_gate.py)."""
    settings = _site(tmp_path, path=tmp_path / "own.csv")
    for dp in (True, False):
        with pytest.raises(ConfigError, match=r"coordinator serve --study study\.toml"):
            DpTrainingHook(settings, dp=dp).join_study(None, site_policy(settings))


def test_a_coordinator_model_file_is_refused_naming_study_init(tmp_path: Path) -> None:
    """A coordinator trains a study: a `[model] init_file` says which command drafts one."""
    config = tmp_path / "coordinator.toml"
    config.write_text('[model]\ninit_file = "initial-model.mfm"\n')
    with pytest.raises(ConfigError, match=r"medfed study init.*--study study\.toml") as err:
        load_settings(CoordinatorSettings, config_file=config,
                      overrides={"pki": tmp_path, "state": tmp_path})
    assert err.value.field == "model"
    with pytest.raises(ConfigError, match="study names the columns") as site:
        _site(tmp_path, path=tmp_path / "own.csv", label_column="sepsis")
    assert site.value.field == "data"


def test_a_site_config_with_the_old_split_seed_says_the_split_is_keyed_now(
    tmp_path: Path,
) -> None:
    """An upgraded site's config still naming `split_seed`: the error says what replaced
    it (the secret split key) and what happens to an existing site, not just 'extra'."""
    with pytest.raises(ConfigError, match=r"site-split\.key.*remove split_seed") as err:
        _site(tmp_path, path=tmp_path / "own.csv", split_seed=0)
    assert err.value.field == "data"


@pytest.mark.parametrize(("setting", "value", "study_field"), [
    ("batch_size", 64, r"\[training\] batch_size"),
    ("optimizer", "adam", r"\[training\] local_optimizer"),
])
def test_a_site_batch_size_or_optimizer_is_refused_naming_the_study_field(
    tmp_path: Path, setting: str, value: object, study_field: str
) -> None:
    """The study's batch and local optimizer are what every site trains by: a site
    setting for either could never take effect, so loading it says which field decides."""
    config = tmp_path / "site.toml"
    config.write_text(f"[training]\n{setting} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=rf"training\.{setting}: .*study's {study_field}") as err:
        load_settings(SiteSettings, config_file=config, overrides={
            "site": "alpha", "coordinator": "127.0.0.1:9", "state": tmp_path, "pki": tmp_path,
        })
    assert err.value.field == "training"
