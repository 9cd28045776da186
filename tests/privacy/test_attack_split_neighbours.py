"""Attack: DP-SGD's and the evaluation histogram's (epsilon, delta) are stated for one
patient added to or removed from the hospital's data. The held-out split used to permute
the sorted ids with a public seed, so adding one patient renumbered the ids after it and
moved tens of *other* patients between training and held-out (44-112 of 1,000): the
guarantee then held for neighbouring splits only. The split is now a keyed hash of each
unit's own id under a key secret to the site (`site_agent.unit_split`); these tests
failed against the permutation."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from common.core.errors import StateError
from site_agent.data import SiteData
from site_agent.imaging import ImageSpec, load_image_folder
from site_agent.synthetic_imaging import write_site_folder
from site_agent.unit_split import SITE_KEY_FILE, site_split_key, split_by_patient

FRACTION = 0.2


def _table(patients: list[str], *, records_per_patient: int = 2) -> SiteData:
    ids = np.repeat(np.array(patients, dtype=object), records_per_patient)
    rng = np.random.default_rng(0)
    return SiteData(features=rng.normal(size=(len(ids), 3)).astype(np.float32),
                    labels=rng.integers(0, 2, size=len(ids)), patient_ids=ids)


def _sides(data: object, key: bytes) -> dict[str, str]:
    train, held = split_by_patient(data, held_out_fraction=FRACTION, key=key)
    sides = {str(p): "train" for p in train.patient_ids}
    sides.update({str(p): "held-out" for p in held.patient_ids})
    return sides


def _moved(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [p for p in before.keys() & after.keys() if before[p] != after[p]]


def test_adding_one_patient_moves_no_other_patient_between_splits(tmp_path: Path) -> None:
    key = site_split_key(tmp_path / "state")
    cohort = [f"MRN-{i:05d}" for i in range(1000)]
    before = _sides(_table(cohort), key)
    for new in ("MRN-00000a", "MRN-50000", "0"):  # before, after and among the sorted ids
        after = _sides(_table([*cohort, new]), key)
        assert not _moved(before, after), f"adding {new} moved {len(_moved(before, after))}"
        assert set(after) - set(before) == {new}


def test_removing_one_patient_moves_no_other_patient_between_splits(tmp_path: Path) -> None:
    key = site_split_key(tmp_path / "state")
    cohort = [f"MRN-{i:05d}" for i in range(1000)]
    before = _sides(_table(cohort), key)
    for gone in ("MRN-00000", "MRN-00500", "MRN-00999"):
        after = _sides(_table([p for p in cohort if p != gone]), key)
        assert not _moved(before, after), f"removing {gone} moved {len(_moved(before, after))}"


def test_records_without_patient_column_stay_on_their_side_when_one_is_inserted() -> None:
    """Without patient ids each record is its unit, keyed by its content, not its row
    number (which shifts for every later record)."""
    rng = np.random.default_rng(3)
    features = rng.normal(size=(400, 4)).astype(np.float32)
    labels = rng.integers(0, 2, size=400)

    def held_rows(f: np.ndarray, y: np.ndarray) -> set[bytes]:
        _, held = split_by_patient(SiteData(features=f, labels=y, patient_ids=None),
                                   held_out_fraction=FRACTION, key=b"k" * 32)
        return {row.tobytes() for row in held.features}

    base = held_rows(features, labels)
    extra = rng.normal(size=(1, 4)).astype(np.float32)
    inserted = held_rows(np.insert(features, 7, extra, axis=0), np.insert(labels, 7, 1))
    assert inserted - {extra[0].tobytes()} == base


def test_adding_one_patients_images_moves_no_other_patient_in_an_image_folder(
    tmp_path: Path,
) -> None:
    folder = write_site_folder(tmp_path / "cohort", "st_marys", seed=1, patients=60)
    spec = ImageSpec(image_size=16, patient_column="patient_id")
    key = site_split_key(tmp_path / "state")
    before = _sides(load_image_folder(folder, spec), key)
    # One more patient: their images added to the folder's labels.csv.
    labels = folder / "labels.csv"
    lines = labels.read_text(encoding="utf-8").splitlines()
    header = lines[0].split(",")
    patient_at = header.index("patient_id")
    first = lines[1].split(",")
    (folder / "zz-new.png").write_bytes((folder / first[0]).read_bytes())
    added = [",".join("zz-new.png" if i == 0 else "zz-new" if i == patient_at else v
                      for i, v in enumerate(first))]
    labels.write_text("\n".join([lines[0], *added, *lines[1:]]) + "\n", encoding="utf-8")
    after = _sides(load_image_folder(folder, spec), key)
    assert set(after) - set(before) == {"zz-new"}
    assert not _moved(before, after)
    # And one patient removed.
    gone = str(first[patient_at])
    kept = [line for line in lines[1:] if line.split(",")[patient_at] != gone]
    for line in [*added, *lines[1:]]:
        if line not in kept:
            (folder / line.split(",")[0]).unlink()
    labels.write_text("\n".join([lines[0], *kept]) + "\n", encoding="utf-8")
    removed = _sides(load_image_folder(folder, spec), key)
    assert gone not in removed and not _moved(before, removed)


def test_the_held_out_fraction_is_the_configured_one_within_sampling_noise() -> None:
    cohort = [f"p{i}" for i in range(20_000)]
    _, held = split_by_patient(_table(cohort, records_per_patient=1),
                               held_out_fraction=FRACTION, key=os.urandom(32))
    sd = (len(cohort) * FRACTION * (1 - FRACTION)) ** 0.5  # Binomial(N, f)
    assert abs(len(held) - FRACTION * len(cohort)) < 5 * sd


def test_the_split_key_is_secret_to_the_site(tmp_path: Path) -> None:
    """Another site (or anyone without the key) gets a different split of the same ids,
    the key is made 0600 in the state folder and read back unchanged, and a key file
    others may read stops the site."""
    first = site_split_key(tmp_path / "a")
    path = tmp_path / "a" / SITE_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) == 32 and site_split_key(tmp_path / "a") == first
    other = site_split_key(tmp_path / "b")
    assert other != first
    cohort = [f"MRN-{i:05d}" for i in range(1000)]
    held_a = {p for p, s in _sides(_table(cohort), first).items() if s == "held-out"}
    held_b = {p for p, s in _sides(_table(cohort), other).items() if s == "held-out"}
    # Independent keys: the overlap is about f^2 N = 40, not f N = 200.
    assert len(held_a & held_b) < 0.5 * len(held_a)
    path.chmod(0o644)
    with pytest.raises(StateError, match="chmod 600"):
        site_split_key(tmp_path / "a")
    path.chmod(0o600)
    path.write_bytes(first[:20])
    with pytest.raises(StateError, match="damaged"):
        site_split_key(tmp_path / "a")


def test_the_split_key_is_in_nothing_a_site_sends() -> None:
    """Only the split and the intermediaries read the key: no module that builds a
    message, a ledger entry or a release imports it."""
    root = Path(__file__).resolve().parents[2]
    readers = sorted(
        str(p.relative_to(root)) for folder in ("common", "site_agent", "coordinator")
        for p in (root / folder).rglob("*.py")
        if "site_split_key(" in p.read_text(encoding="utf-8")
    )
    assert readers == ["site_agent/distributed_train.py", "site_agent/site_dataset.py",
                       "site_agent/site_training.py", "site_agent/unit_split.py"]


def test_a_study_table_without_patient_column_splits_by_its_values_as_read(
    tmp_path: Path,
) -> None:
    """Under a study without a patient column each record is its unit, keyed by its
    values as read: the split does not move when the federation's statistics (which
    encode the records) change, and the demo's baselines can compute it."""
    from common.core.config import SiteSettings
    from common.study import study_from_mapping
    from site_agent.data import load_study_table
    from site_agent.site_dataset import encode_study_table
    from tests.study.helpers import noiseless_statistics, study_mapping, write_hospital_csv

    mapping = study_mapping(unit="record")
    mapping["data"]["patient_column"] = None
    study = study_from_mapping(mapping, source="test")
    table = load_study_table(write_hospital_csv(tmp_path / "site.csv", 300), study)
    settings = SiteSettings(
        site="north", coordinator="127.0.0.1:1", state=tmp_path / "state",
        tls_ca=tmp_path / "ca.crt", tls_cert=tmp_path / "s.crt", tls_key=tmp_path / "s.key",
        data={"path": tmp_path / "site.csv"},  # type: ignore[arg-type]
    )
    exact = noiseless_statistics(study, table)
    shifted = exact.model_copy(update={"numeric": {
        name: stats.model_copy(update={"mean": stats.mean + 3.0})
        for name, stats in exact.numeric.items()}})
    _, held_a, _, _ = encode_study_table(table, study, exact, settings, dp=False)
    _, held_b, _, _ = encode_study_table(table, study, shifted, settings, dp=False)
    assert 0 < len(held_a) < len(table)
    np.testing.assert_array_equal(held_a.labels, held_b.labels)
    assert not np.allclose(held_a.features, held_b.features)  # encoded differently
