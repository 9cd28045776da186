"""The study's public bound on a served model's weights (`[model] max_abs_weight`): part
of the study's digest when not the default (a study keeping the default keeps the digest
it had before the field existed), validated with a range, checked by every site on every
model it is served (before training, from the model and study alone), refused in an
initial model file, and kept by the coordinator's own next models (clamped, logged)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import pytest

from common.core.errors import ConfigError, ModelOutOfBounds, ValidationError
from common.core.modelfile import flat_layout
from common.models.initial_file import read_initial_model, write_initial_model
from common.study import (
    DEFAULT_MAX_ABS_WEIGHT,
    check_served_weights,
    study_bytes,
    study_from_enrolment,
    study_from_mapping,
    study_sha256,
)
from coordinator.training_round import clamp_to_bound
from tests.study.helpers import hospital_study, study_mapping

DIGEST_BEFORE_THE_FIELD = "31c9268753482858e7cf72d9f1251c718b769a0d4f66aff618ae28730549d4ce"
"""`study_sha256` of tests.study.helpers' study before `max_abs_weight` existed: studies
that keep the default keep their digest (and every site's pin of it)."""


def with_bound(bound: float) -> object:
    mapping = study_mapping()
    mapping["model"] = {**mapping["model"], "max_abs_weight": bound}
    return study_from_mapping(mapping, source="test")


def test_the_bound_is_in_the_digest_only_when_a_study_sets_its_own() -> None:
    study = hospital_study()
    assert study.model.max_abs_weight == DEFAULT_MAX_ABS_WEIGHT == 1e6
    assert b"max_abs_weight" not in study_bytes(study)
    assert study_sha256(study) == DIGEST_BEFORE_THE_FIELD
    assert with_bound(1e6) == study  # the default written out is the same study
    tighter = with_bound(100.0)
    assert b'"max_abs_weight":100.0' in study_bytes(tighter)  # type: ignore[arg-type]
    assert study_sha256(tighter) != study_sha256(study)  # type: ignore[arg-type]
    # A coordinator cannot send the default spelt out: not the canonical bytes.
    spelt = study_bytes(study).replace(b'"model":{', b'"model":{"max_abs_weight":1000000.0,')
    with pytest.raises(ValidationError, match="canonical"):
        study_from_enrolment(spelt, announced_sha256=hashlib.sha256(spelt).hexdigest())


@pytest.mark.parametrize("bound", [0.0, -1.0, 2e38, float("inf"), float("nan")])
def test_a_bound_out_of_range_is_refused_naming_the_field(bound: float) -> None:
    with pytest.raises(ConfigError, match=r"model\.max_abs_weight"):
        with_bound(bound)


def test_attack_a_site_refuses_a_served_model_beyond_the_bound() -> None:
    study = hospital_study()
    check_served_weights(np.array([0.5, -1e6, 3.0], np.float32), study, what="the model")
    for bad in (1.0000001e6, -2e6, 1e20, np.nan):
        flat = np.array([0.5, bad, 3.0], np.float32)
        with pytest.raises(ModelOutOfBounds, match=r"model\.max_abs_weight = 1e\+06"):
            check_served_weights(flat, study, what="the global model of round 7")
    with pytest.raises(ModelOutOfBounds, match="round 7"):
        check_served_weights(np.full(3_000_000, 1e7, np.float32), study,
                             what="the global model of round 7")
    check_served_weights(np.array([1e20], np.float32), with_bound(1e30),  # type: ignore[arg-type]
                         what="the model")


def test_an_initial_model_file_beyond_the_bound_is_refused(tmp_path: Path) -> None:
    study = hospital_study()
    layout = flat_layout(4)
    good = tmp_path / "good.safetensors"
    write_initial_model(good, study, layout, np.array([0.1, 2, 3, -4], np.float32), seed=0)
    assert read_initial_model(good, study)[1].tolist() == pytest.approx([0.1, 2, 3, -4])
    planted = tmp_path / "planted.safetensors"
    write_initial_model(planted, study, layout, np.array([0.1, 2, 1e19, -4], np.float32),
                        seed=0)
    with pytest.raises(ValidationError, match=r"planted\.safetensors.*max_abs_weight"):
        read_initial_model(planted, study)


def test_the_coordinator_clamps_its_next_model_into_the_bound(
        caplog: pytest.LogCaptureFixture) -> None:
    flat = np.array([0.5, 2e6, -3e6, 1.0], np.float32)
    with caplog.at_level(logging.WARNING, logger="medfed.coordinator"):
        moved = clamp_to_bound(flat, bound=1e6, round_number=9)
    assert moved == 2 and flat.tolist() == [0.5, 1e6, -1e6, 1.0]
    assert "model_clamped" in [getattr(r, "event", "") for r in caplog.records]
    assert clamp_to_bound(flat, bound=1e6, round_number=10) == 0
