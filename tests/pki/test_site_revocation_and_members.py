"""What a site checks about its roster peers itself: the CA's
CRL relayed by the coordinator (signature, freshness, no rollback), certificate roles,
and optional membership pinning (`medfed pki members`). Real PKI files, real keys."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from bench.transport_site import DeterministicTestHook
from common.core.config import SitePolicySection, SiteSettings
from common.core.errors import (
    AbortReason,
    CertificateRejected,
    PkiError,
    ProtocolAbort,
    RoundFailed,
)
from common.protocol import pki
from site_agent.agent import SiteAgent
from site_agent.metrics import SiteMetrics
from site_agent.revocation import SiteRevocation

REPO = Path(__file__).resolve().parents[2]


def crl_der(directory: Path) -> bytes:
    pem = (directory / pki.CRL_FILE).read_bytes()
    return x509.load_pem_x509_crl(pem).public_bytes(Encoding.DER)


def cert_of(directory: Path, site: str) -> x509.Certificate:
    return pki.load_certificate(pki.site_paths(directory, site)[0])


def agent_for(
    directory: Path, site: str, tmp_path: Path, *, members: dict[str, str] | None = None
) -> SiteAgent:
    settings = SiteSettings(
        pki=directory, site=site, coordinator="127.0.0.1:1", state=tmp_path / "state",
        policy=SitePolicySection(members=members),
    )
    return SiteAgent(settings, DeterministicTestHook(site), metrics=SiteMetrics(site),
                     ledger=None)


def test_fresh_crl_is_accepted_and_a_revoked_peer_aborts(
    pki_dir: Path, now: dt.datetime
) -> None:
    revocation = SiteRevocation(pki.load_ca(pki_dir))
    revocation.offer(crl_der(pki_dir), now=now)
    revocation.check_peer("h2", cert_of(pki_dir, "h2"), now=now)  # not revoked: passes
    pki.revoke_site(pki_dir, "h2", now=now)
    revocation.offer(crl_der(pki_dir), now=now)
    with pytest.raises(ProtocolAbort) as caught:
        revocation.check_peer("h2", cert_of(pki_dir, "h2"), now=now)
    assert caught.value.reason is AbortReason.REVOKED_PEER


def test_missing_crl_refuses_the_round_with_its_cause(pki_dir: Path, now: dt.datetime) -> None:
    revocation = SiteRevocation(pki.load_ca(pki_dir))
    revocation.offer(b"", now=now)
    with pytest.raises(RoundFailed, match=r"revocation status unknown.*relayed no CRL"):
        revocation.require_fresh(now=now)


def test_stale_crl_refuses_the_round_with_its_cause(pki_dir: Path, now: dt.datetime) -> None:
    revocation = SiteRevocation(pki.load_ca(pki_dir))
    revocation.offer(crl_der(pki_dir), now=now)
    later = now + dt.timedelta(days=pki.DEFAULT_CRL_VALIDITY_DAYS + 1)
    with pytest.raises(RoundFailed, match="expired at"):
        revocation.require_fresh(now=later)
    # A stale CRL relayed later is not accepted either.
    fresh_only = SiteRevocation(pki.load_ca(pki_dir))
    fresh_only.offer(crl_der(pki_dir), now=later)
    with pytest.raises(RoundFailed, match="expired at"):
        fresh_only.require_fresh(now=later)


def test_forged_crl_is_ignored(pki_dir: Path, foreign_dir: Path, now: dt.datetime) -> None:
    """A CRL from another CA with the same name (what a coordinator could make) is not
    taken: revocation stays unknown and the round is refused."""
    pki.refresh_crl(foreign_dir, now=now)
    revocation = SiteRevocation(pki.load_ca(pki_dir))
    revocation.offer(crl_der(foreign_dir), now=now)
    assert revocation.current is None
    with pytest.raises(RoundFailed, match="signature"):
        revocation.require_fresh(now=now)
    revocation.offer(b"not a crl", now=now)
    assert revocation.current is None


def test_older_crl_cannot_roll_back_a_revocation(pki_dir: Path, now: dt.datetime) -> None:
    """The coordinator replays the CRL from before h2 was revoked: the site keeps the
    newer one (CRL numbers never go down)."""
    before = crl_der(pki_dir)
    pki.revoke_site(pki_dir, "h2", now=now)
    revocation = SiteRevocation(pki.load_ca(pki_dir))
    revocation.offer(crl_der(pki_dir), now=now)
    revocation.offer(before, now=now)
    with pytest.raises(ProtocolAbort) as caught:
        revocation.check_peer("h2", cert_of(pki_dir, "h2"), now=now)
    assert caught.value.reason is AbortReason.REVOKED_PEER


def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(Encoding.DER)


def test_site_roster_check_roles_revocation_and_members(
    pki_dir: Path, tmp_path: Path, now: dt.datetime
) -> None:
    """The agent's roster identity check, as SecAggClient calls it for each neighbour."""
    pki.issue_monitor(pki_dir, "probe", now=now)
    pki.issue_site(pki_dir, "h3", now=now)
    members = pki.site_members(pki_dir, now=now)
    assert set(members) == {"h1", "h2", "h3"}
    pinned = {site: members[site] for site in ("h1", "h2")}  # h3 is not in the consortium
    agent = agent_for(pki_dir, "h1", tmp_path, members=pinned)
    agent.revocation.offer(crl_der(pki_dir), now=now)
    identity = agent.membership.identity  # the callback SecAggClient is given
    identity("h2", _der(cert_of(pki_dir, "h2")))
    with pytest.raises(ProtocolAbort) as caught:
        identity("h3", _der(cert_of(pki_dir, "h3")))
    assert caught.value.reason is AbortReason.UNKNOWN_MEMBER
    monitor = pki.load_certificate(pki.monitor_paths(pki_dir, "probe")[0])
    with pytest.raises(ProtocolAbort) as caught:
        identity("probe", _der(monitor))
    assert caught.value.reason is AbortReason.NOT_A_SITE
    coordinator = pki.load_certificate(pki_dir / pki.COORDINATOR_CERT)
    with pytest.raises((ProtocolAbort, CertificateRejected)):
        identity("h2", _der(coordinator))
    pki.revoke_site(pki_dir, "h2", now=now)
    agent.revocation.offer(crl_der(pki_dir), now=now)
    with pytest.raises(ProtocolAbort) as caught:
        identity("h2", _der(cert_of(pki_dir, "h2")))
    assert caught.value.reason is AbortReason.REVOKED_PEER
    # Without pinning, h3 is accepted: what holds then is in docs/threat-model.md.
    unpinned = agent_for(pki_dir, "h1", tmp_path / "unpinned")
    unpinned.revocation.offer(crl_der(pki_dir), now=now)
    unpinned.membership.identity("h3", _der(cert_of(pki_dir, "h3")))


