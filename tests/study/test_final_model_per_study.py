"""A site state folder that takes part in a second study keeps the first study's final
model (walkthrough, session 5: `model/final.safetensors` was overwritten): the earlier
bundle moves beside it as `study-<study SHA-256, 16 hex>.safetensors`, byte for byte."""

from __future__ import annotations

from pathlib import Path

from common.releases.bundle import read_bundle, write_bundle
from common.study import study_sha256
from site_agent.final_model import keep_previous_study_model
from tests.study.helpers import trained_bundle, write_hospital_csv


def test_a_second_study_keeps_the_first_studys_final_model(tmp_path: Path) -> None:
    first = trained_bundle(write_hospital_csv(tmp_path / "train.csv", n_patients=60), steps=5)
    second_study = first.study.model_copy(
        update={"study": first.study.study.model_copy(update={"name": "second-study"})})
    assert study_sha256(second_study) != study_sha256(first.study)
    path = tmp_path / "model" / "final.safetensors"
    path.parent.mkdir()
    write_bundle(path, first)
    original = path.read_bytes()
    # The same study again (a re-download): nothing to keep, the file stays.
    assert keep_previous_study_model(path, new_study=study_sha256(first.study)) is None
    assert path.read_bytes() == original
    kept = keep_previous_study_model(path, new_study=study_sha256(second_study))
    assert kept == path.with_name(f"study-{study_sha256(first.study)[:16]}.safetensors")
    assert kept.read_bytes() == original and not path.exists()
    assert read_bundle(kept).study == first.study
    # Nothing there: nothing to keep.
    assert keep_previous_study_model(path, new_study=study_sha256(second_study)) is None
