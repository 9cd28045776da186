"""Image folders (real PNG and DICOM files) load, fail clearly, stream, and train with DP."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.core.errors import ConfigError, DataError
from common.models.build import build_model
from common.models.layout import flatten_parameters
from common.releases.evaluation import metrics_from_scores
from site_agent.imaging import ImageSpec, dicom_window, load_image_folder
from site_agent.synthetic_imaging import (
    HOSPITALS,
    generate_site_images,
    hounsfield,
    write_dicom,
    write_site_folder,
)
from site_agent.trainer import LocalTrainer
from site_agent.training_config import TrainingConfig
from site_agent.unit_split import split_by_patient
from tests.training.helpers import multiclass_metrics_from_scores

SPEC = ImageSpec(image_size=16, channels=1, patient_column="patient_id")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("cohort")
    return {
        "png": write_site_folder(out, "north_general", seed=3, patients=70),
        "dicom": write_site_folder(out, "valley_community", seed=3, patients=70),
    }


def write_labels(folder: Path, rows: list[tuple[str, str, str]]) -> None:
    with (folder / "labels.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "label", "patient_id"])
        writer.writerows(rows)


def test_synthetic_cohort_is_deterministic_and_non_iid() -> None:
    a = generate_site_images("north_general", seed=1, patients=40)
    b = generate_site_images("north_general", seed=1, patients=40)
    np.testing.assert_array_equal(a.images, b.images)
    other = generate_site_images("st_marys", seed=1, patients=40)
    assert a.images.shape[1:] == (48, 48) and other.images.shape[1:] == (64, 64)
    assert {s.format for s in HOSPITALS.values()} >= {"png", "dicom"}
    assert len(set(s.prevalence for s in HOSPITALS.values())) == len(HOSPITALS)


def test_png_and_dicom_folders_load_with_patients(folders: dict[str, Path]) -> None:
    for kind, folder in folders.items():
        data = load_image_folder(folder, SPEC)
        assert data.num_patients == 70 and len(data) > 70  # several images per patient
        assert {e.kind for e in data.entries} == {"raster" if kind == "png" else "dicom"}
        batch = data.load([0, 1, 2])
        assert batch.shape == (3, 1, 16, 16) and batch.dtype == torch.float32
        assert float(batch.min()) >= 0.0 and float(batch.max()) <= 1.0
        rgb = load_image_folder(folder, ImageSpec(image_size=16, channels=3))
        torch.testing.assert_close(rgb.load([0])[:, 0], batch[:1, 0])  # gray replicated
        train, held_out = split_by_patient(data, held_out_fraction=0.25, key=b"k" * 32)
        assert not set(train.patient_ids) & set(held_out.patient_ids)
        assert len(train) + len(held_out) == len(data)


def test_dicom_rescale_and_window(tmp_path: Path) -> None:
    image = np.linspace(0.0, 1.0, 64, dtype=np.float32).reshape(8, 8)
    write_dicom(
        tmp_path / "a.dcm",
        image,
        slope=2.0,
        intercept=-1024.0,
        uid_seed="t/p/0",
        window=(0.0, 2000.0),
    )
    write_labels(tmp_path, [("a.dcm", "1", "p")])
    spec = ImageSpec(image_size=8, patient_column="patient_id")
    got = load_image_folder(tmp_path, spec).load([0])[0, 0].numpy()
    # File window spans the full synthetic HU range: back to the original intensities
    # (up to the slope-2 quantisation of the stored values, 2 HU = 0.001).
    np.testing.assert_allclose(got, image, atol=2e-3)
    # A study-given window (HU -200..200) overrides the file's.
    windowed = (
        load_image_folder(
            tmp_path, ImageSpec(image_size=8, patient_column="patient_id", window=(0.0, 400.0))
        )
        .load([0])[0, 0]
        .numpy()
    )
    expected = dicom_window(hounsfield(image), center=0.0, width=400.0)
    np.testing.assert_allclose(windowed, expected, atol=6e-3)
    assert windowed.min() == 0.0 and windowed.max() == 1.0


def test_bad_input_names_the_file(tmp_path: Path) -> None:
    def folder(name: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        Image.fromarray(np.zeros((8, 8), dtype=np.uint8), mode="L").save(path / "ok.png")
        return path

    bad = folder("unreadable")
    (bad / "broken.png").write_bytes(b"not a png at all")
    write_labels(bad, [("ok.png", "0", "a"), ("broken.png", "1", "b")])
    with pytest.raises(DataError, match="unreadable image") as info:
        load_image_folder(bad, SPEC)
    assert info.value.file is not None and info.value.file.endswith("broken.png")

    colour = folder("colour")
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8), mode="RGB").save(colour / "rgb.png")
    write_labels(colour, [("ok.png", "0", "a"), ("rgb.png", "1", "b")])
    with pytest.raises(DataError, match="3 channels, the study declares 1") as info:
        load_image_folder(colour, SPEC)
    assert info.value.file is not None and info.value.file.endswith("rgb.png")

    unlisted = folder("unlisted")
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8), mode="L").save(unlisted / "extra.png")
    write_labels(unlisted, [("ok.png", "0", "a")])
    with pytest.raises(DataError, match="no row in the labels CSV") as info:
        load_image_folder(unlisted, SPEC)
    assert info.value.file is not None and info.value.file.endswith("extra.png")

    outside = folder("outside")
    write_labels(outside, [("ok.png", "2", "a")])
    with pytest.raises(DataError, match="not one of the classes") as info:
        load_image_folder(outside, SPEC)
    assert info.value.row == 2 and info.value.column == "label"

    missing = folder("missing")
    write_labels(missing, [("ok.png", "0", "a"), ("gone.png", "1", "b")])
    with pytest.raises(DataError, match=r"gone\.png listed but not found"):
        load_image_folder(missing, SPEC)

    no_pixels = folder("nopixels")
    write_dicom(
        no_pixels / "empty.dcm",
        np.zeros((8, 8), np.float32),
        slope=1.0,
        intercept=-1024.0,
        uid_seed="x/y/z",
        with_pixels=False,
    )
    write_labels(no_pixels, [("ok.png", "0", "a"), ("empty.dcm", "1", "b")])
    with pytest.raises(DataError, match="no pixel data") as info:
        load_image_folder(no_pixels, SPEC)
    assert info.value.file is not None and info.value.file.endswith("empty.dcm")

    not_dicom = folder("notdicom")
    (not_dicom / "junk.dcm").write_bytes(b"\x00" * 10)
    write_labels(not_dicom, [("ok.png", "0", "a"), ("junk.dcm", "1", "b")])
    with pytest.raises(DataError) as info:
        load_image_folder(not_dicom, SPEC)
    assert info.value.file is not None and info.value.file.endswith("junk.dcm")

    with pytest.raises(ConfigError):
        ImageSpec(channels=2)


def test_labels_csv_is_read_like_a_study_table(tmp_path: Path) -> None:
    """data.py's reader: a spreadsheet's byte-order mark and padded header names are
    accepted, and errors carry the row a spreadsheet shows."""
    folder = tmp_path / "excel"
    folder.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        Image.fromarray(np.zeros((8, 8), dtype=np.uint8), mode="L").save(folder / name)
    labels = folder / "labels.csv"
    labels.write_text(
        "\ufefffile, label ,patient_id\na.png,0,p1\nb.png,1,p2\nc.png,1,p3\n",
        encoding="utf-8",
    )
    data = load_image_folder(folder, SPEC)
    assert list(data.labels) == [0, 1, 1] and list(data.patient_ids) == ["p1", "p2", "p3"]
    labels.write_text("file,label,patient_id\na.png,0,p1\nb.png,1,\nc.png,1,p3\n")
    with pytest.raises(DataError, match="missing patient id") as info:
        load_image_folder(folder, SPEC)
    assert (info.value.file, info.value.row, info.value.column) == (
        str(labels), 3, "patient_id"
    )
    labels.write_text("file,patient_id\na.png,p1\n")
    with pytest.raises(DataError, match="missing column") as info:
        load_image_folder(folder, SPEC)
    assert (info.value.row, info.value.column) == (1, "label")


def test_decoded_images_stream_through_a_bounded_cache(folders: dict[str, Path]) -> None:
    one_image = 1 * 16 * 16 * 4
    data = load_image_folder(
        folders["png"],
        ImageSpec(image_size=16, patient_column="patient_id", cache_bytes=5 * one_image),
    )
    first = data.load(np.arange(len(data)))
    assert len(data.cache) == 5 and data.cache.bytes <= 5 * one_image
    torch.testing.assert_close(data.load(np.arange(len(data))), first)  # re-decoded alike


def image_config(**changes: object) -> TrainingConfig:
    base = dict(
        batch_size=16,
        max_physical_batch_size=64,
        lr=0.5,
        target_epsilon=30.0,
        delta=1e-3,
        planned_rounds=1,
        local_epochs=4,
        privacy_unit="patient",
        device="cpu",
    )
    base.update(changes)
    return TrainingConfig(**base)  # type: ignore[arg-type]


def cnn(num_classes: int = 2):  # type: ignore[no-untyped-def]
    def factory() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model("cnn", in_channels=1, num_classes=num_classes)

    return factory


def test_patient_level_dp_on_an_image_folder_learns(folders: dict[str, Path]) -> None:
    # A cache of 12 decoded images for ~100: training streams from disk.
    bound = 12 * 16 * 16 * 4
    data = load_image_folder(folders["dicom"], replace(SPEC, cache_bytes=bound))
    # A fixed split key: about 17 held-out patients make this AUC noisy (under 4 of the 6
    # keys tried the untrained model already scored higher, or one class was held out).
    train, held_out = split_by_patient(data, held_out_fraction=0.25, key=b"b" * 32)
    trainer = LocalTrainer(cnn(), train, image_config(), seed=0)
    assert trainer.privacy_unit == "patient" and trainer.num_units == train.num_patients
    start = flatten_parameters(trainer.model)
    before = metrics_from_scores(trainer.predict(held_out), held_out.labels).auc
    result = trainer.train_round(start)
    after = metrics_from_scores(trainer.predict(held_out), held_out.labels).auc
    assert np.isfinite(result.mean_loss) and after > max(before, 0.7)
    assert len(train) > 12 * 5 and 0 < train.cache.bytes <= bound


def test_patient_groups_split_into_physical_batches_give_the_same_step(
    folders: dict[str, Path],
) -> None:
    data = load_image_folder(folders["png"], SPEC)
    deltas = []
    for physical in (4, 1024):  # 4: many groups, patients split over chunks
        trainer = LocalTrainer(
            cnn(), data, image_config(max_physical_batch_size=physical, local_epochs=1), seed=5
        )
        deltas.append(trainer.train_round(flatten_parameters(trainer.model)).delta_flat)
    np.testing.assert_allclose(deltas[0], deltas[1], rtol=1e-4, atol=1e-6)


def test_multiclass_images_record_level_with_per_class_auc(tmp_path: Path) -> None:
    folder = write_site_folder(tmp_path, "st_marys", seed=2, patients=90, num_classes=3)
    spec = ImageSpec(image_size=16, classes=("0", "1", "2"), patient_column="patient_id")
    data = load_image_folder(folder, spec)
    assert set(np.unique(data.labels)) == {0, 1, 2}
    train, held_out = split_by_patient(data, held_out_fraction=0.25, key=b"k" * 32)
    config = image_config(task="multiclass", num_classes=3, privacy_unit="record", local_epochs=6)
    trainer = LocalTrainer(cnn(3), train, config, seed=0)
    choice = trainer.grad_sample_choice  # auto: the faster mode, measured on this model
    assert choice is not None and choice.source == "measured"
    assert choice.batch_shape[1:] == (1, 16, 16) and trainer.grad_sample_mode == choice.mode
    trainer.train_round(flatten_parameters(trainer.model))
    scores = trainer.predict(held_out)
    assert scores.shape == (len(held_out), 3)
    np.testing.assert_allclose(scores.sum(axis=1), 1.0, rtol=1e-6)
    metrics = multiclass_metrics_from_scores(scores, held_out.labels)
    assert len(metrics.per_class_auc) == 3 and metrics.macro_auc > 0.6


def test_study_style_spec_non_square_size_and_numeric_classes(tmp_path: Path) -> None:
    Image.fromarray(np.full((12, 20), 200, dtype=np.uint8), mode="L").save(tmp_path / "a.png")
    write_labels(tmp_path, [("a.png", "1.0", "p1")])
    spec = ImageSpec(image_size=(8, 16), classes=(0, 1), patient_column="patient_id")
    data = load_image_folder(tmp_path, spec)
    assert data.labels.tolist() == [1]  # "1.0" names class 1, as in the study
    image = data.load([0])
    assert image.shape == (1, 1, 8, 16)
    torch.testing.assert_close(image, torch.full((1, 1, 8, 16), 200 / 255))
