"""A deterministic synthetic imaging cohort: five hospitals, different scanners.

For demos and tests only (no real patient looks like this). Each hospital's scanner
differs in contrast, brightness, noise and native resolution, and each hospital has
its own prevalence, so the federation is non-IID in both the inputs and the labels.
The signal is learnable: a positive image carries a bright round lesion (class 1);
with three classes, class 2 is a dark (hypodense) lesion instead.

Hospitals are written either as PNG (8- or 16-bit) or as DICOM with a modality LUT
(RescaleSlope/RescaleIntercept, Hounsfield-like values) and a stored window, so both
loading paths of `site_agent.imaging` are exercised. The same seed gives the same
files, byte for byte.
"""

from __future__ import annotations

import csv
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from common.core.errors import ConfigError

Format = Literal["png", "png16", "dicom"]


@dataclass(frozen=True)
class Scanner:
    """One hospital's acquisition: how its images differ from the others'."""

    resolution: int
    contrast: float
    brightness: float
    noise: float
    prevalence: float
    format: Format
    rescale_slope: float = 1.0
    rescale_intercept: float = -1024.0


HOSPITALS: dict[str, Scanner] = {
    "north_general": Scanner(48, 1.0, 0.00, 0.05, 0.30, "png"),
    "riverside_childrens": Scanner(32, 0.8, 0.05, 0.08, 0.15, "dicom"),
    "st_marys": Scanner(64, 1.2, -0.05, 0.03, 0.45, "png16"),
    "valley_community": Scanner(40, 0.7, 0.10, 0.10, 0.20, "dicom", rescale_slope=2.0),
    "lakeside_university": Scanner(56, 1.1, 0.00, 0.06, 0.35, "png"),
}
"""Demo hospitals, in the order the demo enrols them."""

LABELS_FILE = "labels.csv"

LESION_AMPLITUDE = 0.5
"""Peak brightness of a lesion over the tissue (before the scanner's contrast). Strong
enough that the demo's DP model learns at its default image size (28 px, 70 patients a
site, 2 rounds, epsilon 6: exact held-out AUC 0.90-0.97); at 0.22 a 16 px model stayed
near 0.5. The lesion's radius (4-8% of the field) is under a pixel below ~20 px, where
the DP model's AUC falls (0.70-0.94 at 16 px)."""


@dataclass(frozen=True)
class SyntheticImages:
    """One hospital's images: float32 [N, R, R] in [0, 1] at its scanner's resolution."""

    images: np.ndarray
    labels: np.ndarray
    patient_ids: np.ndarray
    scanner: Scanner


