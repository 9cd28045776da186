"""At the site: the DP cohort count, DP evaluation and the
site's own noise plan, each on a real signed ledger."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pytest

from common.core.codec import TensorSpec
from common.core.config import SitePolicySection, SiteSettings
from common.core.errors import BudgetExhausted
from common.crypto.random import system_random
from common.privacy.layered import charged_by_purpose
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Gaussian, Segment
from common.rounds.announcement import RoundPlan
from site_agent import dp_release
from site_agent.datacheck import site_policy
from site_agent.site_training import DpTrainingHook
from tests.privacy.conftest import Pki

NOW = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)


def _ledger(path: Path, pki_material: Pki, *, budget: float = 8.0) -> PrivacyLedger:
    return PrivacyLedger(
        path, site_id="hospital-a", budget_epsilon=budget, delta=1e-5,
        privacy_unit="patient", signer=pki_material.signer_a,
    )


# ------------------------------------------------------------ section 6: noise planning

def test_announced_one_round_gets_the_sites_own_plan(tmp_path: Path, pki_material: Pki) -> None:
    ledger = _ledger(tmp_path / "l.db", pki_material)
    policy = SitePolicySection(planned_rounds=10)
    kwargs = {"policy": policy, "sample_rate": 0.05, "steps_per_round": 20}
    own = dp_release.plan_training_noise(ledger, announced_rounds=10, **kwargs)
    lowball = dp_release.plan_training_noise(ledger, announced_rounds=1, **kwargs)
    assert lowball.noise_multiplier == own.noise_multiplier
    more = dp_release.plan_training_noise(ledger, announced_rounds=40, **kwargs)
    assert more.noise_multiplier > own.noise_multiplier  # an announcement can only raise


def test_study_rounds_set_the_plan_whatever_is_announced(
    tmp_path: Path, pki_material: Pki
) -> None:
    """Under a study the site plans for the study's rounds: neither a lower nor a higher
    announcement moves its noise, and a 3-round study is not noised as 10 rounds."""
    ledger = _ledger(tmp_path / "l.db", pki_material)
    policy = SitePolicySection(planned_rounds=10)
    kwargs = {"policy": policy, "sample_rate": 0.05, "steps_per_round": 20}
    study = dp_release.plan_training_noise(ledger, announced_rounds=3, study_rounds=3, **kwargs)
    for announced in (1, 10, 40):
        again = dp_release.plan_training_noise(
            ledger, announced_rounds=announced, study_rounds=3, **kwargs
        )
        assert again.noise_multiplier == study.noise_multiplier
    ten = dp_release.plan_training_noise(ledger, announced_rounds=3, **kwargs)
    assert study.noise_multiplier < ten.noise_multiplier
    # Three rounds at the planned sigma spend the budget (the plan aims just under it).
    assert 0.9 * 8.0 <= study.epsilon_after_plan <= 8.0


def test_study_plan_spends_the_budget_by_its_end(tmp_path: Path, pki_material: Pki) -> None:
    """Round by round, re-planned from the ledger: after the study's last round the
    ledger holds >= 90% of the budget and never more than it."""
    ledger = _ledger(tmp_path / "l.db", pki_material)
    policy = SitePolicySection(planned_rounds=10)
    for round_number in range(1, 4):
        plan = dp_release.plan_training_noise(
            ledger, policy=policy, announced_rounds=3, study_rounds=3, sample_rate=0.05,
            steps_per_round=20,
        )
        ledger.reserve(round_number, [Segment(plan.noise_multiplier, 0.05, 20)], now=NOW)
    assert 0.9 * 8.0 <= ledger.spent() <= 8.0


def test_round_spend_never_exceeds_the_sites_cap(tmp_path: Path, pki_material: Pki) -> None:
    ledger = _ledger(tmp_path / "l.db", pki_material)
    policy = SitePolicySection(planned_rounds=1, max_epsilon_per_round=0.5)
    plan = dp_release.plan_training_noise(
        ledger, policy=policy, announced_rounds=1, sample_rate=0.05, steps_per_round=20
    )
    assert plan.binding == "max_epsilon_per_round"
    assert plan.round_epsilon <= 0.5


def test_attack_training_skips_the_studys_round_cap(
    tmp_path: Path, pki_material: Pki
) -> None:
    """A study capping rounds at 0.5 and a site that sets no cap of its own: the site's
    DP-SGD used to plan its round under the site's policy alone (one round spending the
    budget); the study's cap holds too (`per_round_cap`), as for every release."""
    from common.study import study_from_mapping
    from tests.study.helpers import study_mapping

    study = study_from_mapping(study_mapping(max_epsilon_per_round=0.5), source="test")
    ledger = _ledger(tmp_path / "l.db", pki_material)
    kwargs = {"policy": SitePolicySection(planned_rounds=1), "announced_rounds": 1,
              "sample_rate": 0.05, "steps_per_round": 20,
              "study_rounds": study.study.rounds}
    assert dp_release.plan_training_noise(ledger, **kwargs).round_epsilon > 0.5
    plan = dp_release.plan_training_noise(ledger, study=study, **kwargs)
    assert plan.binding == "max_epsilon_per_round"
    assert plan.round_epsilon <= 0.5
    # The site's training hook plans with the study it joined.
    from site_agent.training_plan import round_noise_multiplier

    settings = SiteSettings(site="hospital-a", coordinator="127.0.0.1:7443",
                            state=tmp_path / "state", pki=tmp_path / "pki",
                            policy=SitePolicySection(planned_rounds=1))
    announced = RoundPlan(round_number=1, planned_rounds=1, local_epochs=1,
                          learning_rate=0.1, fedprox_mu=0.0, histogram_bins=20, layout=())
    assert round_noise_multiplier(
        ledger, settings=settings, plan=announced, sample_rate=0.05, steps_per_epoch=20,
        evaluation=(), study=study, record_level="none",
    ) == pytest.approx(plan.noise_multiplier)


