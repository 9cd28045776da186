"""Compressed DICOM as hospitals' PACS export it: JPEG-LS, JPEG 2000 and JPEG lossless
(process 14, selection value 1) files, made here, decode to the very pixels they were
made from, and a site's image folder of them gives the same model inputs as the
uncompressed files. The codecs are declared dependencies (pylibjpeg, its libjpeg and
openjpeg plug-ins, pyjpegls); each test skips, naming the package, where one is absent.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

pydicom = pytest.importorskip("pydicom")

from pydicom.dataset import Dataset, FileMetaDataset  # noqa: E402
from pydicom.encaps import encapsulate  # noqa: E402
from pydicom.uid import (  # noqa: E402
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    SecondaryCaptureImageStorage,
    generate_uid,
)

from site_agent.imaging import ImageSpec, load_image_folder  # noqa: E402

BITS = 12


def pixels(seed: int) -> np.ndarray:
    """A 12-bit CT-like slice: a smooth body, an edge, and noise (not trivially flat)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:48, 0:40]
    body = 1500 + 600 * np.exp(-((x - 20) ** 2 + (y - 24) ** 2) / 200.0)
    body[10:20, 5:12] = 3900
    return np.clip(body + rng.integers(-40, 41, body.shape), 0, 2**BITS - 1).astype(np.uint16)


def dataset(array: np.ndarray) -> Dataset:
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.SOPClassUID = SecondaryCaptureImageStorage
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID
    ds.Modality = "OT"
    ds.Rows, ds.Columns = array.shape
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = 16, BITS, BITS - 1
    ds.PixelRepresentation = 0
    ds.WindowCenter, ds.WindowWidth = 2000, 4000
    ds.PixelData = array.tobytes()
    return ds


# ------------------------------------------------------------- JPEG lossless encoder
# ITU-T T.81 (ISO/IEC 10918-1) annex H: lossless process 14, predictor 1 (left), one
# component, one scan. pydicom has no encoder for it; this small one makes the files a
# PACS would send, so the decoder under test is checked against pixels we know.


class _Bits:
    def __init__(self) -> None:
        self.out = bytearray()
        self.acc = 0
        self.n = 0

    def put(self, value: int, length: int) -> None:
        for shift in range(length - 1, -1, -1):
            self.acc = (self.acc << 1) | ((value >> shift) & 1)
            self.n += 1
            if self.n == 8:
                self.out.append(self.acc)
                if self.acc == 0xFF:
                    self.out.append(0x00)  # byte stuffing (F.1.2.3)
                self.acc, self.n = 0, 0

    def flush(self) -> bytes:
        if self.n:
            self.put((1 << (8 - self.n)) - 1, 8 - self.n)  # pad with 1-bits
        return bytes(self.out)


def jpeg_lossless(array: np.ndarray, precision: int) -> bytes:
    rows, cols = array.shape
    # Huffman table: the 17 difference categories (SSSS 0..16), each a 5-bit code.
    lengths = [0, 0, 0, 0, 17] + [0] * 11
    symbols = list(range(17))
    codes = {s: (s, 5) for s in symbols}  # canonical codes 00000..10000
    stream = _Bits()
    image = array.astype(np.int64)
    for r in range(rows):
        for c in range(cols):
            if r == 0 and c == 0:
                prediction = 1 << (precision - 1)
            elif r == 0:
                prediction = int(image[r, c - 1])
            elif c == 0:
                prediction = int(image[r - 1, c])
            else:
                prediction = int(image[r, c - 1])
            diff = (int(image[r, c]) - prediction) % 65536
            if diff >= 32768:
                diff -= 65536
            category = 16 if diff == -32768 else abs(diff).bit_length()
            stream.put(*codes[category])
            if 0 < category < 16:
                extra = diff if diff > 0 else diff - 1
                stream.put(extra & ((1 << category) - 1), category)
    frame = bytes([precision]) + rows.to_bytes(2, "big") + cols.to_bytes(2, "big") + bytes(
        [1, 1, 0x11, 0])
    huffman = bytes([0x00]) + bytes(lengths) + bytes(symbols)
    scan = bytes([1, 1, 0x00, 1, 0, 0])  # 1 component, table 0, Ss=1 (predictor), Se, Ah/Al
    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body
    return (b"\xff\xd8" + segment(0xC3, frame) + segment(0xC4, huffman)
            + segment(0xDA, scan) + stream.flush() + b"\xff\xd9")


# ------------------------------------------------------------------------- files


def write(path: Path, array: np.ndarray, syntax: str) -> Path:
    ds = dataset(array)
    if syntax == ExplicitVRLittleEndian:
        pass
    elif syntax == JPEGLosslessSV1:
        ds.PixelData = encapsulate([jpeg_lossless(array, BITS)])
        ds.file_meta.TransferSyntaxUID = JPEGLosslessSV1
    else:
        ds.compress(syntax)
    ds.save_as(path, enforce_file_format=True)
    return path


CODECS = {
    JPEGLSLossless: ("pyjpegls", "jpeg_ls"),
    JPEG2000Lossless: ("pylibjpeg-openjpeg", "openjpeg"),
    JPEGLosslessSV1: ("pylibjpeg-libjpeg", "libjpeg"),
}


@pytest.mark.parametrize("syntax", list(CODECS), ids=lambda uid: uid.name)
def test_compressed_files_decode_to_their_pixels(tmp_path: Path, syntax: str) -> None:
    package, module = CODECS[syntax]
    pytest.importorskip(module, reason=f"{package} not installed (a declared dependency)")
    if syntax != JPEGLSLossless:
        pytest.importorskip("pylibjpeg", reason="pylibjpeg not installed")
    array = pixels(1)
    path = write(tmp_path / "slice.dcm", array, syntax)
    read = pydicom.dcmread(path)
    assert read.file_meta.TransferSyntaxUID == syntax
    assert read.file_meta.TransferSyntaxUID.is_compressed
    assert len(path.read_bytes()) < array.nbytes  # really compressed
    assert np.array_equal(read.pixel_array, array)


def test_a_site_folder_of_compressed_files_gives_the_uncompressed_inputs(
    tmp_path: Path,
) -> None:
    for package, module in CODECS.values():
        pytest.importorskip(module, reason=f"{package} not installed (a declared dependency)")
    pytest.importorskip("pylibjpeg", reason="pylibjpeg not installed")
    spec = ImageSpec(image_size=32, channels=1, classes=("0", "1"))
    folders = {}
    for name, syntaxes in (("plain", [ExplicitVRLittleEndian] * 3), ("pacs", list(CODECS))):
        folder = tmp_path / name
        folder.mkdir()
        with (folder / "labels.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["file", "label"])
            for i, syntax in enumerate(syntaxes):
                write(folder / f"img{i}.dcm", pixels(i + 1), syntax)
                writer.writerow([f"img{i}.dcm", str(i % 2)])
        folders[name] = load_image_folder(folder, spec)
    plain, pacs = folders["plain"], folders["pacs"]
    assert len(plain) == len(pacs) == 3
    for i in range(3):
        expected = plain.image(i)
        assert expected.std() > 0
        assert np.array_equal(pacs.image(i).numpy(), expected.numpy())