def _rng(seed: int, site: str) -> np.random.Generator:
    digest = hashlib.sha256(f"medfed-synthetic-imaging/{seed}/{site}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "big"))


def _one_image(rng: np.random.Generator, scanner: Scanner, label: int) -> np.ndarray:
    r = scanner.resolution
    y, x = np.mgrid[0:r, 0:r].astype(np.float64) / r
    # "Anatomy": an ellipse of soft tissue with a smooth random texture.
    cy, cx = 0.5 + rng.normal(0, 0.03, size=2)
    ay, ax = rng.uniform(0.32, 0.42, size=2)
    body = ((y - cy) / ay) ** 2 + ((x - cx) / ax) ** 2 <= 1.0
    fy, fx = rng.uniform(1.0, 3.0, size=2)
    phase = rng.uniform(0, 2 * np.pi, size=2)
    texture = 0.08 * np.sin(2 * np.pi * fy * y + phase[0]) * np.cos(2 * np.pi * fx * x + phase[1])
    image = np.where(body, 0.45 + texture, 0.05)
    if label > 0:
        # A lesion inside the body: Gaussian blob of radius ~ 1/12 of the field.
        ly = cy + rng.uniform(-0.5, 0.5) * ay
        lx = cx + rng.uniform(-0.5, 0.5) * ax
        radius = rng.uniform(0.04, 0.08)
        blob = np.exp(-(((y - ly) ** 2 + (x - lx) ** 2) / (2 * radius**2)))
        image = image + (LESION_AMPLITUDE if label == 1 else -LESION_AMPLITUDE) * blob
    image = scanner.contrast * (image - 0.45) + 0.45 + scanner.brightness
    image = image + rng.normal(0.0, scanner.noise, size=image.shape)
    return np.clip(image, 0.0, 1.0).astype(np.float32)


def generate_site_images(
    site: str, *, seed: int, patients: int = 120, num_classes: int = 2
) -> SyntheticImages:
    """One hospital's synthetic images; each patient has 1 to 3 images, one label."""
    if site not in HOSPITALS:
        raise ConfigError("site", f"unknown synthetic hospital {site!r}; known: {list(HOSPITALS)}")
    if num_classes not in (2, 3):
        raise ConfigError("num_classes", "the synthetic cohort has 2 or 3 classes")
    if patients < 1:
        raise ConfigError("patients", "must be >= 1")
    scanner = HOSPITALS[site]
    rng = _rng(seed, site)
    images: list[np.ndarray] = []
    labels: list[int] = []
    patient_ids: list[str] = []
    for p in range(patients):
        sick = rng.random() < scanner.prevalence
        label = 0
        if sick:
            label = 1 if num_classes == 2 or rng.random() < 0.5 else 2
        for _ in range(int(rng.integers(1, 4))):
            images.append(_one_image(rng, scanner, label))
            labels.append(label)
            patient_ids.append(f"{site[:3].upper()}{p:05d}")
    return SyntheticImages(
        np.stack(images), np.asarray(labels, dtype=np.int64), np.asarray(patient_ids), scanner
    )


def _write_png(path: Path, image: np.ndarray, *, bits: int) -> None:
    from PIL import Image

    if bits == 16:
        Image.fromarray(np.round(image * 65535).astype(np.uint16)).save(path)
    else:
        Image.fromarray(np.round(image * 255).astype(np.uint8), mode="L").save(path)


def hounsfield(image: np.ndarray) -> np.ndarray:
    """Synthetic intensities in [0, 1] as Hounsfield-like units in [-1000, 1000]."""
    return image.astype(np.float64) * 2000.0 - 1000.0


def write_dicom(
    path: Path,
    image: np.ndarray,
    *,
    slope: float,
    intercept: float,
    uid_seed: str,
    window: tuple[float, float] = (0.0, 2000.0),
    with_pixels: bool = True,
) -> None:
    """A minimal valid DICOM (Secondary Capture, explicit VR little endian), 16-bit.

    Stored values v satisfy HU = slope * v + intercept (PS3.3 C.11.1).
    """
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    stored = np.round((hounsfield(image) - intercept) / slope)
    stored = np.clip(stored, 0, 65535).astype(np.uint16)
    sop_uid = generate_uid(entropy_srcs=[uid_seed])
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.SOPInstanceUID = sop_uid
    ds.StudyInstanceUID = generate_uid(entropy_srcs=[uid_seed, "study"])
    ds.SeriesInstanceUID = generate_uid(entropy_srcs=[uid_seed, "series"])
    ds.Modality = "OT"
    ds.PatientID = uid_seed.split("/")[-2] if "/" in uid_seed else "SYNTHETIC"
    ds.Rows, ds.Columns = int(stored.shape[0]), int(stored.shape[1])
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.BitsAllocated = 16
    ds.BitsStored = 16
    ds.HighBit = 15
    ds.PixelRepresentation = 0
    ds.RescaleSlope = f"{slope:g}"
    ds.RescaleIntercept = f"{intercept:g}"
    ds.WindowCenter = f"{window[0]:g}"
    ds.WindowWidth = f"{window[1]:g}"
    if with_pixels:
        ds.PixelData = stored.tobytes()
    ds.save_as(path, enforce_file_format=True)


def write_site_folder(
    out_dir: str | Path,
    site: str,
    *,
    seed: int,
    patients: int = 120,
    num_classes: int = 2,
    fmt: Format | None = None,
) -> Path:
    """Write one hospital as image files + ``labels.csv`` (file,label,patient_id)."""
    data = generate_site_images(site, seed=seed, patients=patients, num_classes=num_classes)
    folder = Path(out_dir) / site
    folder.mkdir(parents=True, exist_ok=True)
    kind = fmt or data.scanner.format
    rows = []
    for i, (image, label, patient) in enumerate(zip(data.images, data.labels, data.patient_ids)):
        if kind == "dicom":
            name = f"img{i:05d}.dcm"
            write_dicom(
                folder / name,
                image,
                slope=data.scanner.rescale_slope,
                intercept=data.scanner.rescale_intercept,
                uid_seed=f"{seed}/{site}/{patient}/{i}",
            )
        else:
            name = f"img{i:05d}.png"
            _write_png(folder / name, image, bits=16 if kind == "png16" else 8)
        rows.append((name, str(int(label)), str(patient)))
    with (folder / LABELS_FILE).open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["file", "label", "patient_id"])
        writer.writerows(rows)
    return folder


def write_imaging_cohort(
    out_dir: str | Path,
    sites: list[str] | None = None,
    *,
    seed: int,
    patients_per_site: int = 120,
    num_classes: int = 2,
) -> dict[str, Path]:
    """Write every hospital's folder under `out_dir`; returns site -> folder."""
    return {
        site: write_site_folder(
            out_dir, site, seed=seed, patients=patients_per_site, num_classes=num_classes
        )
        for site in (sites or list(HOSPITALS))
    }


def in_memory_images(
    site: str,
    *,
    seed: int,
    patients: int,
    image_size: int,
    num_classes: int = 2,
    channels: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images float32 [N, C, S, S], labels, patient ids) without writing files
    (benchmarks); resized like the loader does."""
    from site_agent.imaging import _resize

    data = generate_site_images(site, seed=seed, patients=patients, num_classes=num_classes)
    resized = np.stack([_resize(img, image_size) for img in data.images])[:, None]
    if channels == 3:
        resized = np.repeat(resized, 3, axis=1)
    return resized.astype(np.float32), data.labels, data.patient_ids
