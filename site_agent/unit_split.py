"""Per-unit assignments that hold for the hospital's neighbouring data sets: the held-out
split (`split_by_patient`, tables and image folders alike) and the intermediaries
(`site_agent.intermediaries`) put each privacy unit (a patient; without a patient column a
record) on a side chosen by a keyed hash of that unit's own id alone.

Why a keyed hash and not a seeded permutation of the sorted ids: DP-SGD's and the
evaluation histogram's (epsilon, delta) are stated for a patient added to or removed from
the hospital's data. A permutation renumbers every id after the new one, so one added
patient moved tens of *other* patients between training and held-out (the guarantee then
held for neighbouring splits only). Here a unit's side is a function of its id and the
site's key, so adding or removing one unit moves no other.

The key (`site_split_key`) is 32 bytes from the operating system's CSPRNG, created in the
site's state folder on first use (mode 0600) and never sent: without it no one can tell
which side a known patient id is on. HMAC-SHA256 is a PRF under that key (Bellare,
Canetti and Krawczyk, CRYPTO 1996), so each unit is held out independently with
probability `held_out_fraction`: the held-out share is Binomial(N, f) / N, within
sampling noise of the configured fraction.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import stat
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from common.core.errors import ConfigError, DataError, StateError
from common.core.fileio import fsync_directory
from common.crypto.random import RandomSource, system_random

SITE_KEY_FILE = "site-split.key"
"""The site's split key, in its state folder (``--state``)."""
KEY_BYTES = 32
HELD_OUT_DOMAIN = b"medfed/v1/held-out"


D = TypeVar("D")


