"""Attack: peers' settings under-noised a site. Each site sized its share of the DP
evaluation histogram's noise from its own `privacy.evaluation_noise_std`, so peers
configured at 1 next to a site at the default 10 left the sum with less honest noise
than that site's ledger recorded (it under-reported its privacy loss by 1.98x in zCDP
rho, 1.4x in epsilon at delta 1e-5).

The noise is now the study's `[privacy.evaluation] noise_std`, one value for every
member, inside the study digest every announcement carries; a site's own setting is
only the least it accepts (a study asking less is refused at enrolment). The same
check over real processes, on the sums themselves: tests/e2e/test_peers_lower_
evaluation_noise.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from common.core.config import PrivacySection, SiteSettings, load_settings
from common.core.errors import ConfigError, PrivacyError
from common.privacy.accountant import compose_epsilon
from common.releases.plugins.evaluation_histogram import EvaluationHistogram, evaluation_noise_std
from common.study import (
    DEFAULT_EVALUATION_NOISE_STD,
    SitePrivacyPolicy,
    Study,
    check_study_against_policy,
    study_bytes,
    study_from_mapping,
    study_sha256,
)
from site_agent.datacheck import site_policy
from tests.study.helpers import study_mapping

DELTA = 1e-5


def study_with(**evaluation: Any) -> Study:
    mapping = study_mapping(delta=DELTA)
    mapping["privacy"]["evaluation"] = evaluation
    return study_from_mapping(mapping, source="test")


def honest_noise_std(shares: list[float], *, n_noise: int) -> float:
    """Std of the noise in a sum a site can count on: its own share and the n_noise - 1
    weakest of the others' (the T colluders know theirs), each a share of std s /
    sqrt(n_noise) for a site configured at s."""
    own, *others = shares
    counted = [own, *sorted(others)[: n_noise - 1]]
    return math.sqrt(sum(s * s / n_noise for s in counted))


def test_attack_peers_lower_evaluation_noise() -> None:
    """Peers at 1 beside a site at 10, n_noise = 2: the noise the site could count on
    was 7.1, not the 10 its ledger recorded (epsilon under-reported ~2x). Under a study
    every member adds the study's share, whatever its own setting."""
    configured = [10.0, 1.0, 1.0]  # this site, then its peers
    before = honest_noise_std(configured, n_noise=2)
    assert before == pytest.approx(10 / math.sqrt(2) * math.sqrt(1.01), rel=1e-6)
    recorded = EvaluationHistogram(noise_std=10.0, bins=20).plan(n_noise=2).mechanism()
    actual = EvaluationHistogram(noise_std=before, bins=20).plan(n_noise=2).mechanism()
    assert actual.zcdp_rho / recorded.zcdp_rho > 1.9  # the 1.98x (rho)
    epsilon_ratio = (compose_epsilon([actual], delta=DELTA, accountant="rdp")
                     / compose_epsilon([recorded], delta=DELTA, accountant="rdp"))
    assert epsilon_ratio > 1.4

    study = study_with(noise_std=10.0)
    shares = [evaluation_noise_std(study, own=own) for own in configured]
    assert shares == [10.0, 10.0, 10.0]
    assert honest_noise_std(shares, n_noise=2) == pytest.approx(10.0)


def test_the_noise_is_in_the_study_digest_and_a_default_study_keeps_its_digest() -> None:
    default = study_with()
    explicit = study_with(noise_std=DEFAULT_EVALUATION_NOISE_STD)
    assert default.privacy.evaluation.noise_std == DEFAULT_EVALUATION_NOISE_STD
    # A study written before the field (or at its default) has the same bytes, so every
    # approval pinned by its SHA-256 still holds.
    assert study_bytes(default) == study_bytes(explicit)
    assert b"noise_std" not in study_bytes(default)
    lower = study_with(noise_std=2.5)
    assert b'"noise_std":2.5' in study_bytes(lower)
    assert study_sha256(lower) != study_sha256(default)


@pytest.mark.parametrize("value", [0.5, 0.0, -1.0, 2e6])
def test_an_out_of_range_noise_is_refused_naming_the_field(value: float) -> None:
    with pytest.raises(ConfigError, match=r"privacy\.evaluation\.noise_std"):
        study_with(noise_std=value)


def test_a_study_asking_less_noise_than_the_sites_floor_is_refused_at_enrolment() -> None:
    policy = SitePrivacyPolicy(epsilon=8.0, delta=DELTA, min_evaluation_noise_std=10.0)
    with pytest.raises(PrivacyError, match=r"privacy\.evaluation\.noise_std = 2\.5"):
        check_study_against_policy(study_with(noise_std=2.5), policy)
    check_study_against_policy(study_with(noise_std=10.0), policy)
    check_study_against_policy(study_with(noise_std=2.5),
                               SitePrivacyPolicy(epsilon=8.0, delta=DELTA))


def test_an_old_site_config_still_loads_its_value_now_the_least_it_accepts(
    tmp_path: Any,
) -> None:
    """A config that set privacy.evaluation_noise_std (deploy/config/site.toml: 10)
    loads as before; the value is now the site's floor, and unset means no floor."""
    config = tmp_path / "site.toml"
    config.write_text('site = "st-marys"\ncoordinator = "127.0.0.1:7443"\n'
                      f'state = "{tmp_path / "state"}"\npki = "{tmp_path / "pki"}"\n\n'
                      "[privacy]\nevaluation_noise_std = 10.0\n", encoding="utf-8")
    settings = load_settings(SiteSettings, config_file=config, overrides={})
    assert site_policy(settings).min_evaluation_noise_std == 10.0
    assert PrivacySection().evaluation_noise_std is None
    # Without a study (no production federation), a site's own setting, else the default.
    assert evaluation_noise_std(None, own=4.0) == 4.0
    assert evaluation_noise_std(None) == DEFAULT_EVALUATION_NOISE_STD