def test_site_key_readable_by_others_is_refused_at_start_up(
    pki_dir: Path, tmp_path: Path
) -> None:
    key = pki.site_paths(pki_dir, "h1")[1]
    os.chmod(key, 0o644)
    with pytest.raises(PkiError, match="chmod 600"):
        agent_for(pki_dir, "h1", tmp_path)


def test_pki_members_prints_the_policy_table(pki_dir: Path, now: dt.datetime) -> None:
    pki.revoke_site(pki_dir, "h2", now=now)
    out = subprocess.run(
        [sys.executable, "-m", "common.commands.cli", "pki", "members", "--dir", str(pki_dir)],
        check=True, capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    policy = SitePolicySection(**tomllib.loads(out)["policy"])
    # Revoked h2 is left out; h1's pin is its certificate's public-key fingerprint.
    assert policy.members == {"h1": pki.public_key_fingerprint(cert_of(pki_dir, "h1"))}


def test_pki_members_study_prints_members_a_study_lists(pki_dir: Path, now: dt.datetime) -> None:
    """`pki members --study` appended to a study file: the study lists the valid,
    unrevoked site certificates as its [[members]], as `study init --member-from` would."""
    from common.study import study_from_mapping
    from tests.study.helpers import study_mapping

    pki.revoke_site(pki_dir, "h2", now=now)
    out = subprocess.run(
        [sys.executable, "-m", "common.commands.cli", "pki", "members", "--dir", str(pki_dir),
         "--study"],
        check=True, capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    study = study_from_mapping({**study_mapping(), **tomllib.loads(out)})
    assert study.member_fingerprints() == {
        "h1": pki.public_key_fingerprint(cert_of(pki_dir, "h1"))}
