"""The model bundle: a safetensors round trip, and every edit or bad key refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load, save

from common.core.errors import StateError, ValidationError
from common.releases.bundle import (
    Threshold,
    bundle_bytes,
    bundle_from_bytes,
    read_bundle,
    write_bundle,
)
from site_agent.predict import load_model
from tests.study.helpers import trained_bundle, write_hospital_csv


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    path = write_hospital_csv(tmp_path_factory.mktemp("b") / "train.csv", n_patients=80)
    return trained_bundle(path, steps=20)


def test_round_trip(tmp_path: Path, bundle) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "final.safetensors"
    digest = write_bundle(path, bundle)
    assert len(digest) == 64 and [p.name for p in tmp_path.iterdir()] == ["final.safetensors"]
    back = read_bundle(path)
    assert back.study == bundle.study and back.statistics == bundle.statistics
    assert back.card == bundle.card and back.threshold == bundle.threshold
    assert back.architecture == bundle.architecture and (back.round, back.final) == (3, True)
    assert list(back.parameters) == list(bundle.parameters)
    np.testing.assert_array_equal(back.flat(), bundle.flat())
    load_model(back)  # the tensors fit the rebuilt network
    # Plain safetensors readers (other tools) see named tensors and string metadata.
    tensors = load(path.read_bytes())
    assert set(tensors) == set(bundle.parameters)


def _metadata_and_tensors(data: bytes) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    return dict(header["__metadata__"]), load(data)


def _rehash(metadata: dict[str, str], tensors: dict[str, np.ndarray], order: list[str]) -> bytes:
    from common.core.tensor_file import metadata_digest

    ordered = {name: tensors[name] for name in order}
    metadata = {**metadata, "medfed.sha256": metadata_digest(metadata, ordered)}
    return save(tensors, metadata=metadata)


def test_tampering_is_detected(bundle) -> None:  # type: ignore[no-untyped-def]
    data = bundle_bytes(bundle)
    metadata, tensors = _metadata_and_tensors(data)
    # A changed weight, with the metadata left alone.
    name = next(iter(tensors))
    edited = dict(tensors)
    edited[name] = tensors[name].copy()
    edited[name].flat[0] += 1.0
    with pytest.raises(ValidationError, match=r"medfed\.sha256"):
        bundle_from_bytes(save(edited, metadata=metadata))
    # A lowered threshold (a laxer operating point), digest not recomputed.
    lowered = {**metadata, "medfed.threshold": json.dumps({"value": 0.01})}
    with pytest.raises(ValidationError, match=r"medfed\.sha256"):
        bundle_from_bytes(save(tensors, metadata=lowered))
    # A flipped byte anywhere in the tensor data.
    flipped = bytearray(data)
    flipped[-3] ^= 0x40
    with pytest.raises(ValidationError):
        bundle_from_bytes(bytes(flipped))


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("medfed.format", "medfed-bundle/9", "medfed.format"),
        ("medfed.threshold", '{"value": 2.0}', "medfed.threshold: value"),
        ("medfed.threshold", "not json", "medfed.threshold"),
        ("medfed.privacy_card", '{"unit": "record"}', "medfed.privacy_card"),
        ("medfed.architecture", '{"name": "mlp", "num_outputs": 1}', "medfed.architecture"),
        ("medfed.study", '{"study": {}}', "medfed.study"),
        ("medfed.statistics", '{"source": "x"}', "medfed.statistics"),
        ("medfed.round", "-1", "medfed.round"),
        ("medfed.final", "yes", "medfed.final"),
        ("medfed.parameters", "[]", "medfed.parameters"),
        ("medfed.extra", "1", "medfed.extra: unknown metadata key"),
    ],
)
def test_bad_metadata_names_the_key(bundle, key: str, value: str, words: str) -> None:  # type: ignore[no-untyped-def]
    metadata, tensors = _metadata_and_tensors(bundle_bytes(bundle))
    metadata[key] = value
    data = _rehash(metadata, tensors, list(bundle.parameters))
    with pytest.raises(ValidationError, match=words.replace(".", r"\.")):
        bundle_from_bytes(data)


def test_missing_key_and_foreign_files(tmp_path: Path, bundle) -> None:  # type: ignore[no-untyped-def]
    metadata, tensors = _metadata_and_tensors(bundle_bytes(bundle))
    del metadata["medfed.privacy_card"]
    with pytest.raises(ValidationError, match=r"medfed\.privacy_card: missing"):
        bundle_from_bytes(save(tensors, metadata=metadata))
    with pytest.raises(ValidationError, match="no medfed metadata"):
        bundle_from_bytes(save(tensors))
    for junk in (b"", b"\x00" * 4, b"\xff" * 64, b"PK\x03\x04 a zip/pickle"):
        with pytest.raises(ValidationError):
            bundle_from_bytes(junk)
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x10" + b"\x00" * 7 + b"{nope")
    with pytest.raises(ValidationError, match=str(path)):
        read_bundle(path)
    with pytest.raises(StateError, match="cannot read"):
        read_bundle(tmp_path / "absent.safetensors")


def test_inconsistent_bundle_is_not_written(tmp_path: Path, bundle) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    with pytest.raises(ValidationError, match="threshold"):
        write_bundle(tmp_path / "x.safetensors", replace(bundle, threshold=Threshold()))
    nan = {**bundle.parameters}
    first = next(iter(nan))
    nan[first] = np.full_like(nan[first], np.nan)
    with pytest.raises(ValidationError, match="NaN"):
        write_bundle(tmp_path / "x.safetensors", replace(bundle, parameters=nan))
    assert not (tmp_path / "x.safetensors").exists()
