"""Attack: hospital-level rounds had no per-round cap. A coordinator (or the study it
wrote) naming noise multiplier z = 0.65 made one round cost 7.82 of a budget of 8. The
site now derives z from its own plan and the study (`own_noise_multiplier`: the study's
epsilon over its rounds, or without a study its budget over its planned rounds) and,
unless `max_epsilon_per_round` says otherwise, refuses a round that adds more epsilon than
a round of that plan would: before anything is written to the ledger."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from common.core.config import SitePolicySection
from common.core.errors import BudgetExhausted
from common.privacy import hospital
from common.privacy.ledger import PrivacyLedger
from common.rounds.announcement import validate_for_site
from common.study import Study, study_from_mapping
from common.study.hospital_terms import study_terms
from coordinator import hospital_sum
from site_agent import hospital as site_hospital
from tests.privacy.conftest import Pki
from tests.privacy.test_intermediaries_guards import _announcement
from tests.study.helpers import study_mapping

NOW = datetime(2026, 11, 26, tzinfo=UTC)
BUDGET, DELTA, CLIP = 8.0, 1e-5, 1.0


def _ledger(tmp_path: Path, pki: Pki) -> PrivacyLedger:
    return PrivacyLedger(tmp_path / "ledger.db", site_id="hospital-a", budget_epsilon=BUDGET,
                         delta=DELTA, privacy_unit="hospital", signer=pki.signer_a)


def _study(**privacy: Any) -> Study:
    mapping = study_mapping(unit="hospital", update_clip_norm=CLIP, epsilon=BUDGET,
                            delta=DELTA, **privacy)
    mapping["study"]["rounds"] = 5
    return study_from_mapping(mapping, source="test")


def _planned(z: float, *, study: Study | None, policy: SitePolicySection,
             ) -> site_hospital.HospitalRound:
    ann = hospital_sum.announce(_announcement(200), hospital.HospitalTerms(CLIP, z))
    rnd = validate_for_site(ann, policy=policy, site_id="alpha", study=study)
    return site_hospital.plan_round(rnd, study=study, policy=policy)


def test_a_coordinator_announcing_z_065_is_refused_and_the_ledger_records_nothing(
    tmp_path: Path, pki_material: Pki,
) -> None:
    policy = SitePolicySection(planned_rounds=5)
    ledger = _ledger(tmp_path, pki_material)
    attack = _planned(0.65, study=None, policy=policy)
    one_round = ledger.preview(1, [attack.mechanism])
    assert one_round > 0.5 * BUDGET  # what the round would have cost: most of the budget
    with pytest.raises(BudgetExhausted, match="per-round cap"):
        site_hospital.check_round_cap(ledger, attack, number=1, study=None, policy=policy)
    assert ledger.entries() == []
    # The site's own plan (its budget over its planned rounds) passes, and every round
    # the ledger then records is within the cap.
    own_z = site_hospital.own_noise_multiplier(
        None, policy=policy, announced_rounds=5, budget_epsilon=BUDGET, delta=DELTA)
    honest = _planned(own_z, study=None, policy=policy)
    for number in (1, 2, 3):
        cost = site_hospital.check_round_cap(ledger, honest, number=number, study=None,
                                             policy=policy)
        before = ledger.spent()
        ledger.reserve(number, [honest.mechanism], now=NOW)
        assert ledger.spent() - before == pytest.approx(cost, rel=1e-6)
        assert cost <= one_round
    with pytest.raises(BudgetExhausted):
        site_hospital.check_round_cap(ledger, attack, number=4, study=None, policy=policy)
    assert len(ledger.entries()) == 3


def test_a_study_naming_z_065_cannot_spend_the_budget_in_one_round(
    tmp_path: Path, pki_material: Pki,
) -> None:
    policy = SitePolicySection()
    ledger = _ledger(tmp_path, pki_material)
    low = _study(update_noise_multiplier=0.65)
    with pytest.raises(BudgetExhausted, match="own plan"):
        site_hospital.check_round_cap(ledger, _planned(0.65, study=low, policy=policy),
                                      number=1, study=low, policy=policy)
    # The study's own planned z (update_noise_multiplier unset) is within the cap.
    planned = _study()
    z = study_terms(planned).noise_multiplier
    assert z > 0.65
    site_hospital.check_round_cap(ledger, _planned(z, study=planned, policy=policy),
                                  number=1, study=planned, policy=policy)
    assert ledger.entries() == []


def test_an_explicit_max_epsilon_per_round_is_the_cap(tmp_path: Path, pki_material: Pki) -> None:
    ledger = _ledger(tmp_path, pki_material)
    study = _study()
    z = study_terms(study).noise_multiplier
    strict = SitePolicySection(max_epsilon_per_round=0.5)
    with pytest.raises(BudgetExhausted, match="max_epsilon_per_round"):
        site_hospital.check_round_cap(ledger, _planned(z, study=study, policy=strict),
                                      number=1, study=study, policy=strict)
