"""Attack (s5 review): the per-patient figure of hospital mode with v > 1 intermediaries
composes each DDGauss round at 2S ("a patient changed inside an intermediary that stays
in the round moves it by up to 2S", common/privacy/hospital.py `Guarantees`,
common/privacy/layered.py `replaced`). That needs the patient -> intermediary assignment
of every OTHER patient to be unchanged when one patient is added or removed.

`DpTrainingHook.unit_groups` dealt patients with `permutation(unique.size)` seeded by the
split seed: adding one patient changed `unique.size`, hence the whole permutation, hence
the group of almost every other patient. Every one of the v unit updates could then
change, and the hospital's sum move by up to 2 v S, not 2 S. The assignment is now a keyed
hash of each id alone (`site_agent.intermediaries.assign_intermediaries`, which `unit_groups` calls
with the site's patient ids and split key); these tests failed before that change."""

from __future__ import annotations

import numpy as np

from site_agent.intermediaries import assign_intermediaries


def groups_by_patient(patient_ids: np.ndarray, v: int) -> dict[str, int]:
    groups = assign_intermediaries(patient_ids, v=v, site_key=b"k" * 32)
    out: dict[str, int] = {}
    for k, index in enumerate(groups):
        for record in index:
            out[str(patient_ids[record])] = k
    return out


def test_adding_one_patient_leaves_every_other_patients_intermediary_unchanged() -> None:
    v = 8
    cohort = np.array([f"p{i:04d}" for i in range(400)])
    before = groups_by_patient(cohort, v)
    after = groups_by_patient(np.append(cohort, "p9999"), v)  # one patient added
    moved = [p for p in before if before[p] != after[p]]
    units_touched = {before[p] for p in moved} | {after[p] for p in moved}
    # The 2S per-patient bound needs moved == [] (only the new patient's unit changes).
    assert not moved, (
        f"{len(moved)} of {len(before)} existing patients changed intermediary when one "
        f"patient was added; {len(units_touched)} of {v} unit updates change, so the sum "
        f"moves by up to {2 * len(units_touched)} S, not 2 S"
    )


def test_removing_one_patient_leaves_every_other_patients_intermediary_unchanged() -> None:
    v = 4
    cohort = np.array([f"p{i:04d}" for i in range(200)])
    before = groups_by_patient(cohort, v)
    after = groups_by_patient(cohort[1:], v)  # p0000 removed
    moved = [p for p in after if before[p] != after[p]]
    assert not moved, f"{len(moved)} of {len(after)} remaining patients changed intermediary"
