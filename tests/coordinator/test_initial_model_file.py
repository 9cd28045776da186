"""Round 1's network from a file (`medfed model init`, `coordinator serve --initial-model`):
the coordinator image has no torch, so the site image builds the study's untrained
network and the coordinator serves it.

The file must be exactly what a coordinator with torch builds (tables and images), bound
to the study (a changed study, members included, needs a new file) and refused when
edited, truncated or not a medfed file, each refusal naming the field."""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.core.codec import TensorSpec
from common.core.errors import StateError, ValidationError
from common.core.processes import medfed_argv
from common.models.build import initial_model
from common.models.initial_file import (
    INITIAL_MODEL_SEED,
    initial_model_from_bytes,
    read_initial_model,
    write_initial_model,
)
from common.models.layout import wire_model
from common.study import Study, load_study, study_sha256
from coordinator.study_run import StudyRun
from tests.e2e.harness import REPO
from tests.training.test_study_hook import images_study

DEMO_STUDY = REPO / "deploy/demo/study.toml"


def initial_model_bytes(
    study: Study, layout: Sequence[TensorSpec], flat: np.ndarray, *, seed: int
) -> bytes:
    """The bytes `write_initial_model` writes for `study`'s untrained network."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "initial-model.safetensors"
        write_initial_model(path, study, layout, flat, seed=seed)
        return path.read_bytes()


def _rewrite(data: bytes, **metadata: str) -> bytes:
    """`data` with metadata keys replaced (the digest NOT recomputed)."""
    from safetensors.numpy import load, save

    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    tensors = load(data)
    merged = {**header["__metadata__"], **metadata}
    rewritten: bytes = save(tensors, metadata={k: v for k, v in merged.items() if v})
    return rewritten


@pytest.mark.parametrize("kind", ["table", "images"])
def test_the_cli_writes_exactly_what_a_coordinator_with_torch_builds(
    kind: str, tmp_path: Path
) -> None:
    import subprocess

    path = DEMO_STUDY if kind == "table" else images_study(tmp_path)
    study = load_study(path)
    digests = []
    for out in (tmp_path / "again.safetensors", tmp_path / "initial-model.safetensors"):
        done = subprocess.run(
            medfed_argv("model", "init", "--study", str(path), "--out", str(out)),
            capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert str(out) in done.stdout and "parameters" in done.stdout
        digests.append(re.search(r"content sha256 ([0-9a-f]{64})", done.stdout))
    # Two runs, two processes: the same weights and content digest.
    assert digests[0] and digests[1] and digests[0].group(1) == digests[1].group(1)
    layout, flat = read_initial_model(out, study)
    assert np.array_equal(read_initial_model(tmp_path / "again.safetensors", study)[1], flat)
    own_layout, own_flat = StudyRun(study=study, state=tmp_path / "state").initial_model()
    assert layout == own_layout
    assert flat.dtype == np.float32 and np.array_equal(flat, own_flat)
    # What the coordinator serves round 1 from, with the file.
    run = StudyRun(study=study, state=tmp_path / "state", initial_file=out)
    served_layout, served = run.initial_model()
    assert served_layout == own_layout and np.array_equal(served, own_flat)


def test_a_file_for_another_study_is_refused_at_open(tmp_path: Path) -> None:
    study = load_study(DEMO_STUDY)
    layout, flat = wire_model(initial_model(study, seed=INITIAL_MODEL_SEED))
    out = tmp_path / "initial.safetensors"
    write_initial_model(out, study, layout, flat, seed=INITIAL_MODEL_SEED)
    # The same study with one more member is another study (another SHA-256).
    changed = tmp_path / "study.toml"
    changed.write_text(DEMO_STUDY.read_text().replace('name = "compose-demo"',
                                                      'name = "compose-demo-2"'))
    assert study_sha256(load_study(changed)) != study_sha256(study)
    with pytest.raises(ValidationError, match=r"medfed\.study_sha256: built for study") as err:
        StudyRun.open(changed, tmp_path / "state", initial_model=out)
    assert str(out) in str(err.value)
    # Refused before the state folder was pinned to the changed study.
    assert not (tmp_path / "state" / "study.json").exists()
    run = StudyRun.open(DEMO_STUDY, tmp_path / "state2", initial_model=out)
    assert np.array_equal(run.initial_model()[1], flat)


@pytest.fixture(scope="module")
def good() -> tuple[bytes, Study]:
    """The demo study's file bytes, and the study."""
    study = load_study(DEMO_STUDY)
    layout, flat = wire_model(initial_model(study, seed=INITIAL_MODEL_SEED))
    return initial_model_bytes(study, layout, flat, seed=INITIAL_MODEL_SEED), study


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"medfed.seed": "1"}, r"medfed\.sha256: the file was modified"),
        ({"medfed.format": "medfed-bundle/1"}, r"medfed\.format: 'medfed-bundle/1' is not"),
        ({"medfed.study_sha256": "ab" * 32}, r"medfed\.study_sha256: built for study abab"),
        ({"medfed.study_sha256": "not hex"}, r"medfed\.study_sha256: not a SHA-256"),
        ({"medfed.seed": "-1"}, r"medfed\.seed: must be a non-negative integer"),
        ({"medfed.parameters": "[]"}, r"medfed\.parameters: names differ"),
        ({"medfed.parameters": "{"}, r"medfed\.parameters: expected .* \(not JSON\)"),
        ({"medfed.sha256": ""}, r"medfed\.sha256: missing from the file's metadata"),
        ({"medfed.extra": "x"}, r"medfed\.extra: unknown metadata key"),
    ],
)
def test_an_edited_file_is_refused_naming_the_field(
    good: tuple[bytes, Study], edit: dict[str, str], message: str
) -> None:
    data, study = good
    with pytest.raises(ValidationError, match=message):
        initial_model_from_bytes(_rewrite(data, **edit), study)


