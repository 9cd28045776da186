"""The study file: good and bad files, errors naming field and file, canonical bytes,
the site's privacy policy winning over the study's requests."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from common.commands.study import render_study_toml
from common.core.config import DEFAULT_COUNT_EPSILON, PrivacySection
from common.core.errors import ConfigError, PrivacyError, ValidationError
from common.study import (
    SitePrivacyPolicy,
    check_study_against_policy,
    encoded_feature_names,
    load_study,
    study_bytes,
    study_from_bytes,
    study_from_mapping,
    study_sha256,
)
from tests.study.helpers import hospital_study, study_mapping

GOOD = """
[study]
name = "sepsis-pilot"
rounds = 5
classes = ["no", "yes"]

[data]
label_column = "Outcome"
patient_column = "Patient-ID"

[[features]]
name = "Age (years)"
range = [18, 100]

[[features]]
name = "Sex"
type = "categorical"
levels = ["F", "M"]
missing = "indicator"

[privacy]
unit = "patient"
epsilon = 3.0
delta = 1e-6

[privacy.evaluation]
histogram_bins = 50
"""


def test_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "study.toml"
    path.write_text(GOOD, encoding="utf-8")
    study = load_study(path)
    assert study.study.task == "binary" and study.study.classes == ("no", "yes")
    assert study.model.name == "mlp" and study.model.custom is None
    assert study.privacy.evaluation.histogram_bins == 50
    assert encoded_feature_names(study) == ["Age (years)", "Sex=F", "Sex=M", "Sex__missing"]
    assert study.num_outputs == 1


def test_canonical_bytes_round_trip_and_hash() -> None:
    study = hospital_study()
    data = study_bytes(study)
    assert json.loads(data) == json.loads(json.dumps(json.loads(data), sort_keys=True))
    assert study_from_bytes(data) == study
    assert study_bytes(study_from_bytes(data)) == data
    other = study_from_mapping(study_mapping(epsilon=2.0))
    assert study_sha256(other) != study_sha256(study)
    assert len(study_sha256(study)) == 64


def test_rendered_toml_loads_back(tmp_path: Path) -> None:
    study = hospital_study()
    path = tmp_path / "study.toml"
    path.write_text(render_study_toml(study), encoding="utf-8")
    assert load_study(path) == study


def _edit(mapping: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(mapping)
    target: Any = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    last = parts[-1]
    if value is _DELETE:
        del target[last]
    elif last.isdigit():
        target[int(last)] = value
    else:
        target[last] = value
    return out


_DELETE = object()


@pytest.mark.parametrize(
    ("dotted", "value", "field", "words"),
    [
        ("features.1.levels", _DELETE, "features[1]", "needs levels"),
        ("features.1.levels", ["F", "F"], "features[1]", "distinct"),
        ("features.0.range", [5, 1], "features[0]", "low < high"),
        ("features.0.type", "text", "features[0].type", "numeric"),
        ("features.2.missing", "drop", "features[2].missing", "error"),
        ("features.0.colour", "red", "features[0].colour", "Extra inputs"),
        ("study.classes", ["no", "yes", "maybe"], "study", "exactly two classes"),
        ("study.rounds", 0, "study.rounds", "greater than or equal"),
        ("data.patient_column", _DELETE, "study", "patient_column"),
        ("features.0.name", "Outcome", "study", "cannot also be features"),
        ("features.2.name", "Age (years)", "study", "distinct"),
        ("model.name", "transformer", "model", "unknown model"),
        ("model.custom", "pkg.mod:make", "model", "not both"),
        ("model.custom", "not a factory", "model.custom", "pattern"),
        ("privacy.unit", "family", "privacy.unit", "record"),
        ("privacy.delta", 1.5, "privacy.delta", "less than"),
        ("privacy.listen", "0.0.0.0:7443", "privacy.listen", "Extra inputs"),
    ],
)
def test_bad_study_names_field_and_file(
    tmp_path: Path, dotted: str, value: Any, field: str, words: str
) -> None:
    mapping = _edit(study_mapping(), dotted, value)
    with pytest.raises(ConfigError) as info:
        study_from_mapping(mapping, source=str(tmp_path / "study.toml"))
    assert info.value.field == field
    assert words in info.value.message
    assert str(tmp_path / "study.toml") in str(info.value)


def test_operational_settings_stay_out(tmp_path: Path) -> None:
    path = tmp_path / "study.toml"
    path.write_text(GOOD + "\n[deadlines]\nphase_seconds = 5\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_study(path)
    assert info.value.field == "deadlines" and str(path) in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[study\nname = 1", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"broken\.toml is not valid TOML"):
        load_study(path)
    with pytest.raises(ConfigError, match="cannot read study file"):
        load_study(tmp_path / "absent.toml")


def test_images_and_multiclass_have_room() -> None:
    study = study_from_mapping(
        {
            "study": {"name": "cxr", "rounds": 2, "task": "multiclass", "classes": [0, 1, 2]},
            "data": {
                "kind": "images",
                "label_column": "label",
                "patient_column": "patient",
                "file_column": "file",
                "image_size": [64, 64],
                "channels": 1,
            },
            "model": {"name": "resnet18-gn"},
            "privacy": {"unit": "hospital", "update_clip_norm": 1.0, "intermediaries": 4},
        }
    )
    assert study.num_outputs == 3 and study.privacy.intermediaries == 4
    with pytest.raises(ConfigError, match="images"):
        study_from_mapping(_edit(study_mapping(), "model.name", "resnet18-gn"))


def test_study_from_bytes_rejects_garbage() -> None:
    for data in (b"\xff", b"[]", b'{"study": {}}', b"x" * (2 << 20)):
        with pytest.raises(ValidationError):
            study_from_bytes(data)


def test_site_policy_always_wins() -> None:
    study = hospital_study()  # asks epsilon 4, delta 1e-3, unit patient
    check_study_against_policy(study, SitePrivacyPolicy(epsilon=4.0, delta=1e-3, unit="patient"))
    check_study_against_policy(study, SitePrivacyPolicy(epsilon=8.0, delta=1e-2, unit="record"))
    with pytest.raises(PrivacyError) as info:
        check_study_against_policy(
            study, SitePrivacyPolicy(epsilon=2.0, delta=1e-5, unit="hospital")
        )
    message = str(info.value)
    assert "privacy.epsilon = 4" in message and "privacy.delta" in message
    assert "privacy.unit = 'patient' is weaker" in message
    with pytest.raises(PrivacyError, match=r"max_epsilon_per_round is not set, and this site "
                       r"caps every round at 1: the study must declare a cap no larger"):
        check_study_against_policy(
            study, SitePrivacyPolicy(epsilon=8.0, delta=1e-2, max_epsilon_per_round=1.0)
        )
    custom = study_from_mapping(
        _edit(_edit(study_mapping(), "model.name", _DELETE), "model.custom", "hosp.models:net")
    )
    with pytest.raises(PrivacyError, match="allowed factories"):
        check_study_against_policy(custom, SitePrivacyPolicy(epsilon=8.0, delta=1e-2))
    check_study_against_policy(
        custom,
        SitePrivacyPolicy(epsilon=8.0, delta=1e-2, allowed_model_factories=("hosp.models:net",)),
    )


def test_the_study_declares_the_count_epsilon_within_the_site_limit() -> None:
    """Every site spends the study's count_epsilon; a site whose own limit is lower, or
    whose per-round cap is, refuses the study naming the field."""
    study = study_from_mapping(study_mapping(count_epsilon=1.0))
    check_study_against_policy(
        study, SitePrivacyPolicy(epsilon=4.0, delta=1e-3, max_count_epsilon=1.0))
    with pytest.raises(PrivacyError) as info:
        check_study_against_policy(
            study, SitePrivacyPolicy(epsilon=4.0, delta=1e-3, max_count_epsilon=0.5))
    assert "privacy.count_epsilon = 1 exceeds this site's 0.5" in str(info.value)
    assert "limit for the one DP cohort count" in str(info.value)
    with pytest.raises(PrivacyError, match=r"privacy\.count_epsilon = 1 exceeds this site's 0\.8"):
        check_study_against_policy(
            study_from_mapping(study_mapping(count_epsilon=1.0, max_epsilon_per_round=0.8)),
            SitePrivacyPolicy(epsilon=4.0, delta=1e-3, max_epsilon_per_round=0.8,
                              max_count_epsilon=2.0))
    # The defaults agree: a default site joins a default study.
    assert study_from_mapping(study_mapping()).privacy.count_epsilon == DEFAULT_COUNT_EPSILON
    assert PrivacySection().count_epsilon == DEFAULT_COUNT_EPSILON


def test_study_from_enrolment_checks_the_announced_hash() -> None:
    from common.study import study_from_enrolment

    study = hospital_study()
    data = study_bytes(study)
    assert study_from_enrolment(data, announced_sha256=study_sha256(study)) == study
    with pytest.raises(ValidationError, match="announced"):
        study_from_enrolment(data, announced_sha256="0" * 64)
    spaced = json.dumps(json.loads(data), indent=1).encode()
    import hashlib

    with pytest.raises(ValidationError, match="canonical"):
        study_from_enrolment(spaced, announced_sha256=hashlib.sha256(spaced).hexdigest())
