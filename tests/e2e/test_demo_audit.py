"""The demo's membership-inference audit line, in process (no federation): skipped on
request or when the site is too small, sampled to a fixed number of privacy units."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from demo.audit import audit_line, demo_audit, privacy_audit, sample_units
from demo.options import DemoOptions
from demo.run import Demo
from site_agent.synthetic import generate_cohort


def test_no_audit_flag_is_stated_in_the_report(tmp_path: Path) -> None:
    demo = Demo(DemoOptions(out=tmp_path, audit=False, quiet=True))
    assert privacy_audit(demo, {}) == {"skipped": True, "reason": "--no-audit"}


def test_sample_keeps_whole_patients_and_small_sites_are_skipped() -> None:
    data = generate_cohort(["rural"], seed=4, patients_per_site=120)["rural"]
    sample = sample_units(data, units=40, seed=1)
    assert sample.num_patients == 40
    assert data.patient_ids is not None and sample.patient_ids is not None
    kept = set(sample.patient_ids)
    assert len(sample) == int(np.isin(data.patient_ids, list(kept)).sum())
    # 40 patients are too few for DP training: the demo reports why and goes on.
    result = demo_audit({"rural": sample}, epsilon=8.0, delta=1e-5, seed=1)
    assert result["skipped"] is True and "rural" in result["reason"]
    assert audit_line(0.706, 0.543, 8.0) == "membership inference AUC: no DP 0.71, DP eps=8 0.54"
