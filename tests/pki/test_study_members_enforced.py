"""A study's [[members]] enforced: a site refuses a round naming anyone else (at the
announcement) or a member under another key (at the roster), a study without members
unless the site pins its own members or opts in to open membership (the default
refuses it), and the coordinator refuses to enrol them."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from bench.transport_site import DeterministicTestHook
from common.core.config import SitePolicySection, SiteSettings
from common.core.errors import AbortReason, CertificateRejected, ConfigError, ProtocolAbort
from common.protocol import pki
from common.rounds.announcement import validate_for_site
from common.study import Study, study_from_mapping, study_sha256
from coordinator.servicer import refuse_non_member
from coordinator.study_run import StudyRun
from site_agent.agent import SiteAgent
from site_agent.membership import check_members_listed
from site_agent.metrics import SiteMetrics
from tests.pki.test_site_revocation_and_members import crl_der
from tests.study.helpers import study_mapping
from tests.study.test_study_members import A, B, with_members
from tests.unit.test_round import ANN


def members_study(pki_dir: Path, names: tuple[str, ...]) -> Study:
    return study_from_mapping(with_members(*(
        {"name": n, "fingerprint": pki.public_key_fingerprint(
            pki.load_certificate(pki.site_paths(pki_dir, n)[0]))} for n in names)))


def test_announcement_naming_a_non_member_is_refused_before_any_key() -> None:
    study = study_from_mapping(with_members(
        {"name": "alpha", "fingerprint": A}, {"name": "beta", "fingerprint": B},
        {"name": "delta", "fingerprint": "c" * 64}))
    policy = SitePolicySection(max_colluding_sites=0)
    with pytest.raises(ProtocolAbort) as caught:
        validate_for_site(ANN, policy=policy, site_id="beta", study=study)
    assert caught.value.reason is AbortReason.UNKNOWN_MEMBER
    assert "['gamma']" in str(caught.value)
    members_only = dataclasses.replace(ANN, participants=("alpha", "beta", "delta"),
                                       threshold=3)
    validate_for_site(members_only, policy=policy, site_id="beta", study=study)


def agent_in(pki_dir: Path, site: str, tmp_path: Path) -> SiteAgent:
    settings = SiteSettings(
        pki=pki_dir, site=site, coordinator="127.0.0.1:1", state=tmp_path / "state")
    return SiteAgent(settings, DeterministicTestHook(site), metrics=SiteMetrics(site),
                     ledger=None)


def test_roster_member_under_another_key_or_a_non_member_aborts(
    pki_dir: Path, tmp_path: Path, now: dt.datetime
) -> None:
    """A CA holder mints a certificate under a member's name (its own key) and one under
    a new name: both valid certificates of the federation CA, neither accepted."""
    pki.issue_site(pki_dir, "h3", now=now)
    study = members_study(pki_dir, ("h1", "h2", "h3"))
    pki.issue_site(pki_dir, "sybil", now=now)
    pki.issue_site(pki_dir, "h3", now=now, force=True)  # h3's name, the CA holder's key
    agent = agent_in(pki_dir, "h1", tmp_path)
    agent.revocation.offer(crl_der(pki_dir), now=now)
    agent.membership.study = study
    identity = agent.membership.identity

    def der(site: str) -> bytes:
        return pki.load_certificate(pki.site_paths(pki_dir, site)[0]).public_bytes(Encoding.DER)

    identity("h2", der("h2"))
    for site, says in (("h3", "holds key"), ("sybil", "is not a member")):
        with pytest.raises(ProtocolAbort) as caught:
            identity(site, der(site))
        assert caught.value.reason is AbortReason.UNKNOWN_MEMBER
        assert says in str(caught.value)


def test_a_study_without_members_is_refused_by_default_unless_pinned_or_opted_in(
    pki_dir: Path, tmp_path: Path
) -> None:
    """Default settings (flags only, no configuration file) refuse a member-less study at
    enrolment, naming the study, the setting and the ways out; a study listing members is
    joined; a site pinning its own policy.members, or opting in, joins a member-less one."""
    settings = SiteSettings(
        pki=pki_dir, site="h1", coordinator="127.0.0.1:1", state=tmp_path / "state")
    assert settings.policy.allow_open_membership is False
    open_study = study_from_mapping(study_mapping())
    with pytest.raises(ConfigError) as caught:
        check_members_listed(open_study, settings)
    assert caught.value.field == "policy.allow_open_membership"
    for part in ("study 'sepsis-pilot'", f"sha256 {study_sha256(open_study)[:12]}",
                 "lists no [[members]]", "medfed study init --member-from",
                 "medfed pki members", "policy.allow_open_membership = true"):
        assert part in str(caught.value)
    check_members_listed(members_study(pki_dir, ("h1", "h2")), settings)
    pinned = SitePolicySection(members=pki.site_members(pki_dir))
    check_members_listed(open_study, settings.model_copy(update={"policy": pinned}))
    opted_in = SitePolicySection(allow_open_membership=True)
    check_members_listed(open_study, settings.model_copy(update={"policy": opted_in}))


def test_coordinator_refuses_to_enrol_a_non_member(
    pki_dir: Path, tmp_path: Path, now: dt.datetime
) -> None:
    run_ = StudyRun(study=members_study(pki_dir, ("h1",)), state=tmp_path / "coordinator")
    refuse_non_member(run_, "h1", pki.load_certificate(pki.site_paths(pki_dir, "h1")[0]))
    with pytest.raises(CertificateRejected, match="'h2' is not a member"):
        refuse_non_member(run_, "h2", pki.load_certificate(pki.site_paths(pki_dir, "h2")[0]))
    pki.issue_site(pki_dir, "h1", now=now, force=True)
    with pytest.raises(CertificateRejected, match="presents key"):
        refuse_non_member(run_, "h1", pki.load_certificate(pki.site_paths(pki_dir, "h1")[0]))
    plain = StudyRun(study=study_from_mapping(study_mapping()), state=tmp_path / "other")
    refuse_non_member(plain, "h2", pki.load_certificate(pki.site_paths(pki_dir, "h2")[0]))
