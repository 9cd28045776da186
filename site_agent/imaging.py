"""A site's images: a folder of PNG/JPEG or DICOM files plus a labels CSV.

The labels CSV has one row per image: ``file`` (path relative to the folder),
``label`` (one of the study's declared classes) and optionally a patient id column.
All of a patient's images are one privacy unit under patient-level DP, exactly as a
patient's rows are for tables: `ImageDataset.patient_ids` plays the role of
`SiteData.patient_ids` and the trainer groups by it.

Images are checked when the dataset is opened (headers only: format, channels, DICOM
pixel data present) and decoded when training touches them, through a bounded LRU
cache of decoded tensors, so a site with more images than memory still trains.
A site in a round opens its folder with ``blank_unreadable``: a file that fails to decode
then (truncated pixel data, a disk error, a file replaced since the site joined) is an
all-zero image, logged at the site, so the record still contributes its
clipped gradient and the round goes on. Raising there would stop the site in the middle
of a round whose sampled batch happened to hold that record: a dropout the coordinator
could read as a fact about the site's data. Offline commands (`medfed predict`, `data
check`) keep the error.

Pixel values become float32 in [0, 1]:
  * PNG/JPEG: divided by the format's maximum (255, or 65535 for 16-bit), the same
    for every image.
  * DICOM (PS3.3 C.11.1 and C.11.2.1.2): stored values -> modality LUT
    (``RescaleSlope * x + RescaleIntercept``, e.g. Hounsfield units), then the
    window (the study's, else the file's WindowCenter/WindowWidth, else the image's
    own min..max) mapped linearly to [0, 1]; MONOCHROME1 is inverted so that bright
    always means dense.
Then each image is resized (bilinear) to the study's square size.

Every problem is a `DataError` naming the file (and the CSV row where one applies).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.core.errors import ConfigError, DataError
from site_agent.data import HEADER_ROW, iter_table_rows

if TYPE_CHECKING:
    from common.study import Study

log = logging.getLogger("medfed.site")

PNG_SUFFIXES = (".png", ".jpg", ".jpeg")
DICOM_SUFFIXES = (".dcm", ".dicom")
_GRAY_MODES = {"1", "L", "I", "I;16", "I;16B", "I;16L", "F", "LA"}
_COLOUR_MODES = {"RGB", "RGBA", "P", "CMYK", "YCbCr", "RGBX"}
DEFAULT_CACHE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ImageSpec:
    """How images become model inputs (the study's ``[data]`` section).

    `window` = (center, width) overrides DICOM files' own window, in modality units
    (e.g. Hounsfield: (40, 80) is a brain window).
    """

    image_size: int | tuple[int, int] = 64
    channels: int = 1
    classes: tuple[str | int, ...] = ("0", "1")
    file_column: str = "file"
    label_column: str = "label"
    patient_column: str | None = None
    window: tuple[float, float] | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    # A site in a round: a file that fails to decode is an all-zero image (module
    # docstring), not a DataError.
    blank_unreadable: bool = False

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) every image is resized to."""
        size = self.image_size
        return (size, size) if isinstance(size, int) else size

    def class_index(self, cell: str) -> int | None:
        """Index of the class a label cell names (``1.0`` matches 1); None if none."""
        text = cell.strip()
        for i, name in enumerate(self.classes):
            if text == str(name).strip():
                return i
        try:
            value = float(text)
        except ValueError:
            return None
        for i, name in enumerate(self.classes):
            try:
                if float(str(name)) == value:
                    return i
            except ValueError:
                continue
        return None

    def __post_init__(self) -> None:
        size = self.image_size
        if isinstance(size, int):
            size = (size, size)
        if len(size) != 2 or min(size) < 4:
            raise ConfigError("data.image_size", "must be >= 4 pixels (one size, or [h, w])")
        object.__setattr__(self, "image_size", (int(size[0]), int(size[1])))
        if self.channels not in (1, 3):
            raise ConfigError("data.channels", "must be 1 (grayscale) or 3 (RGB)")
        texts = [str(c).strip() for c in self.classes]
        if len(texts) < 2 or len(set(texts)) != len(texts):
            raise ConfigError("data.classes", "need at least 2 distinct classes")
        if self.window is not None and not self.window[1] > 0:
            raise ConfigError("data.window", "width must be positive")
        if self.cache_bytes < 0:
            raise ConfigError("data.cache_bytes", "must be >= 0")


@dataclass(frozen=True)
class _Entry:
    path: Path
    kind: str  # "raster" or "dicom"


class _LruCache:
    """Decoded images by index, evicted least-recently-used beyond `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: int) -> torch.Tensor | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: int, value: torch.Tensor) -> None:
        size = value.element_size() * value.numel()
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= old.element_size() * old.numel()

    def __len__(self) -> int:
        return len(self._items)


class ImageDataset:
    """Labelled images of one site, decoded lazily; indexable like `SiteData`."""

    def __init__(
        self,
        entries: Sequence[_Entry],
        labels: np.ndarray,
        patient_ids: np.ndarray | None,
        spec: ImageSpec,
        *,
        source: str = "",
        cache: _LruCache | None = None,
    ) -> None:
        self.entries = list(entries)
        self.labels = labels
        self.patient_ids = patient_ids
        self.spec = spec
        self.source = source
        self.cache = cache if cache is not None else _LruCache(spec.cache_bytes)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_patients(self) -> int:
        """Distinct patients (images count as patients when there is no id column)."""
        if self.patient_ids is None:
            return len(self)
        return int(np.unique(self.patient_ids).shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one decoded image."""
        height, width = self.spec.size
        return (self.spec.channels, height, width)

    @property
    def record_shape(self) -> tuple[int, ...]:
        """Shape of one model input (`Records`): (channels, height, width)."""
        return self.shape

    def loader(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """Model inputs of a tensor of image indices, decoded per physical batch
        (through the bounded cache) and moved to `device` (`Records`)."""
        return lambda index: self.load(index.cpu().numpy()).to(device)

    def subset(self, index: np.ndarray) -> ImageDataset:
        """The images at `index` (own cache of the same size)."""
        idx = np.asarray(index, dtype=np.int64)
        return ImageDataset(
            [self.entries[i] for i in idx],
            self.labels[idx],
            None if self.patient_ids is None else self.patient_ids[idx],
            self.spec,
            source=self.source,
        )

    def image(self, i: int) -> torch.Tensor:
        """Image i as float32 [C, H, W] in [0, 1] (decoded, or from the cache)."""
        cached = self.cache.get(i)
        if cached is not None:
            return cached
        entry = self.entries[i]
        try:
            array = (_decode_dicom(entry.path, self.spec) if entry.kind == "dicom"
                     else _decode_raster(entry.path, self.spec))
        except DataError as exc:
            if not self.spec.blank_unreadable:
                raise
            log.warning("%s: trained and scored as an all-zero image", exc,
                        extra={"event": "image_unreadable", "file": str(entry.path)})
            array = np.zeros(self.shape, dtype=np.float32)
        tensor = torch.from_numpy(array)
        self.cache.put(i, tensor)
        return tensor

    def load(self, index: Sequence[int] | np.ndarray) -> torch.Tensor:
        """A batch [n, C, H, W] float32 of the images at `index`."""
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return torch.zeros((0, *self.shape), dtype=torch.float32)
        return torch.stack([self.image(int(i)) for i in idx])


# ---------------------------------------------------------------- decoding
def _resize(plane: np.ndarray, size: int | tuple[int, int]) -> np.ndarray:
    """Bilinear resize of a float32 [H, W] plane to `size` = (h, w) (Pillow, mode F)."""
    from PIL import Image

    height, width = (size, size) if isinstance(size, int) else size
    if plane.shape == (height, width):
        return plane
    image = Image.fromarray(np.ascontiguousarray(plane, dtype=np.float32), mode="F")
    resized = image.resize((width, height), Image.Resampling.BILINEAR)
    return np.asarray(resized, dtype=np.float32)


def _to_channels(planes: np.ndarray, channels: int, path: Path) -> np.ndarray:
    """[c, H, W] -> [channels, H, W]: gray is replicated to RGB; colour to 1 is refused."""
    have = planes.shape[0]
    if have == channels:
        return planes
    if have == 1 and channels == 3:
        return np.repeat(planes, 3, axis=0)
    raise DataError(f"image has {have} channels, the study declares {channels}", file=str(path))


def _raster_channels(mode: str) -> int:
    if mode in _GRAY_MODES:
        return 1
    if mode in _COLOUR_MODES:
        return 3
    return -1


MAX_IMAGE_PIXELS = 89_478_485
"""The most pixels one PNG/JPEG may have (Pillow's own decompression-bomb warning
limit, about 9459 x 9459): a larger one is refused from its header, before decoding.
The study's image size is at most 8192 x 8192."""


def _pil_errors() -> tuple[type[BaseException], ...]:
    """What Pillow raises for a file it cannot (or must not) decode: OSError (truncated,
    decoder errors), its UnidentifiedImageError, ValueError (oversized text chunks),
    DecompressionBombError (too many pixels), SyntaxError and EOFError (broken
    chunks)."""
    from PIL import Image, UnidentifiedImageError

    return (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError,
            SyntaxError, EOFError)


def _open_raster(path: Path) -> Any:
    """Open a PNG/JPEG for reading its header, refusing a decompression bomb (more than
    MAX_IMAGE_PIXELS pixels) before any pixel is decoded."""
    from PIL import Image

    image = Image.open(path)
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        image.close()
        raise DataError(
            f"image is {width} x {height} pixels, more than the {MAX_IMAGE_PIXELS} allowed "
            "(a decompression bomb?)", file=str(path),
        )
    return image


def _decode_raster(path: Path, spec: ImageSpec) -> np.ndarray:
    try:
        with _open_raster(path) as image:
            image.load()
            mode = image.mode
            if _raster_channels(mode) == 3:
                rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
                planes = rgb.transpose(2, 0, 1)
            elif mode in ("I;16", "I;16B", "I;16L"):
                planes = (np.asarray(image, dtype=np.float32) / 65535.0)[None]
            elif mode == "I":
                # 32-bit integer PNGs hold 16-bit data in practice; one fixed scale for
                # every image (a per-image scale would differ between patients).
                raw = np.asarray(image, dtype=np.float32)
                planes = np.clip(raw / 65535.0, 0.0, 1.0)[None]
            elif mode == "F":
                planes = np.clip(np.asarray(image, dtype=np.float32), 0.0, 1.0)[None]
            elif mode in ("1", "L", "LA"):
                planes = (np.asarray(image.convert("L"), dtype=np.float32) / 255.0)[None]
            else:
                raise DataError(f"unsupported image mode {mode!r}", file=str(path))
    except _pil_errors() as exc:
        raise DataError(f"unreadable image: {exc}", file=str(path)) from exc
    planes = _to_channels(planes, spec.channels, path)
    return np.stack([_resize(p, spec.size) for p in planes]).astype(np.float32)


def _first(value: Any) -> float:
    """First value of a possibly multi-valued DICOM number (WindowCenter may be a list)."""
    if isinstance(value, str | bytes):
        return float(value)
    try:
        return float(value[0])
    except TypeError:
        return float(value)


def dicom_window(values: np.ndarray, *, center: float, width: float) -> np.ndarray:
    """Linear VOI window to [0, 1] (PS3.3 C.11.2.1.2.1, without its half-pixel offsets)."""
    low = center - width / 2.0
    return np.clip((values - low) / width, 0.0, 1.0).astype(np.float32)


def _decode_dicom(path: Path, spec: ImageSpec) -> np.ndarray:
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(path)
    except (InvalidDicomError, OSError, ValueError) as exc:
        raise DataError(f"unreadable DICOM file: {exc}", file=str(path)) from exc
    if "PixelData" not in ds:
        raise DataError("DICOM file has no pixel data", file=str(path))
    try:
        stored = np.asarray(ds.pixel_array, dtype=np.float64)
    except (ValueError, RuntimeError, NotImplementedError, AttributeError) as exc:
        raise DataError(f"cannot decode DICOM pixel data: {exc}", file=str(path)) from exc
    samples = int(ds.get("SamplesPerPixel", 1))
    if samples == 1 and stored.ndim != 2:
        raise DataError(
            f"DICOM pixel data has shape {stored.shape}; one 2-D frame expected", file=str(path)
        )
    slope = float(ds.get("RescaleSlope", 1.0) or 1.0)
    intercept = float(ds.get("RescaleIntercept", 0.0) or 0.0)
    if samples == 1:
        values = stored * slope + intercept
        if spec.window is not None:
            center, width = spec.window
        elif "WindowCenter" in ds and "WindowWidth" in ds:
            center, width = _first(ds.WindowCenter), _first(ds.WindowWidth)
        else:
            low, high = float(values.min()), float(values.max())
            center, width = (low + high) / 2.0, max(high - low, 1e-6)
        if not width > 0:
            raise DataError(f"DICOM window width {width} is not positive", file=str(path))
        plane = dicom_window(values, center=center, width=width)
        if str(ds.get("PhotometricInterpretation", "MONOCHROME2")) == "MONOCHROME1":
            plane = 1.0 - plane
        planes = plane[None]
    elif samples == 3 and stored.ndim == 3:
        bits = int(ds.get("BitsStored", 8))
        planes = (stored / float(2**bits - 1)).astype(np.float32).transpose(2, 0, 1)
    else:
        raise DataError(f"DICOM has {samples} samples per pixel", file=str(path))
    planes = _to_channels(planes.astype(np.float32), spec.channels, path)
    return np.stack([_resize(p, spec.size) for p in planes]).astype(np.float32)


# ------------------------------------------------------------- validation
def _check_header(path: Path, kind: str, spec: ImageSpec) -> None:
    """Cheap per-file check at open time: readable header, channels, pixel data present."""
    if kind == "raster":
        try:
            with _open_raster(path) as image:
                mode = image.mode
        except _pil_errors() as exc:
            raise DataError(f"unreadable image: {exc}", file=str(path)) from exc
        have = _raster_channels(mode)
        if have < 0:
            raise DataError(f"unsupported image mode {mode!r}", file=str(path))
    else:
        import pydicom
        from pydicom.errors import InvalidDicomError

        try:
            # Large values (the pixel data) are deferred: only the header is parsed.
            ds = pydicom.dcmread(path, defer_size=1024)
        except (InvalidDicomError, OSError, ValueError) as exc:
            raise DataError(f"unreadable DICOM file: {exc}", file=str(path)) from exc
        if "PixelData" not in ds:
            raise DataError("DICOM file has no pixel data", file=str(path))
        have = int(ds.get("SamplesPerPixel", 1))
    if not (have == spec.channels or (have == 1 and spec.channels == 3)):
        raise DataError(
            f"image has {have} channels, the study declares {spec.channels}", file=str(path)
        )


def _kind(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix in PNG_SUFFIXES:
        return "raster"
    if suffix in DICOM_SUFFIXES:
        return "dicom"
    return None


def load_image_folder(
    folder: str | Path,
    spec: ImageSpec,
    *,
    labels_csv: str | Path | None = None,
    check_headers: bool = True,
    labels_optional: bool = False,
) -> ImageDataset:
    """Open a site's image folder and its labels CSV (default ``FOLDER/labels.csv``).

    Every image file in the folder (recursively) must have a label row and every row
    must name an existing image; labels must be declared classes. With
    `labels_optional` (scoring new images) a CSV without the label column gives
    labels of -1.
    """
    root = Path(folder)
    if not root.is_dir():
        raise DataError("image folder does not exist", file=str(root))
    csv_path = Path(labels_csv) if labels_csv is not None else root / "labels.csv"
    if not csv_path.is_file():
        raise DataError("labels CSV not found", file=str(csv_path))
    # The labels file is read by data.py's reader (CSV or Parquet, row numbers as a
    # spreadsheet shows them), the same as a table study's file.
    header, records = iter_table_rows(csv_path)
    has_labels = spec.label_column in header or not labels_optional
    needed = [spec.file_column, spec.label_column] if has_labels else [spec.file_column]
    if spec.patient_column is not None and (has_labels or spec.patient_column in header):
        needed.append(spec.patient_column)
    read_patients = spec.patient_column in needed
    for column in needed:
        if column not in header:
            raise DataError("missing column", file=str(csv_path), row=HEADER_ROW, column=column)
    rows: dict[str, tuple[int, int, str | None]] = {}
    for line, record in records:
        name = (record.get(spec.file_column) or "").strip()
        if not name:
            raise DataError(
                "empty file name", file=str(csv_path), row=line, column=spec.file_column
            )
        label = (record.get(spec.label_column) or "").strip()
        index = spec.class_index(label) if has_labels else -1
        if index is None:
            raise DataError(
                f"label {label!r} of {name} is not one of the classes {list(spec.classes)}",
                file=str(csv_path),
                row=line,
                column=spec.label_column,
            )
        patient: str | None = None
        if spec.patient_column is not None and read_patients:
            patient = (record.get(spec.patient_column) or "").strip()
            if not patient:
                raise DataError(
                    "missing patient id",
                    file=str(csv_path),
                    row=line,
                    column=spec.patient_column,
                )
        key = Path(name).as_posix()
        if key in rows:
            raise DataError(f"{name} is listed twice", file=str(csv_path), row=line)
        rows[key] = (line, index, patient)
    on_disk = {
        p.relative_to(root).as_posix(): p
        for p in sorted(root.rglob("*"))
        if p.is_file() and _kind(p) is not None
    }
    for key in on_disk:
        if key not in rows:
            raise DataError("image has no row in the labels CSV", file=str(on_disk[key]))
    entries: list[_Entry] = []
    labels: list[int] = []
    patients: list[str] = []
    for key, (line, label_index, patient) in rows.items():
        path = root / key
        kind = _kind(path)
        if kind is None:
            raise DataError(
                f"{key}: not a PNG, JPEG or DICOM file name", file=str(csv_path), row=line
            )
        if key not in on_disk:
            raise DataError(f"image {key} listed but not found", file=str(csv_path), row=line)
        if check_headers:
            _check_header(path, kind, spec)
        entries.append(_Entry(path, kind))
        labels.append(label_index)
        if patient is not None:
            patients.append(patient)
    if not entries:
        raise DataError("no images listed", file=str(csv_path))
    return ImageDataset(
        entries,
        np.asarray(labels, dtype=np.int64),
        np.asarray(patients) if spec.patient_column is not None and read_patients else None,
        spec,
        source=str(root),
    )


def image_spec_for_study(study: Study, *, cache_bytes: int = DEFAULT_CACHE_BYTES,
                         blank_unreadable: bool = False) -> ImageSpec:
    """How an images study's ``[data]`` section reads a site's folder (`blank_unreadable`:
    a site in a round, module docstring)."""
    data = study.data
    if data.kind != "images" or data.image_size is None or data.file_column is None:
        raise ConfigError("data.kind", "not an images study (file_column and image_size)")
    return ImageSpec(
        image_size=data.image_size,
        channels=data.channels or 1,
        classes=tuple(study.study.classes),
        file_column=data.file_column,
        label_column=data.label_column,
        patient_column=data.patient_column,
        cache_bytes=cache_bytes,
        blank_unreadable=blank_unreadable,
    )
