"""Attack (session-5 review): with DP-SGD beneath hospital-level DP (privacy.record_level),
the site's budget was charged with the record-level epsilon only (the better of the
DP-SGD path and the 2S path). The DDGauss model-update rounds, the study's HOSPITAL-level
guarantee, then cost the budget nothing once the DP-SGD path was the cheaper one.

A coordinator that runs many more HOSPITAL rounds than the study (each with the study's
S and z; each round's DP-SGD as cheap as a long plan makes it) must not get them for free.
The ledger must refuse the round that would take the hospital-level (unit-level) epsilon
past the budget: `layered.charged` is the larger of the record-level and unit-level
figures."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from common.core.errors import BudgetExhausted
from common.privacy import hospital, layered
from common.privacy.accountant import compose_epsilon, plan_round_noise
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Mechanism
from common.study import Study, study_from_mapping
from common.study.hospital_terms import study_terms
from tests.privacy.conftest import Pki
from tests.study.helpers import study_mapping

NOW = datetime(2026, 11, 23, tzinfo=UTC)
DELTA = 1e-5
BUDGET = 8.0


def layered_study() -> Study:
    options: dict[str, Any] = {
        "unit": "hospital", "update_clip_norm": 1.0, "intermediaries": 1,
        "record_level": "record", "record_epsilon": 3.0, "epsilon": BUDGET, "delta": DELTA,
    }
    mapping = study_mapping(**options)
    mapping["study"]["rounds"] = 5  # z is planned for 5 hospital rounds
    return study_from_mapping(mapping, source="test")


def test_hospital_rounds_beyond_the_study_are_refused_by_the_budget(
    tmp_path: Path, pki_material: Pki
) -> None:
    study = layered_study()
    terms = study_terms(study)
    ring = hospital.ring_plan(terms, dim=1000, max_sites=3)
    ddgauss = hospital.mechanism(hospital.site_plan(ring, n_noise=2))
    # What the site's own planner answers when the coordinator announces planned_rounds
    # = 5000 (allowed up to 1e6; the site plans max(policy, announced) rounds).
    sigma = plan_round_noise(history=[], budget_epsilon=3.0, delta=DELTA, sample_rate=0.05,
                             steps_per_round=20, remaining_rounds=5000).noise_multiplier
    from common.privacy.mechanisms import Segment

    sgd = Segment(sigma, 0.05, 20)
    ledger = PrivacyLedger(tmp_path / "ledger.db", site_id="hospital-a", budget_epsilon=BUDGET,
                           delta=DELTA, privacy_unit="hospital", signer=pki_material.signer_a)
    rounds = 4 * study.study.rounds  # four times the study's rounds
    accepted = 0
    for number in range(1, rounds + 1):
        mechanisms: list[Mechanism] = [sgd, ddgauss]
        if ledger.preview(number, mechanisms) > BUDGET:
            # What the ledger itself does with that round: refuse, nothing written.
            with pytest.raises(BudgetExhausted):
                ledger.reserve(number, mechanisms, now=NOW)
            break
        ledger.reserve(number, mechanisms, now=NOW)
        accepted += 1
    pairs = [(e.purpose, e.mechanisms) for e in ledger.entries()]
    assert len(pairs) == accepted < rounds, "every hospital round was accepted"
    figures = hospital.guarantees(pairs, delta=DELTA, accountant=ledger.accountant)
    charge = layered.charged(pairs, delta=DELTA, accountant=ledger.accountant).epsilon
    # The property a hospital-level study promises: its model updates, per hospital,
    # within the site's budget; the record-level figure within it too.
    assert figures.hospital <= charge <= BUDGET
    assert figures.per_patient <= charge
    # The charge is the unit-level figure here (DP-SGD is the cheap path), not DP-SGD
    # and DDGauss added up.
    unit = compose_epsilon(layered.unit_level(pairs), delta=DELTA,
                           accountant=ledger.accountant)
    assert charge == pytest.approx(unit)
    assert charge < compose_epsilon([m for _, ms in pairs for m in ms], delta=DELTA,
                                    accountant=ledger.accountant)
