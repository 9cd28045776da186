"""A site trains the study's model: images and custom
factories through `DpTrainingHook`, the same network the coordinator starts from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from common.core.config import PrivacySection, SiteSettings
from common.core.errors import ConfigError, PrivacyError, ValidationError
from common.models.build import initial_model
from common.models.layout import flatten_parameters, model_layout
from common.rounds.announcement import RoundPlan
from common.study import Study, load_study
from site_agent.datacheck import site_policy
from site_agent.grad_sample_mode import MODE_STATE_FILE
from site_agent.site_training import DpTrainingHook
from site_agent.synthetic_imaging import write_site_folder

IMAGES_STUDY = """
[study]
name = "lesions"
rounds = 2
task = "{task}"
classes = {classes}

[data]
kind = "images"
label_column = "label"
patient_column = "patient_id"
file_column = "file"
image_size = [16, 16]
channels = 1

[model]
{model}

[training]
batch_size = 16

[privacy]
unit = "patient"
"""


def images_study(tmp_path: Path, *, classes: int = 2, model: str = 'name = "cnn"') -> Path:
    path = tmp_path / "study.toml"
    task = "binary" if classes == 2 else "multiclass"
    path.write_text(
        IMAGES_STUDY.format(task=task, classes=list(range(classes)), model=model),
        encoding="utf-8",
    )
    return path


def site_settings(tmp_path: Path, study: Path, data: Path, **policy: object) -> SiteSettings:
    return SiteSettings(
        site="north",
        coordinator="127.0.0.1:1",
        state=tmp_path / "state",
        tls_ca=tmp_path / "ca.crt",
        tls_cert=tmp_path / "s.crt",
        tls_key=tmp_path / "s.key",
        study_file=study,
        data={"path": data},  # type: ignore[arg-type]
        training={"seed": 3, "device": "cpu"},  # type: ignore[arg-type]
        policy=policy,  # type: ignore[arg-type]
    )


def joined(settings: SiteSettings, study_path: Path, *, dp: bool) -> DpTrainingHook:
    """The hook as the agent drives it: built, then joined to the study at enrolment
    (the study's data, policy and model are checked there, before anything is sent)."""
    hook = DpTrainingHook(settings, dp=dp)
    hook.join_study(load_study(study_path), site_policy(settings))
    return hook


def plan_for(study: Study, *, bins: int) -> RoundPlan:
    layout = model_layout(initial_model(study, seed=0))
    return RoundPlan(
        round_number=1, planned_rounds=2, local_epochs=1, learning_rate=0.1,
        fedprox_mu=0.0, histogram_bins=bins, layout=layout,
    )


def test_images_study_trains_its_cnn_with_patient_level_dp(tmp_path: Path) -> None:
    folder = write_site_folder(tmp_path / "cohort", "north_general", seed=2, patients=80)
    study_path = images_study(tmp_path)
    hook = joined(site_settings(tmp_path, study_path, folder), study_path, dp=True)
    study = load_study(study_path)
    assert hook.privacy_unit == "patient" and hook.model_name == "cnn"
    # The coordinator's initial model is the architecture this site trains.
    initial = initial_model(study, seed=0)
    assert model_layout(initial) == hook.layout()
    plan = plan_for(study, bins=10)
    update = hook.train(plan, flatten_parameters(initial))
    assert update.delta.shape == flatten_parameters(initial).shape
    assert np.all(np.isfinite(update.delta)) and np.any(update.delta != 0)
    # One score per held-out patient (each unit moves one count: the DP sensitivity).
    assert update.histogram.shape == (20,)
    assert update.histogram.sum() == hook.holdout.num_patients
    assert hook.planned_segments(plan)  # a DP mechanism for the ledger


def test_multiclass_images_send_one_block_per_class(tmp_path: Path) -> None:
    from coordinator.aggregation import evaluation_edges, multiclass_round_metrics

    folder = write_site_folder(
        tmp_path / "cohort", "north_general", seed=4, patients=70, num_classes=3
    )
    study_path = images_study(tmp_path, classes=3)
    hook = joined(site_settings(tmp_path, study_path, folder), study_path, dp=False)
    study = load_study(study_path)
    from common.releases.evaluation_edges import announced_histogram_bins

    announced, classes = announced_histogram_bins(4, num_classes=3)
    assert (announced, classes) == (12, 3) and announced_histogram_bins(4, num_classes=2)[1] == 1
    plan = plan_for(study, bins=announced)  # 4 bins per class, announced as bins x K
    histogram = hook.evaluate(plan, flatten_parameters(initial_model(study, seed=0)))
    assert histogram.shape == (2 * 4 * 3,)
    assert all(block.sum() == len(hook.holdout) for block in histogram.reshape(3, 8))
    metrics = multiclass_round_metrics(
        histogram, evaluation_edges((), bins=12, classes=3), 3)
    assert {"auc", "auc_class_0", "auc_class_2"} <= set(metrics)
    with pytest.raises(ValidationError, match=r"not \(bins >= 2\) x 3 classes"):
        hook.evaluate(plan_for(study, bins=10), flatten_parameters(initial_model(study, seed=0)))
    # With edges announced (one block per class, as the coordinator derives them from
    # the released histogram), the site counts with them; a layout for another number
    # of classes is refused before anything is counted.
    from dataclasses import replace

    from common.releases.evaluation_edges import next_block_edges, round_edges

    following = next_block_edges(histogram, edges=round_edges((), bins=12, blocks=3))
    announced_edges = tuple(float(v) for block in following for v in block)
    again = hook.evaluate(replace(plan, histogram_edges=announced_edges),
                          flatten_parameters(initial_model(study, seed=0)))
    assert again.shape == (24,)
    assert all(block.sum() == len(hook.holdout) for block in again.reshape(3, 8))
    assert not np.array_equal(again, histogram)  # the buckets moved onto the scores
    with pytest.raises(ValidationError, match="histogram_edges"):
        hook.evaluate(replace(plan, histogram_edges=announced_edges[:-5]),
                      flatten_parameters(initial_model(study, seed=0)))


def batchnorm_net(in_channels: int, num_outputs: int) -> nn.Module:
    """A hospital's own network that Opacus cannot train (BatchNorm)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(num_outputs)
    )


def tiny_net(in_channels: int, num_outputs: int, width: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3), nn.GroupNorm(2, width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_outputs),
    )


def test_custom_factory_runs_only_when_the_site_allows_it(tmp_path: Path) -> None:
    folder = write_site_folder(tmp_path / "cohort", "north_general", seed=5, patients=80)
    ref = f"{__name__}:tiny_net"
    study_path = images_study(tmp_path, model=f'custom = "{ref}"\noptions = {{ width = 6 }}')
    with pytest.raises(PrivacyError, match="not in this site's allowed factories"):
        joined(site_settings(tmp_path, study_path, folder), study_path, dp=True)
    hook = joined(
        site_settings(tmp_path, study_path, folder, allowed_model_factories=[ref]), study_path,
        dp=True,
    )
    assert hook.model_name == ref
    assert hook.layout() == model_layout(initial_model(load_study(study_path), seed=0))


def test_incompatible_layer_is_named_with_its_fix_at_site_and_coordinator(
    tmp_path: Path,
) -> None:
    folder = write_site_folder(tmp_path / "cohort", "north_general", seed=6, patients=80)
    ref = f"{__name__}:batchnorm_net"
    study_path = images_study(tmp_path, model=f'custom = "{ref}"')
    with pytest.raises(ConfigError, match=r"layer 1 \(BatchNorm2d\).*GroupNorm"):
        joined(
            site_settings(tmp_path, study_path, folder, allowed_model_factories=[ref]),
            study_path, dp=True,
        )
    with pytest.raises(ConfigError, match=r"layer 1 \(BatchNorm2d\).*GroupNorm"):
        initial_model(load_study(study_path), seed=0)


def test_record_level_site_measures_its_dp_path_and_exports_it(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from site_agent.metrics import SiteMetrics

    folder = write_site_folder(tmp_path / "cohort", "north_general", seed=2, patients=80)
    study_path = images_study(tmp_path)
    record_site = site_settings(tmp_path, study_path, folder).model_copy(
        update={"privacy": PrivacySection(privacy_unit="record")}
    )
    # A patient-level study trains patient-level at a site that would accept record.
    assert joined(record_site, study_path, dp=True).privacy_unit == "patient"
    # Record-level DP-SGD is the study's choice (no patient column, unit record); the
    # site's own privacy_unit is only the weakest unit it accepts.
    study_path.write_text(study_path.read_text().replace('patient_column = "patient_id"\n', "")
                          .replace('unit = "patient"', 'unit = "record"'))
    settings = record_site
    hook = joined(settings, study_path, dp=True)
    # `auto` (the default) measured when the site joined the study, before any round:
    # nothing has trained yet, and the decision is in the site's state.
    assert hook.privacy_unit == "record"
    choice = hook.grad_sample_choice
    assert choice is not None and choice.source == "measured"
    saved = json.loads((settings.state / MODE_STATE_FILE).read_text())
    assert saved["mode"] == choice.mode and saved["seconds_per_step"] == choice.seconds_per_step
    # A restarted site joining the same study reads it back (a new measurement would
    # give other timings) ...
    again = joined(settings, study_path, dp=True).grad_sample_choice
    assert again is not None and again.seconds_per_step == choice.seconds_per_step
    study = load_study(study_path)
    update = hook.train(plan_for(study, bins=10), flatten_parameters(initial_model(study, seed=0)))
    assert np.all(np.isfinite(update.delta)) and np.any(update.delta != 0)
    # ... and the round's trainer runs the path chosen at join, without measuring.
    assert hook.grad_sample_choice is choice
    assert choice.batch_shape == (16, 1, 16, 16) and set(choice.seconds_per_step) == {
        "ghost", "hooks"
    }
    metrics = SiteMetrics("north")
    metrics.observe_grad_sample(
        mode=choice.mode, source=choice.source, seconds_per_step=choice.seconds_per_step
    )
    text = generate_latest(metrics.registry).decode()
    assert (f'medfed_site_dp_grad_sample_mode_info{{mode="{choice.mode}",source="measured"}} 1.0'
            in text)
    for mode, seconds in choice.seconds_per_step.items():
        assert f'medfed_site_dp_grad_sample_step_seconds{{mode="{mode}"}} {seconds!r}' in text
