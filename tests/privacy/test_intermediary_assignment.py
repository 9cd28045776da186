"""Patients -> intermediaries under hospital-level DP with v > 1: the group is a keyed
hash of the patient id alone, so adding or removing one patient changes exactly one
unit's membership (the per-patient 2S bound of common.privacy.layered `replaced`), and
ids hash alike whatever their dtype."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.rounds.announcement import RoundPlan
from site_agent.data import SiteData
from site_agent.intermediaries import assign_intermediaries, intermediary_key, intermediary_of
from site_agent.unit_split import record_unit_keys
from tests.privacy.conftest import Pki
from tests.privacy.test_auto_intermediaries import _auto_study, _joined_hospital_site


def _groups(patient_ids: np.ndarray, v: int, *, key: bytes = b"k" * 32) -> list[set[str]]:
    """Each unit's members (patient ids, or record keys without a patient column)."""
    groups = assign_intermediaries(patient_ids, v=v, site_key=key)
    return [{str(patient_ids[r]) for r in index} for index in groups]


def _changed_units(before: Sequence[set[Any]], after: Sequence[set[Any]]) -> list[int]:
    return [k for k, (b, a) in enumerate(zip(before, after, strict=True)) if b != a]


@pytest.mark.parametrize("v", [2, 3, 8])
def test_one_patient_added_or_removed_changes_exactly_one_unit(v: int) -> None:
    cohort = np.array([f"MRN-{i:05d}" for i in range(300)], dtype=object)
    # Several records per patient: the patient is the unit, not the record.
    records = np.repeat(cohort, 3)
    base = _groups(records, v)
    assert set().union(*base) == set(cohort)
    assert sum(len(g) for g in base) == cohort.size  # disjoint, whole patients
    added = _groups(np.append(records, ["MRN-99999"] * 2), v)
    assert len(_changed_units(base, added)) == 1
    (k,) = _changed_units(base, added)
    assert added[k] - base[k] == {"MRN-99999"} and base[k] <= added[k]
    for gone in ("MRN-00000", "MRN-00150", "MRN-00299"):
        removed = _groups(records[records != gone], v)
        (k,) = _changed_units(base, removed)
        assert base[k] - removed[k] == {gone} and removed[k] <= base[k]


def test_records_without_patient_column_are_units_by_content() -> None:
    """Without a patient column a record is the unit, keyed by its content, not its
    position: a record inserted in the middle of the file (every later index shifts)
    still changes exactly one unit."""
    rng = np.random.default_rng(5)
    features = rng.normal(size=(120, 6)).astype(np.float32)
    labels = rng.integers(0, 2, size=120).astype(np.int64)

    def units(f: np.ndarray, y: np.ndarray) -> list[set[bytes]]:
        keys = record_unit_keys(SiteData(features=f, labels=y, patient_ids=None))
        return [{keys[r] for r in index}
                for index in assign_intermediaries(keys, v=4, site_key=b"k" * 32)]

    base = units(features, labels)
    extra = rng.normal(size=(1, 6)).astype(np.float32)
    inserted = units(np.insert(features, 60, extra, axis=0), np.insert(labels, 60, 1))
    (k,) = _changed_units(base, inserted)
    assert len(inserted[k] - base[k]) == 1 and base[k] <= inserted[k]
    removed = units(np.delete(features, 10, axis=0), np.delete(labels, 10))
    (k,) = _changed_units(base, removed)
    assert len(base[k] - removed[k]) == 1 and removed[k] <= base[k]


def test_ids_hash_alike_across_dtypes_and_runs() -> None:
    key = intermediary_key(b"k" * 32)
    assert key == intermediary_key(b"k" * 32) and key != intermediary_key(b"K" * 32)
    for as_int, as_other in ((12345, "12345"), (12345, np.int64(12345)),
                             (12345, np.int32(12345)), (12345, 12345.0),
                             ("MRN-1", np.str_("MRN-1"))):
        assert intermediary_of(as_int, key=key, v=8) == intermediary_of(as_other, key=key, v=8)
    # Pinned: HMAC-SHA256 and BLAKE2b are specified byte for byte, so under one site key
    # the groups are the same on every platform and run (a change here reshuffles every
    # deployed study's intermediaries).
    assert [intermediary_of(f"p{i}", key=key, v=8) for i in range(8)] == PINNED
    ints = _groups(np.arange(50), 4)
    strings = _groups(np.array([str(i) for i in range(50)], dtype=object), 4)
    assert ints == strings


def test_fewer_units_than_v_leaves_groups_empty_instead_of_failing_the_round() -> None:
    """A hospital with fewer patients than the study's fixed v trains the groups it has
    and sends zero updates for the empty ones (the weight stays v). Refusing, as it did,
    failed the round: a dropout that told the coordinator it held fewer than v patients."""
    groups = _groups(np.array(["a", "b", "c"], dtype=object), 4)
    assert len(groups) == 4
    assert sorted(unit for group in groups for unit in group) == ["a", "b", "c"]
    assert any(not group for group in groups)


PINNED = [2, 1, 4, 6, 1, 7, 1, 3]


def test_an_empty_intermediary_trains_nothing_and_sends_a_zero_update(
    tmp_path: Path, pki_material: Pki, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hashed group may be empty: it still counts as one of the v units (the weight
    stays v), with a zero update, and the other units train as usual."""
    hook = _joined_hospital_site(tmp_path, _auto_study(), pki_material, noisy_count=35)
    layout = hook.layout()
    flat = np.zeros(sum(s.elements for s in layout), dtype=np.float32)
    plan = RoundPlan(round_number=1, planned_rounds=3, local_epochs=1, learning_rate=0.1,
                     fedprox_mu=0.0, histogram_bins=5, layout=layout, intermediaries=3)
    real = hook.unit_groups(3)
    emptied = [real[0], np.array([], dtype=np.int64), np.concatenate([real[1], real[2]])]
    monkeypatch.setattr(hook, "unit_groups", lambda v: emptied)
    update = hook.train(plan, flat)
    assert len(update.units) == 3
    assert not np.any(update.units[1]) and np.any(update.units[0]) and np.any(update.units[2])
    assert update.records == sum(len(index) for index in real)
    assert np.allclose(update.delta, np.sum(update.units, axis=0), atol=1e-5)