def test_restart_replans_from_what_the_ledger_shows(tmp_path: Path, pki_material: Pki) -> None:
    path = tmp_path / "l.db"
    ledger = _ledger(path, pki_material)
    policy = SitePolicySection(planned_rounds=5)
    kwargs = {"policy": policy, "announced_rounds": 5, "sample_rate": 0.05,
              "steps_per_round": 20}
    first = dp_release.plan_training_noise(ledger, **kwargs)
    ledger.reserve(1, [Segment(first.noise_multiplier, 0.05, 20)], now=NOW)
    before_restart = dp_release.plan_training_noise(ledger, **kwargs)
    reopened = dp_release.plan_training_noise(_ledger(path, pki_material), **kwargs)
    assert reopened == before_restart
    # Four rounds left on a spent ledger: composed, the plan still fits the budget.
    assert reopened.epsilon_spent == pytest.approx(ledger.spent())
    assert reopened.epsilon_after_plan <= 8.0


# ---------------------------------------------------------------- section 5: the count

def _hook(tmp_path: Path, patients: int) -> DpTrainingHook:
    """A site joined to a study of the synthetic cohort, its records encoded with the
    federation's statistics (the same for every `patients`: they are released apart)."""
    from demo.study import exact_statistics, synthetic_demo_study
    from site_agent.data import load_study_table
    from site_agent.synthetic import generate_cohort, write_site_csvs

    study = synthetic_demo_study(name="releases", rounds=1, epsilon=8.0, delta=1e-5,
                                 histogram_bins=5, local_epochs=1, learning_rate=0.1,
                                 batch_size=16)
    released = write_site_csvs(tmp_path / "released", generate_cohort(
        ["hospital-a"], seed=1, patients_per_site=200))["hospital-a"]
    statistics = exact_statistics({"hospital-a": load_study_table(released, study)}, study,
                                  seed=0)
    path = write_site_csvs(tmp_path / "data", generate_cohort(
        ["hospital-a"], seed=1, patients_per_site=patients))["hospital-a"]
    settings = SiteSettings(
        site="hospital-a", coordinator="127.0.0.1:9", state=tmp_path, pki=tmp_path,
        data={"path": path},
        training={"device": "cpu"},
        privacy={"privacy_unit": "patient"},
    )
    hook = DpTrainingHook(settings, dp=True)
    hook.join_study(study, site_policy(settings))
    hook.set_statistics(statistics)
    return hook