def site_split_key(state: str | os.PathLike[str], *, rng: RandomSource = system_random) -> bytes:
    """This site's split key from ``STATE/site-split.key``, made on first use (32 bytes of
    `rng`, written 0600 and linked into place so two processes starting at once agree on
    one key). StateError when the file is damaged or others may read it."""
    folder = Path(state)
    path = folder / SITE_KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".{SITE_KEY_FILE}.{rng(6).hex()}.tmp"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(rng(KEY_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first
            os.link(temporary, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
    fsync_directory(folder)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    with open(path, "rb") as handle:
        mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
        if mode & 0o077:
            raise StateError(
                f"split key {path} may be read by others (mode {mode:04o}): whoever reads it "
                f"knows which patients are held out; run `chmod 600 {path}`"
            )
        key = handle.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise StateError(
            f"split key {path} is damaged ({len(key)} bytes, expected {KEY_BYTES}); restore "
            "it from the state folder's backup (a new key would move patients between "
            "training and held-out)"
        )
    return key


def canonical_unit_id(unit: object) -> bytes:
    """Bytes of a patient id (or record key) that do not depend on its dtype: integers
    (Python, NumPy, integral floats) as their decimal digits, text as UTF-8, so the same
    id hashes alike whether a file's column was read as numbers or as strings."""
    if isinstance(unit, bytes | bytearray):
        return bytes(unit)
    if isinstance(unit, np.generic):
        unit = unit.item()
    if isinstance(unit, bool):
        unit = int(unit)
    if isinstance(unit, float) and unit.is_integer():
        unit = int(unit)
    return str(unit).encode("utf-8")


def record_unit_keys(data: Any) -> np.ndarray:
    """Unit ids of a dataset without a patient column, one per record, that depend on the
    record alone (never on its position, which shifts for every later record when one is
    added or removed): a digest of a tabular record's encoded features and label, or an
    image's file path. Identical records share a key (and so a unit), which keeps the
    property that one record added or removed moves only its own unit."""
    entries = getattr(data, "entries", None)
    if entries is not None:  # images: the file, not its place in the listing
        return np.array([str(entry.path) for entry in entries], dtype=object)
    features = np.ascontiguousarray(data.features)
    labels = np.ascontiguousarray(data.labels)
    keys = np.empty(len(features), dtype=object)
    for i in range(len(features)):
        digest = hashlib.blake2b(features[i].tobytes(), digest_size=16)
        digest.update(labels[i].tobytes())
        keys[i] = digest.digest()
    return keys


def unit_ids(data: Any) -> np.ndarray:
    """One unit id per record: the patient id, or without a patient column the record's
    own key (`record_unit_keys`)."""
    ids = getattr(data, "patient_ids", None)
    return np.asarray(ids, dtype=object) if ids is not None else record_unit_keys(data)


def unit_uniform(unit: object, *, key: bytes, domain: bytes) -> float:
    """A number in [0, 1) fixed by `unit`'s id, `key` and `domain` alone: the first 64 bits
    of HMAC-SHA256(key, domain || 0x00 || id) over 2^64."""
    digest = hmac.new(key, domain + b"\x00" + canonical_unit_id(unit), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def held_out_mask(ids: np.ndarray, *, key: bytes, held_out_fraction: float) -> np.ndarray:
    """Per record: whether its unit is held out (`unit_uniform` < `held_out_fraction`)."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ConfigError("data.holdout_fraction", "must be in (0, 1)")
    if len(key) < 16:
        raise ConfigError("split key", f"{len(key)} bytes; at least 16 are needed")
    unique, inverse = np.unique(np.asarray(ids), return_inverse=True)
    held = np.fromiter(
        (unit_uniform(u, key=key, domain=HELD_OUT_DOMAIN) < held_out_fraction for u in unique),
        dtype=bool, count=unique.size,
    )
    return held[inverse.reshape(-1)]


def training_unit_count(
    ids: np.ndarray, *, key: bytes, held_out_fraction: float, unit: str
) -> int:
    """The units DP-SGD will train on once `split_by_patient` holds some out (`ids`: one
    unit id per record, as the split reads them): distinct patients on the training side,
    or its records when the privacy unit is a record (what the trainer counts)."""
    ids = np.asarray(ids, dtype=object)
    kept = ~held_out_mask(ids, key=key, held_out_fraction=held_out_fraction)
    if unit == "patient":
        return len(set(ids[kept].tolist()))
    return int(kept.sum())


def study_record_keys(table: Any) -> np.ndarray:
    """Unit ids of a study table without a patient column (`site_agent.data.StudyTable`):
    a digest of each record's values as read (numeric columns, level indices, label),
    before any encoding, so a record keeps its side whatever statistics encode it."""
    digests = [hashlib.blake2b(digest_size=16) for _ in range(len(table))]
    columns = [*(table.numeric[c] for c in sorted(table.numeric)),
               *(table.categorical[c] for c in sorted(table.categorical))]
    if table.labels is not None:
        columns.append(table.labels)
    for column in columns:
        values = np.ascontiguousarray(column)
        for i, digest in enumerate(digests):
            digest.update(values[i].tobytes())
    keys = np.empty(len(digests), dtype=object)
    for i, digest in enumerate(digests):
        keys[i] = digest.digest()
    return keys


def split_by_patient(
    data: D, *, held_out_fraction: float, key: bytes, units: np.ndarray | None = None
) -> tuple[D, D]:
    """(training, held-out) of a table (`SiteData`) or an image folder (`ImageDataset`):
    no patient on both sides, each unit's side fixed by its own id and the site's key
    (module docstring). `units`: one unit id per record, when not the data's own
    (`unit_ids`; a study table's raw records: `study_record_keys`). DataError when one
    side comes out empty."""
    ids = unit_ids(data) if units is None else np.asarray(units, dtype=object)
    if len(ids) != len(data):  # type: ignore[arg-type]
        raise DataError(f"{len(ids)} unit ids for {len(data)} records")  # type: ignore[arg-type]
    mask = held_out_mask(ids, key=key, held_out_fraction=held_out_fraction)
    held, total = int(mask.sum()), int(mask.size)
    if held == 0 or held == total:
        raise DataError(
            f"the held-out split of {total} records is {'empty' if held == 0 else 'everything'}"
            f" at data.holdout_fraction {held_out_fraction:g}: too few patients to split",
            file=getattr(data, "source", None) or None,
        )
    subset = data.subset  # type: ignore[attr-defined]
    return subset(np.flatnonzero(~mask)), subset(np.flatnonzero(mask))
