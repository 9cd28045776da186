"""A site whose held-out split leaves too few units for DP-SGD is refused when it joins,
not at its first training round (where its refusal would abort the round for every
site). Each unit is held out with probability data.holdout_fraction under the site's
secret split key, so the training count varies around the expected one `data check`
judges; the join checks the real one. Real files, real keys (chosen here so the split
falls on either side of the rule), the hook as the agent drives it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from common.core.errors import DataError
from common.study import load_study
from site_agent.data import MIN_PRIVACY_UNITS
from site_agent.datacheck import site_policy
from site_agent.site_training import DpTrainingHook
from site_agent.synthetic_imaging import write_site_folder
from site_agent.unit_split import KEY_BYTES, SITE_KEY_FILE, training_unit_count
from tests.study.helpers import study_toml, write_hospital_csv
from tests.training.test_study_hook import images_study, site_settings

PATIENTS = 64  # expected training split 64 - round(0.2 * 64) = 51: passes `data check`
FRACTION = 0.2


def key_with_training_units(ids: np.ndarray, *, below: bool) -> bytes:
    """A split key under which the training split holds fewer than MIN_PRIVACY_UNITS
    patients (`below`) or at least that many: keys tried in a fixed order."""
    for seed in range(10_000):
        key = np.random.default_rng(seed).bytes(KEY_BYTES)
        units = training_unit_count(ids, key=key, held_out_fraction=FRACTION, unit="patient")
        if (units < MIN_PRIVACY_UNITS) == below:
            return key
    raise AssertionError("no key found")  # pragma: no cover - 64 units, p ~ 0.4 each way


def write_key(state: Path, key: bytes) -> None:
    state.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(state / SITE_KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key)


def table_site(tmp_path: Path, *, below: bool) -> tuple[DpTrainingHook, Path]:
    data = write_hospital_csv(tmp_path / "north.csv", PATIENTS, seed=4)
    study_path = tmp_path / "study.toml"
    study_path.write_text(study_toml("split-check", rounds=2), encoding="utf-8")
    settings = site_settings(tmp_path, study_path, data)
    ids = np.array([line.split(",")[0] for line in
                    data.read_text(encoding="utf-8").splitlines()[1:]], dtype=object)
    write_key(settings.state, key_with_training_units(ids, below=below))
    return DpTrainingHook(settings, dp=True), study_path


def image_site(tmp_path: Path, *, below: bool) -> tuple[DpTrainingHook, Path]:
    folder = write_site_folder(tmp_path / "cohort", "north_general", seed=2,
                               patients=PATIENTS)
    study_path = images_study(tmp_path)
    settings = site_settings(tmp_path, study_path, folder)
    labels = (folder / "labels.csv").read_text(encoding="utf-8").splitlines()
    column = labels[0].split(",").index("patient_id")
    ids = np.array([row.split(",")[column] for row in labels[1:]], dtype=object)
    write_key(settings.state, key_with_training_units(ids, below=below))
    return DpTrainingHook(settings, dp=True), study_path


@pytest.mark.parametrize("make_site", [table_site, image_site], ids=["table", "images"])
def test_a_training_split_below_the_rule_is_refused_at_join(
    tmp_path: Path, make_site: object
) -> None:
    hook, study_path = make_site(tmp_path, below=True)  # type: ignore[operator]
    with pytest.raises(DataError, match="training split") as refused:
        hook.join_study(load_study(study_path), site_policy(hook.settings))
    message = str(refused.value)
    assert f"< {MIN_PRIVACY_UNITS} needed for DP training" in message
    assert "data.holdout_fraction 0.2" in message and "north" in message  # names the file
    assert not hook.joined


@pytest.mark.parametrize("make_site", [table_site, image_site], ids=["table", "images"])
def test_a_training_split_that_meets_the_rule_joins(
    tmp_path: Path, make_site: object
) -> None:
    hook, study_path = make_site(tmp_path, below=False)  # type: ignore[operator]
    hook.join_study(load_study(study_path), site_policy(hook.settings))
    assert hook.joined and hook.privacy_unit == "patient"