def test_count_is_released_once_and_persisted(tmp_path: Path, pki_material: Pki) -> None:
    ledger = _ledger(tmp_path / "l.db", pki_material)
    first = dp_release.release_cohort_count(
        ledger, units=120, epsilon=0.1, state=tmp_path, now=NOW
    )
    again = dp_release.release_cohort_count(
        ledger, units=121, epsilon=0.1, state=tmp_path, now=NOW
    )
    assert again == first  # a restart (or a changed N) never re-releases
    counts = [e for e in ledger.entries() if e.purpose == "count"]
    assert len(counts) == 1
    (mechanism,) = counts[0].mechanisms
    assert isinstance(mechanism, Gaussian) and mechanism.l2_sensitivity == 1.0
    assert json.loads((tmp_path / dp_release.COUNT_STATE_FILE).read_text())["noisy_count"] == (
        first.noisy_count
    )


def test_nothing_but_the_noisy_count_depends_on_n(tmp_path: Path, pki_material: Pki) -> None:
    """Two data sets differing by one unit, whose noisy counts agree: identical q,
    steps, noise, mechanism, FedAvg weight and reported units."""
    seen = []
    for patients in (200, 201):
        state = tmp_path / str(patients)
        state.mkdir()
        (state / dp_release.COUNT_STATE_FILE).write_text(
            json.dumps({"noisy_count": 150, "noise_std": 48.0, "ledger_round": 0})
        )
        hook = _hook(state, patients)
        hook.attach_ledger(_ledger(state / "l.db", pki_material), state=state)
        layout = hook.layout()
        plan = RoundPlan(round_number=1, planned_rounds=1, local_epochs=1, learning_rate=0.1,
                         fedprox_mu=0.0, histogram_bins=5, layout=layout)
        segments = hook.planned_segments(plan)
        flat = np.zeros(sum(TensorSpec.elements.fget(s) for s in layout), dtype=np.float32)
        update = hook.train(plan, flat)
        seen.append((segments, update.num_samples, update.patients))
    assert seen[0] == seen[1]
    assert seen[0][1] == 150


# ----------------------------------------------------------- section 3: DP evaluation

def test_evaluation_noise_is_planned_for_the_floor_minus_colluders() -> None:
    policy = SitePolicySection(max_colluding_sites=1, min_round_sites=3)
    assert dp_release.evaluation_noise_sites(policy, threshold=5, secure=True) == 2
    assert dp_release.evaluation_noise_sites(policy, threshold=2, secure=True) == 1
    assert dp_release.evaluation_noise_sites(policy, threshold=0, secure=False) == 1
    strict = SitePolicySection(max_colluding_sites=3, min_round_sites=3)
    assert dp_release.evaluation_noise_sites(strict, threshold=9, secure=True) == 2


def test_one_score_per_patient() -> None:
    ids = np.array([7, 7, 7, 3, 3, 9])
    picked = dp_release.one_per_unit(ids, size=6)
    assert sorted(ids[picked].tolist()) == [3, 7, 9]
    assert dp_release.one_per_unit(None, size=4).tolist() == [0, 1, 2, 3]


def test_split_noise_sums_to_the_planned_variance() -> None:
    sigma, n_noise = 6.0, 3
    total = sum(
        dp_release.noised_histogram(np.zeros(20_000, np.int64), noise_std=sigma,
                                    n_noise=n_noise, rng=system_random)
        for _ in range(n_noise)
    )
    assert np.var(total) == pytest.approx(sigma**2, rel=0.05)


def test_evaluations_are_ledger_entries_capped_and_paid(tmp_path: Path, pki_material: Pki) -> None:
    ledger = _ledger(tmp_path / "l.db", pki_material, budget=1.0)
    policy = SitePolicySection(max_evaluations=2)
    mechanism = dp_release.evaluation_mechanism(noise_std=10.0, n_noise=2, bins=5)
    assert mechanism.l2_sensitivity == 1.0 and mechanism.dimension == 10
    for round_number in (1, 2):
        assert dp_release.check_evaluation_allowed(ledger, policy)
        ledger.reserve(round_number, [mechanism], now=NOW, purpose="evaluation")
    assert not dp_release.check_evaluation_allowed(ledger, policy)
    spent = charged_by_purpose([(e.purpose, e.mechanisms) for e in ledger.entries()],
                               delta=ledger.delta, accountant=ledger.accountant,
                               charge=ledger.charge)
    assert spent["evaluation"] > 0
    # An evaluation the budget cannot pay is refused (nothing recorded, nothing sent).
    costly = dp_release.evaluation_mechanism(noise_std=1.0, n_noise=1, bins=5)
    with pytest.raises(BudgetExhausted):
        ledger.reserve(3, [costly], now=NOW, purpose="evaluation")
    assert dp_release.evaluations_used(ledger) == 2