def test_an_edited_weight_is_refused(good: tuple[bytes, Study]) -> None:
    data, study = good
    edited = bytearray(data)
    edited[-1] ^= 0x01  # the last byte of the last tensor
    with pytest.raises(ValidationError, match=r"medfed\.sha256: the file was modified"):
        initial_model_from_bytes(bytes(edited), study)


@pytest.mark.parametrize("data", [b"", b"\x00" * 7, b"PK\x03\x04" + b"\x00" * 64,
                                  (2**40).to_bytes(8, "little") + b"{}"])
def test_not_a_safetensors_file_says_what_to_run(data: bytes, good: tuple[bytes, Study]) -> None:
    with pytest.raises(ValidationError, match="medfed model init"):
        initial_model_from_bytes(data, good[1])


def test_nan_or_float64_weights_are_refused(good: tuple[bytes, Study]) -> None:
    study = good[1]
    layout = (TensorSpec("w", "<f4", (2, 2)),)
    with pytest.raises(ValidationError, match="NaN or infinity"):
        initial_model_bytes(study, layout, np.array([0, 1, np.nan, 2], dtype=np.float32),
                            seed=0)
    from safetensors.numpy import save

    from common.core.tensor_file import metadata_digest

    tensors = {"w": np.zeros((2, 2), dtype=np.float64)}
    metadata = {"medfed.format": "medfed-initial-model/1",
                "medfed.study_sha256": study_sha256(study),
                "medfed.seed": "0",
                "medfed.parameters": json.dumps([{"name": "w", "shape": [2, 2]}])}
    metadata["medfed.sha256"] = metadata_digest(metadata, tensors)
    with pytest.raises(ValidationError, match=r"tensor 'w': dtype float64"):
        initial_model_from_bytes(save(tensors, metadata=metadata), study)


@settings(max_examples=30, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3),
                       min_size=1, max_size=5),
       seed=st.integers(0, 2**63 - 1))
def test_any_layout_round_trips(good: tuple[bytes, Study], shapes: list[list[int]],
                                seed: int) -> None:
    study = good[1]
    layout = tuple(TensorSpec(f"layer{i}.weight", "<f4", tuple(shape))
                   for i, shape in enumerate(shapes))
    size = sum(spec.elements for spec in layout)
    flat = np.random.default_rng(seed % 2**32).standard_normal(size).astype(np.float32)
    data = initial_model_bytes(study, layout, flat, seed=seed)
    read_layout, read_flat = initial_model_from_bytes(data, study)
    assert read_layout == layout and np.array_equal(read_flat, flat)


def test_a_missing_file_is_a_state_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(StateError, match=str(tmp_path / "absent.safetensors")):
        read_initial_model(tmp_path / "absent.safetensors", load_study(DEMO_STUDY))


def test_initial_model_without_a_study_is_refused(tmp_path: Path) -> None:
    from common.core.config import CoordinatorSettings

    with pytest.raises(ValueError, match="initial_model is the untrained network of a study"):
        CoordinatorSettings(pki=tmp_path, state=tmp_path, initial_model=tmp_path / "x")
