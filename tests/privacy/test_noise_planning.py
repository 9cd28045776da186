"""The site's planned noise holds by the ledger's own accounting.

The sigma search is a secant, not a bisection (bench/noiseplan.py, docs/benchmarks.md):
whatever the search, what it returns must meet the budget and the per-round cap when the
LEDGER composes it, with the accountant the ledger was created with."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from common.core.errors import ConfigError
from common.privacy.accountant import compose_epsilon, plan_noise_multiplier, plan_round_noise
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Gaussian, Segment
from tests.privacy.conftest import Pki

NOW = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
BUDGET = 4.0
DELTA = 1e-5
RATE, STEPS = 0.05, 20


def _ledger(path: Path, pki_material: Pki, accountant: str) -> PrivacyLedger:
    return PrivacyLedger(path, site_id="hospital-a", budget_epsilon=BUDGET, delta=DELTA,
                         accountant=accountant, privacy_unit="patient",
                         signer=pki_material.signer_a)


@pytest.mark.parametrize("accountant", ["prv", "pld", "rdp"])
def test_the_planned_rounds_fit_the_budget_as_the_ledger_composes_them(
    tmp_path: Path, pki_material: Pki, accountant: str
) -> None:
    ledger = _ledger(tmp_path / "l.db", pki_material, accountant)
    ledger.reserve(0, [Gaussian(40.0, 1.0)], now=NOW, purpose="count")
    ledger.reserve(1, [Segment(1.5, RATE, STEPS)], now=NOW)
    plan = plan_round_noise(history=ledger.history(), budget_epsilon=BUDGET, delta=DELTA,
                            sample_rate=RATE, steps_per_round=STEPS, remaining_rounds=3,
                            accountant=accountant)
    assert plan.epsilon_spent == ledger.spent()
    segment = Segment(plan.noise_multiplier, RATE, STEPS)
    assert ledger.preview(2, [segment]) == pytest.approx(plan.epsilon_after_round, rel=1e-12)
    for number in (2, 3, 4):  # every planned round, at the planned noise
        ledger.reserve(number, [segment], now=NOW)  # raises BudgetExhausted past the budget
    assert ledger.spent() == pytest.approx(plan.epsilon_after_plan, rel=1e-12)
    assert ledger.spent() <= BUDGET
    # Not wastefully noisy: within the search tolerance of the budget, and 3% less noise
    # on the same plan would break it.
    assert BUDGET - ledger.spent() <= 0.01
    thinner = Segment(plan.noise_multiplier * 0.97, RATE, STEPS)
    assert compose_epsilon([*ledger.history()[:2], thinner, thinner, thinner], delta=DELTA,
                           accountant=accountant) > BUDGET


@pytest.mark.parametrize("accountant", ["prv", "pld"])
def test_the_cap_holds_as_the_ledger_composes_the_round(
    tmp_path: Path, pki_material: Pki, accountant: str
) -> None:
    ledger = _ledger(tmp_path / "l.db", pki_material, accountant)
    ledger.reserve(1, [Segment(1.2, RATE, STEPS)], now=NOW)
    spent = ledger.spent()
    plan = plan_round_noise(history=ledger.history(), budget_epsilon=BUDGET, delta=DELTA,
                            sample_rate=RATE, steps_per_round=STEPS, remaining_rounds=1,
                            max_epsilon_per_round=0.3, accountant=accountant)
    assert plan.binding == "max_epsilon_per_round"
    ledger.reserve(2, [Segment(plan.noise_multiplier, RATE, STEPS)], now=NOW)
    assert ledger.spent() - spent <= 0.3
    assert ledger.spent() - spent == pytest.approx(plan.round_epsilon, rel=1e-9)


def test_a_repeated_plan_is_the_same_plan_and_a_new_history_replans() -> None:
    """Plans are cached by the canonical history: the same ledger (in any order) gets
    the same answer, a ledger with one more entry a new one."""
    kwargs = {"budget_epsilon": BUDGET, "delta": DELTA, "sample_rate": RATE,
              "steps_per_round": STEPS, "remaining_rounds": 4, "accountant": "pld"}
    history = [Segment(1.5, RATE, STEPS), Gaussian(40.0, 1.0)]
    first = plan_round_noise(history=history, **kwargs)  # type: ignore[arg-type]
    assert plan_round_noise(history=history[::-1], **kwargs) == first  # type: ignore[arg-type]
    longer = [*history, Segment(first.noise_multiplier, RATE, STEPS)]
    after = plan_round_noise(history=longer, **kwargs)  # type: ignore[arg-type]
    assert after.epsilon_spent > first.epsilon_spent
    assert after.epsilon_after_plan <= BUDGET


def test_a_whole_schedule_plan_meets_its_target_with_each_accountant() -> None:
    for accountant in ("prv", "pld", "rdp"):
        sigma = plan_noise_multiplier(target_epsilon=1.5, delta=DELTA, sample_rate=0.01,
                                      steps=500, accountant=accountant)
        spent = compose_epsilon([Segment(sigma, 0.01, 500)], delta=DELTA,
                                accountant=accountant)
        assert 1.5 - 0.01 <= spent <= 1.5
    with pytest.raises(ConfigError):
        plan_noise_multiplier(target_epsilon=1e-9, delta=DELTA, sample_rate=1.0, steps=10**6,
                              accountant="rdp", epsilon_tolerance=1e-10)


def test_every_planned_round_with_its_evaluation_and_the_final_evaluation_fits() -> None:
    """A site planning exactly the rounds it runs used to find its last round over budget
    once each round's DP evaluation was added (every site then declined it): the plan
    reserves the evaluation in each remaining round and once more for the final
    evaluation-only round."""
    from site_agent.dp_release import evaluation_mechanism

    evaluation = evaluation_mechanism(noise_std=5.0, n_noise=2, bins=20)
    history = [Gaussian(40.0, 1.0)]
    rounds = 3
    common = dict(history=history, budget_epsilon=BUDGET, delta=DELTA, sample_rate=RATE,
                  steps_per_round=STEPS, remaining_rounds=rounds, accountant="rdp")
    plan = plan_round_noise(**common, per_round=[evaluation], reserved=[evaluation])
    run = [*history, *([Segment(plan.noise_multiplier, RATE, STEPS), evaluation] * rounds),
           evaluation]
    assert compose_epsilon(run, delta=DELTA, accountant="rdp") <= BUDGET + 1e-9
    # Planned without them, the same run spends more than the budget: the old failure.
    blind = plan_round_noise(**common)
    run = [*history, *([Segment(blind.noise_multiplier, RATE, STEPS), evaluation] * rounds),
           evaluation]
    assert compose_epsilon(run, delta=DELTA, accountant="rdp") > BUDGET
    assert plan.noise_multiplier > blind.noise_multiplier


def test_releases_that_alone_exceed_the_budget_leave_no_plan_and_say_so() -> None:
    """Per-round releases (a study's DP evaluations at little noise) that alone overrun
    the budget: epsilon barely falls as sigma grows, and the secant's step used to
    overflow (OverflowError, an "unexpected" crash of the site). Now the search runs
    to its bound and refuses with ConfigError."""
    from common.releases.seam import NoisePlan

    evaluation = NoisePlan(sigma=1.0, n_noise=2, length=400, l2_sensitivity=1.0,
                           l1_sensitivity=1.0).mechanism()
    with pytest.raises(ConfigError, match="unreachable with any noise multiplier"):
        plan_round_noise(history=[], budget_epsilon=8.0, delta=DELTA, sample_rate=RATE,
                         steps_per_round=STEPS, remaining_rounds=1, per_round=[evaluation],
                         reserved=[evaluation])
