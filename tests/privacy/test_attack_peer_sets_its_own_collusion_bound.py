"""Attack: each site sized its share of the distributed noise from *its own*
`policy.max_colluding_sites` and `min_round_sites`, so a peer configured with a smaller
bound added less noise: the honest noise in the sum was 0.73-0.83x what a site's ledger
recorded. The bound and the round floor are now the study's (one value for every member,
inside the study digest that every announcement carries); a site refuses a study that
assumes fewer colluders or a lower floor than its own policy, and a round below the
study's floor, or with a threshold the study's colluders could reach, is refused
whatever the site's own policy would allow."""

from __future__ import annotations

from typing import Any

import pytest

from common.core.config import SitePolicySection
from common.core.errors import AbortReason, ConfigError, PrivacyError, ProtocolAbort
from common.core.modelfile import flat_layout
from common.rounds.announcement import Announcement, validate_for_site
from common.study import (
    SitePrivacyPolicy,
    Study,
    check_study_against_policy,
    study_round_terms,
    study_sha256,
)
from site_agent.dp_release import evaluation_noise_sites


def _study(**privacy: Any) -> Study:
    return Study.model_validate({
        "study": {"name": "sepsis", "rounds": 3},
        "data": {"label_column": "outcome", "patient_column": "pid"},
        "features": [{"name": "age"}],
        "privacy": privacy,
    })


def _announcement(participants: tuple[str, ...], *, threshold: int) -> Announcement:
    return Announcement(
        round_number=7, round_nonce=bytes(range(16)), participants=participants,
        threshold=threshold, neighbours=0, vector_length=8 + 1 + 4, quantization_bits=20,
        clip=1.0, histogram_bins=2, secure_aggregation=True, model_layout=flat_layout(8),
        model_sha256=bytes(32), model_bytes=32, local_epochs=1, learning_rate=0.1,
        fedprox_mu=0.0, planned_rounds=5, train_deadline_ms=1_700_000_000_000,
        phase_timeout_ms=30_000, weight_cap=100, max_chunk_bytes=1 << 20,
    )


LAX_PEER = SitePolicySection(max_colluding_sites=0, min_round_sites=2, min_threshold=2)
STRICT_SITE = SitePolicySection(max_colluding_sites=1, min_round_sites=5)


def test_a_peer_configured_with_a_smaller_collusion_bound_adds_the_same_noise_share() -> None:
    study = _study(max_colluding_sites=1, min_round_sites=5)
    shares = {
        name: evaluation_noise_sites(policy, threshold=4, secure=True, study=study)
        for name, policy in (("lax", LAX_PEER), ("strict", STRICT_SITE))
    }
    # Under its own policy the lax peer planned for 2 honest shares, the strict site
    # for 3: the lax peer's noise was sqrt(2/3) of what the strict site's ledger assumed.
    assert evaluation_noise_sites(LAX_PEER, threshold=4, secure=True) == 2
    assert evaluation_noise_sites(STRICT_SITE, threshold=4, secure=True) == 3
    assert shares == {"lax": 3, "strict": 3}
    for policy in (LAX_PEER, STRICT_SITE):
        assert study_round_terms(study, max_colluding_sites=policy.max_colluding_sites,
                                 min_round_sites=policy.min_round_sites) == (1, 5)


def test_a_study_assuming_fewer_colluders_than_the_site_is_refused_at_joining() -> None:
    policy = SitePrivacyPolicy(epsilon=8.0, delta=1e-5, max_colluding_sites=2,
                               min_round_sites=3)
    with pytest.raises(PrivacyError, match="max_colluding_sites = 1"):
        check_study_against_policy(_study(max_colluding_sites=1), policy)
    with pytest.raises(PrivacyError, match="round floor"):
        check_study_against_policy(
            _study(max_colluding_sites=2, min_round_sites=2),
            SitePrivacyPolicy(epsilon=8.0, delta=1e-5, max_colluding_sites=2,
                              min_round_sites=6))
    check_study_against_policy(_study(max_colluding_sites=2, min_round_sites=4), policy)


def test_the_collusion_bound_is_in_the_study_digest_every_round_announces() -> None:
    assert study_sha256(_study(max_colluding_sites=1)) != study_sha256(
        _study(max_colluding_sites=0))
    assert study_sha256(_study(min_round_sites=3)) != study_sha256(_study(min_round_sites=4))


def test_a_coordinator_running_a_round_below_the_studys_floor_is_refused() -> None:
    """The lax peer's own policy would take a round of 2 sites with threshold 1 (T = 0);
    under a study with T = 1 and floor 3 it refuses it, before any key."""
    study = _study(max_colluding_sites=1, min_round_sites=3)
    two = _announcement(("alpha", "beta"), threshold=2)
    validate_for_site(two, policy=LAX_PEER, site_id="beta")  # its own policy: accepted
    with pytest.raises(ProtocolAbort) as caught:
        validate_for_site(two, policy=LAX_PEER, site_id="beta", study=study)
    assert caught.value.reason is AbortReason.ROUND_TOO_SMALL
    assert "the study needs at least 3" in str(caught.value)


def test_a_coordinator_announcing_a_threshold_the_studys_colluders_reach_is_refused() -> None:
    """A threshold chosen for a smaller bound than the study's: with 4 sites t = 3 holds
    for T = 0 but not for the study's T = 2 (SecAgg+ needs 2t > k + 1 + T)."""
    study = _study(max_colluding_sites=2, min_round_sites=3)
    four = _announcement(("alpha", "beta", "delta", "gamma"), threshold=3)
    validate_for_site(four, policy=LAX_PEER, site_id="beta")
    with pytest.raises(ConfigError, match="with 2 colluding sites"):
        validate_for_site(four, policy=LAX_PEER, site_id="beta", study=study)
