"""The study's final model is served only for this study, and only once it finished
(`coordinator.bundles`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.core.config import CoordinatorSettings, load_settings
from common.core.errors import StateError, ValidationError
from coordinator.bundles import final_bundle, write_round_bundle
from coordinator.study_run import StudyRun
from tests.study.helpers import hospital_study


def test_no_final_model_without_a_study() -> None:
    with pytest.raises(StateError, match="runs no study"):
        final_bundle(None, b"\x00" * 32, finished=True)


def test_the_final_model_is_refused_for_another_study_or_before_the_end(
    tmp_path: Path,
) -> None:
    run = StudyRun(study=hospital_study(), state=tmp_path)
    sha = bytes.fromhex(run.sha256)
    with pytest.raises(ValidationError, match="another study"):
        final_bundle(run, bytes(32), finished=True)
    with pytest.raises(StateError, match="not finished"):
        final_bundle(run, sha, finished=False)
    with pytest.raises(StateError, match="not finished"):
        final_bundle(run, sha, finished=True)  # finished, but no final bundle on disk
    run.model_dir.mkdir(parents=True)
    run.final_path.write_bytes(b"bundle")
    assert final_bundle(run, sha, finished=True) == b"bundle"


def test_no_bundle_before_the_statistics_release(tmp_path: Path) -> None:
    """A bundle without the global preprocessing would be unusable at a hospital."""
    run = StudyRun(study=hospital_study(), state=tmp_path)
    settings = run.settings(load_settings(CoordinatorSettings, overrides={
        "pki": tmp_path, "state": tmp_path, "study": tmp_path / "study.toml",
    }))
    with pytest.raises(StateError, match="no statistics yet"):
        write_round_bundle(run, round_number=1, layout=(), flat=np.zeros(0, np.float32),
                           settings=settings, budgets=[], final=False)
    assert not run.model_dir.exists()
