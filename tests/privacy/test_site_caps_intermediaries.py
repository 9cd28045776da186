"""A hospital's own cap on intermediaries (`policy.max_intermediaries`, session-5 review):
with v intermediaries the hospital-level epsilon is v-fold group privacy and the budget is
charged per intermediary, so the site's privacy officer decides how far a study, or a
coordinator choosing v under "auto", may split the hospital. Checked at enrolment (the
study refused, naming the field) and on every round (a deviating coordinator's larger v
refused before anything is computed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.core.config import DEFAULT_MAX_INTERMEDIARIES, SitePolicySection, SiteSettings
from common.core.errors import PrivacyError, RoundFailed
from common.privacy import hospital
from common.rounds.announcement import validate_for_site
from common.study import SitePrivacyPolicy, check_study_against_policy, study_from_mapping
from common.study.hospital_terms import study_terms
from coordinator import hospital_sum
from site_agent.datacheck import site_policy
from tests.privacy.test_auto_intermediaries import _announcement, _auto_study
from tests.study.helpers import study_mapping


def _policy(cap: int | None) -> SitePrivacyPolicy:
    return SitePrivacyPolicy(epsilon=8.0, delta=1e-3, unit="record", max_intermediaries=cap)


def test_the_default_cap_is_the_cap_of_auto() -> None:
    assert DEFAULT_MAX_INTERMEDIARIES == hospital.MAX_AUTO_INTERMEDIARIES
    assert SitePolicySection().max_intermediaries == hospital.MAX_AUTO_INTERMEDIARIES


def test_a_study_splitting_the_hospital_beyond_the_cap_is_refused_at_enrolment() -> None:
    auto = _auto_study()
    fixed = study_from_mapping(
        study_mapping(unit="hospital", update_clip_norm=0.5, intermediaries=3), source="test")
    whole = study_from_mapping(study_mapping(unit="hospital", update_clip_norm=0.5),
                               source="test")
    patient = study_from_mapping(study_mapping(unit="patient"), source="test")
    with pytest.raises(PrivacyError, match=r"policy\.max_intermediaries = 4") as refused:
        check_study_against_policy(auto, _policy(4))
    assert "privacy.intermediaries = 'auto'" in str(refused.value)
    assert "up to 8 intermediaries" in str(refused.value)
    check_study_against_policy(auto, _policy(8))
    with pytest.raises(PrivacyError, match=r"up to 3 intermediaries.*max_intermediaries = 2"):
        check_study_against_policy(fixed, _policy(2))
    check_study_against_policy(fixed, _policy(3))
    # One unit per hospital, or a study that is not hospital-level, passes any cap.
    check_study_against_policy(whole, _policy(1))
    check_study_against_policy(patient, _policy(1))


def test_site_policy_carries_the_configured_cap(tmp_path: Path) -> None:
    settings = SiteSettings(
        site="north", coordinator="127.0.0.1:1", state=tmp_path / "state",
        tls_ca=tmp_path / "ca.crt", tls_cert=tmp_path / "s.crt", tls_key=tmp_path / "s.key",
        policy={"max_intermediaries": 1},  # type: ignore[arg-type]
    )
    policy = site_policy(settings)
    assert policy.max_intermediaries == 1
    with pytest.raises(PrivacyError, match=r"policy\.max_intermediaries = 1"):
        check_study_against_policy(_auto_study(), policy)


def test_a_round_announcing_more_intermediaries_than_the_cap_is_refused() -> None:
    auto = _auto_study()
    dim = 64
    terms = study_terms(auto)
    within = hospital_sum.announce(_announcement(dim), terms.for_round(4))
    beyond = hospital_sum.announce(_announcement(dim), terms.for_round(5))
    assert (within.hospital_intermediaries, beyond.hospital_intermediaries) == (4, 5)
    capped = SitePolicySection(max_intermediaries=4)
    validate_for_site(within, policy=capped, site_id="alpha", study=auto)
    with pytest.raises(RoundFailed, match=r"5 intermediaries.*policy\.max_intermediaries = 4"):
        validate_for_site(beyond, policy=capped, site_id="alpha", study=auto)
    # Without the study at hand (the check every round makes first) the cap still holds.
    with pytest.raises(RoundFailed, match="max_intermediaries"):
        validate_for_site(beyond, policy=capped, site_id="alpha")
    validate_for_site(beyond, policy=SitePolicySection(), site_id="alpha", study=auto)
