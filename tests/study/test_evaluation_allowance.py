"""A study's rounds, DP evaluations and final round are planned together: the evaluation
allowance covers every training round plus the final evaluation round, or the study is
refused (`study check`, `coordinator serve --study`, a site's enrolment) naming the
fields; a site whose own policy cannot pay the study's evaluations refuses it when it
receives it, not at the study's last round."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from common.commands.cli import main_with
from common.commands.study import register
from common.core.config import SiteSettings
from common.core.errors import ConfigError, PrivacyError, ValidationError
from common.study import (
    Study,
    check_study_against_policy,
    load_study,
    study_bytes,
    study_from_bytes,
    study_from_mapping,
)
from site_agent.datacheck import site_policy
from tests.study.helpers import study_mapping

FIELDS = ("privacy.evaluation.max_evaluations", "study.rounds", "training.final_evaluation")


def init_default(tmp_path: Path, *extra: str) -> Path:
    """The study a user drafts passing only label, patient column, categorical levels
    and the missing-value rule (every other setting is `study init`'s default)."""
    out = tmp_path / "study.toml"
    code = main_with([register], [
        "study", "init", "--out", str(out), "--label-column", "Outcome",
        "--patient-column", "Patient-ID", "--features", "Age,Sex,Lactate",
        "--categorical", "Sex=F,M", "--missing", "impute", *extra,
    ])
    assert code == 0
    return out


def default_site_settings(tmp_path: Path) -> SiteSettings:
    """A site configured with nothing but its identity and paths: the default policy."""
    return SiteSettings(
        site="north", coordinator="127.0.0.1:1", state=tmp_path / "state",
        tls_ca=tmp_path / "ca.crt", tls_cert=tmp_path / "s.crt", tls_key=tmp_path / "s.key",
    )


def test_the_default_drafted_study_covers_its_rounds_and_final_round(tmp_path: Path) -> None:
    study = load_study(init_default(tmp_path))
    assert study.study.rounds == 10 and study.training.final_evaluation
    assert study.privacy.evaluation.max_evaluations == "derived"
    assert study.evaluations_needed == 11
    assert study.max_evaluations == 11
    # The default site policy pays for it (its enrolment check passes).
    check_study_against_policy(study, site_policy(default_site_settings(tmp_path)))


def test_editing_the_drafted_rounds_keeps_the_allowance_consistent(tmp_path: Path) -> None:
    path = init_default(tmp_path)
    path.write_text(path.read_text().replace("rounds = 10", "rounds = 40"))
    assert load_study(path).max_evaluations == 41


def test_too_few_evaluations_are_refused_by_study_check_naming_the_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = init_default(tmp_path)
    text = path.read_text()
    assert 'max_evaluations = "derived"' in text
    path.write_text(text.replace('max_evaluations = "derived"', "max_evaluations = 10"))
    capsys.readouterr()
    assert main_with([register], ["study", "check", "--study", str(path)]) != 0
    message = capsys.readouterr().err
    assert all(name in message for name in FIELDS), message
    assert "at least 11" in message and str(path) in message
    with pytest.raises(ConfigError):
        load_study(path)  # what `coordinator serve --study` loads


def test_explicit_allowance_rules() -> None:
    def study(max_evaluations: object, *, rounds: int = 5, final: bool = True) -> Study:
        mapping = study_mapping(evaluation={"max_evaluations": max_evaluations})
        mapping["study"]["rounds"] = rounds
        mapping["training"] = {"final_evaluation": final}
        return study_from_mapping(mapping)

    assert study(6).max_evaluations == 6
    assert study(50).max_evaluations == 50
    # Without a final evaluation round the training rounds alone need covering.
    assert study(5, final=False).max_evaluations == 5
    assert study("derived", final=False).max_evaluations == 5
    with pytest.raises(ConfigError, match=re.escape("training.final_evaluation = true")):
        study(5)
    with pytest.raises(ConfigError, match="max_evaluations"):
        study(4, final=False)
    for bad in (0, -1, "auto", 100_001):
        with pytest.raises(ConfigError, match="max_evaluations"):
            study(bad)


def test_a_received_study_with_too_few_evaluations_is_refused() -> None:
    """What a site receives at enrolment is validated by the same rule."""
    good = study_from_mapping(study_mapping())
    data = json.loads(study_bytes(good))
    assert data["privacy"]["evaluation"]["max_evaluations"] == "derived"
    assert study_from_bytes(study_bytes(good)) == good
    data["privacy"]["evaluation"]["max_evaluations"] = 3  # rounds 3 + the final round
    with pytest.raises(ValidationError, match=re.escape("privacy.evaluation.max_evaluations")):
        study_from_bytes(json.dumps(data).encode())


def test_a_site_policy_that_cannot_pay_refuses_the_study_naming_both_fields(
    tmp_path: Path,
) -> None:
    study = load_study(init_default(tmp_path))
    settings = default_site_settings(tmp_path).model_copy(update={
        "policy": default_site_settings(tmp_path).policy.model_copy(
            update={"max_evaluations": 10})})
    with pytest.raises(PrivacyError) as refused:
        check_study_against_policy(study, site_policy(settings))
    message = str(refused.value)
    assert "policy.max_evaluations = 10" in message
    assert all(name in message for name in FIELDS), message
    # A policy of exactly the study's evaluations is enough.
    enough = settings.model_copy(update={
        "policy": settings.policy.model_copy(update={"max_evaluations": 11})})
    check_study_against_policy(study, site_policy(enough))
