"""Mechanisms beyond DP-SGD, pinned against independent references: the exact Gaussian
mechanism (Balle & Wang 2018), Google dp-accounting's PLD and RDP accountants, Opacus PRV,
and the DDGauss bound recomputed from the paper's formula; plus the site's round planner."""

from __future__ import annotations

import json
import math

import dp_accounting  # type: ignore[import-untyped]
import pytest
from dp_accounting.pld import PLDAccountant  # type: ignore[import-untyped]
from dp_accounting.rdp import RdpAccountant  # type: ignore[import-untyped]
from scipy.stats import norm  # type: ignore[import-untyped]

from common.core.errors import ConfigError
from common.privacy.accountant import (
    RDP_ORDERS,
    Segment,
    account,
    compose_epsilon,
    plan_round_noise,
)
from common.privacy.mechanisms import (
    DistributedDiscreteGaussian,
    Gaussian,
    Mechanism,
    mechanism_from_json_dict,
    mechanisms_to_json,
)

DELTA = 1e-5


def exact_gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Smallest epsilon of the Gaussian mechanism at `delta`, from the analytic formula
    delta(eps) = Phi(1/(2s) - eps*s) - e^eps Phi(-1/(2s) - eps*s) (Balle & Wang, ICML 2018,
    Theorem 8), solved by bisection."""

    def delta_of(epsilon: float) -> float:
        s = noise_multiplier
        return float(norm.cdf(0.5 / s - epsilon * s)
                     - math.exp(epsilon) * norm.cdf(-0.5 / s - epsilon * s))

    low, high = 0.0, 100.0
    for _ in range(200):
        middle = (low + high) / 2
        if delta_of(middle) > delta:
            low = middle
        else:
            high = middle
    return high


@pytest.mark.parametrize(("noise_std", "sensitivity"), [(2.0, 1.0), (10.0, 4.0), (0.8, 1.0)])
def test_single_gaussian_matches_the_closed_form_and_never_goes_below(
    noise_std: float, sensitivity: float
) -> None:
    exact = exact_gaussian_epsilon(noise_std / sensitivity, DELTA)
    mechanism = [Gaussian(noise_std=noise_std, l2_sensitivity=sensitivity)]
    pld = account(mechanism, delta=DELTA, accountant="pld")
    prv = account(mechanism, delta=DELTA, accountant="prv")
    rdp = account(mechanism, delta=DELTA, accountant="rdp")
    assert pld.accountant == "pld" and prv.accountant == "prv" and not pld.fell_back
    for report in (pld, prv, rdp):
        assert report.epsilon >= exact * (1 - 1e-9)  # never under-reports
    assert pld.epsilon == pytest.approx(exact, rel=0.01, abs=0.01)
    assert prv.epsilon == pytest.approx(exact, rel=0.02, abs=0.02)
    assert rdp.epsilon >= pld.epsilon


HISTORIES: list[list[Mechanism]] = [
    [Segment(1.0, 0.01, 1000)],
    [Segment(1.1, 0.02, 300), Segment(0.8, 0.01, 200), Gaussian(20.0, 1.0)],
    [Segment(2.0, 0.05, 200), Gaussian(5.0, 2.0, count=3)],
]


@pytest.mark.parametrize("history", HISTORIES, ids=["sgd", "sgd+count", "sgd+stats"])
def test_pld_agrees_with_prv_and_the_reference_and_rdp_is_above(
    history: list[Mechanism],
) -> None:
    reference = PLDAccountant(value_discretization_interval=1e-4)
    for mechanism in history:
        if isinstance(mechanism, Segment):
            event = dp_accounting.PoissonSampledDpEvent(
                mechanism.sample_rate, dp_accounting.GaussianDpEvent(mechanism.noise_multiplier)
            )
            reference.compose(dp_accounting.SelfComposedDpEvent(event, mechanism.steps))
        elif isinstance(mechanism, Gaussian):
            reference.compose(dp_accounting.SelfComposedDpEvent(
                dp_accounting.GaussianDpEvent(mechanism.noise_multiplier), mechanism.count))
    fine = float(reference.get_epsilon(DELTA))
    pld = compose_epsilon(history, delta=DELTA, accountant="pld")
    prv = compose_epsilon(history, delta=DELTA, accountant="prv")
    rdp = compose_epsilon(history, delta=DELTA, accountant="rdp")
    # Both upper bounds; the coarser PLD mesh is pessimistic, so never below the fine one.
    assert pld >= fine - 1e-9 and pld == pytest.approx(fine, rel=0.01)
    assert prv == pytest.approx(pld, rel=0.02, abs=0.015)
    assert rdp >= max(pld, prv)


def ddgauss_rdp_reference(order: float, *, variance: float, n: int, l2: float, l1: float,
                          d: int) -> float:
    """Kairouz, Liu & Steinke 2021, Proposition 14, written out again here."""
    tau = 10 * sum(math.exp(-2 * math.pi**2 * variance * k / (k + 1)) for k in range(1, n))
    s = math.sqrt(n * variance)
    return min(
        order / 2 * (l2 / s) ** 2 + tau * d,
        order / 2 * ((l2 / s) ** 2 + 2 * (l1 / s) * tau + tau**2 * d),
        order / 2 * (l2 / s + math.sqrt(d) * tau) ** 2,
    )


def test_ddgauss_rdp_follows_proposition_14_and_its_tau() -> None:
    # Small per-site variance so that tau is far from zero and all three terms matter.
    mechanism = DistributedDiscreteGaussian(
        noise_variance_per_site=0.3, contributors=5, l2_sensitivity=3.0, dimension=64,
        l1_sensitivity=9.0,
    )
    assert mechanism.tau == pytest.approx(
        10 * sum(math.exp(-2 * math.pi**2 * 0.3 * k / (k + 1)) for k in range(1, 5)), rel=1e-12
    )
    assert mechanism.tau > 1e-3
    for order in (1.5, 2.0, 8.0, 64.0):
        assert mechanism.rdp(order) == pytest.approx(
            ddgauss_rdp_reference(order, variance=0.3, n=5, l2=3.0, l1=9.0, d=64), rel=1e-12
        )
    assert mechanism.total_noise_variance == pytest.approx(1.5)


def test_ddgauss_history_is_composed_in_rdp_flagged_and_matches_dp_accounting() -> None:
    """With large per-site noise tau vanishes and DDGauss is rho-zCDP with
    rho = Delta2^2 / (2 n sigma^2); dp-accounting's RDP accountant (ZCDpEvent) composes it
    with the sampled-Gaussian steps to the same epsilon as ours."""
    ddg = DistributedDiscreteGaussian(
        noise_variance_per_site=2500.0, contributors=8, l2_sensitivity=600.0, dimension=10_000
    )
    rho = 600.0**2 / (2 * 8 * 2500.0)
    assert ddg.tau < 1e-100 and ddg.zcdp_rho == pytest.approx(rho, rel=1e-9)
    history: list[Mechanism] = [Segment(1.0, 0.01, 200), ddg, ddg]
    for requested in ("prv", "pld"):
        report = account(history, delta=DELTA, accountant=requested)
        assert report.accountant == "rdp" and report.requested_accountant == requested
        assert report.fell_back and "distributed discrete Gaussian" in str(report.fallback_reason)
    ours = account(history, delta=DELTA, accountant="rdp").epsilon
    reference = RdpAccountant(orders=list(RDP_ORDERS))
    reference.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 200))
    reference.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(rho), 2))
    expected = float(reference.get_epsilon(DELTA))
    assert ours == pytest.approx(expected, rel=0.02)
    # And never below the PLD epsilon of the DP-SGD part alone.
    assert ours > compose_epsilon(history[:1], delta=DELTA, accountant="pld")


def test_tagged_json_round_trip_and_format1_segments() -> None:
    mechanisms = (
        Segment(0.9, 0.02, 40),
        Gaussian(3.0, 1.0, 2),
        DistributedDiscreteGaussian(noise_variance_per_site=9.0, contributors=3,
                                    l2_sensitivity=5.0, dimension=16, l1_sensitivity=12.0),
    )
    text = mechanisms_to_json(mechanisms)
    assert [m["kind"] for m in json.loads(text)] == [
        "sampled_gaussian", "gaussian", "distributed_discrete_gaussian"]
    assert tuple(mechanism_from_json_dict(raw) for raw in json.loads(text)) == mechanisms
    assert mechanism_from_json_dict([1.2, 0.02, 37]) == Segment(1.2, 0.02, 37)  # format 1
    raw = json.loads(text)[2]
    raw["tau"] = 0.5  # a recorded tau that the parameters do not give
    with pytest.raises(ConfigError, match="tau"):
        mechanism_from_json_dict(raw)
    with pytest.raises(ConfigError, match="unknown mechanism kind"):
        mechanism_from_json_dict({"kind": "laplace", "scale": 1.0})
    with pytest.raises(ConfigError) as info:
        DistributedDiscreteGaussian(noise_variance_per_site=0.1, contributors=3,
                                    l2_sensitivity=1.0, dimension=4)
    assert info.value.field == "noise_variance_per_site"
    with pytest.raises(ConfigError) as info:
        Gaussian(noise_std=-1.0, l2_sensitivity=1.0)
    assert info.value.field == "noise_std"


# --- the site plans its own noise -------------------------------------------------------


BUDGET = 4.0
PLAN: dict[str, object] = {
    "budget_epsilon": BUDGET, "delta": DELTA, "sample_rate": 0.02, "steps_per_round": 20,
    "accountant": "pld",
}


def test_round_plan_never_exceeds_the_cap_and_spends_from_the_ledger() -> None:
    spent_history = [Segment(1.0, 0.02, 100)]
    spent = compose_epsilon(spent_history, delta=DELTA, accountant="pld")
    plan = plan_round_noise(history=spent_history, remaining_rounds=5,
                            max_epsilon_per_round=0.2, **PLAN)  # type: ignore[arg-type]
    assert plan.epsilon_spent == pytest.approx(spent)
    assert plan.binding == "max_epsilon_per_round"
    # The round's cost is a difference of COMPOSED epsilons, and within the cap.
    after = compose_epsilon([*spent_history, Segment(plan.noise_multiplier, 0.02, 20)],
                            delta=DELTA, accountant="pld")
    assert after - spent == pytest.approx(plan.round_epsilon)
    assert plan.round_epsilon <= 0.2
    assert plan.epsilon_after_plan <= BUDGET


def test_a_one_round_announcement_cannot_buy_a_cheap_round() -> None:
    """The remaining-round count is the site's policy; the cap holds whatever it is: a
    coordinator claiming "1 round left" gets the same per-round noise as the site's plan
    whenever the cap binds."""
    site_plan = plan_round_noise(history=[], remaining_rounds=10, max_epsilon_per_round=0.5,
                                 **PLAN)  # type: ignore[arg-type]
    one_round = plan_round_noise(history=[], remaining_rounds=1, max_epsilon_per_round=0.5,
                                 **PLAN)  # type: ignore[arg-type]
    uncapped = plan_round_noise(history=[], remaining_rounds=1, **PLAN)  # type: ignore[arg-type]
    assert one_round.round_epsilon <= 0.5 and site_plan.round_epsilon <= 0.5
    assert one_round.noise_multiplier >= site_plan.noise_multiplier * 0.99 or (
        site_plan.binding == "budget")
    assert uncapped.noise_multiplier < one_round.noise_multiplier  # the cap is what held
    # Later rounds re-plan from the ledger: the budget still holds after all of them.
    history: list[Segment] = []
    for remaining in (3, 2, 1):
        plan = plan_round_noise(history=history, remaining_rounds=remaining,
                                **PLAN)  # type: ignore[arg-type]
        history.append(Segment(plan.noise_multiplier, 0.02, 20))
    assert compose_epsilon(history, delta=DELTA, accountant="pld") <= BUDGET


def test_round_plan_refuses_a_spent_budget_and_bad_arguments() -> None:
    with pytest.raises(ConfigError) as info:
        plan_round_noise(history=[Segment(0.5, 0.5, 500)], remaining_rounds=1,
                         **PLAN)  # type: ignore[arg-type]
    assert info.value.field == "budget_epsilon"
    with pytest.raises(ConfigError) as info:
        plan_round_noise(history=[], remaining_rounds=0, **PLAN)  # type: ignore[arg-type]
    assert info.value.field == "remaining_rounds"
    with pytest.raises(ConfigError) as info:
        plan_round_noise(history=[], remaining_rounds=2, max_epsilon_per_round=-1.0,
                         **PLAN)  # type: ignore[arg-type]
    assert info.value.field == "max_epsilon_per_round"


def test_ddgauss_from_a_round_plan_records_what_the_plan_accounts() -> None:
    """The ledger's DDGauss entry built from `plan_ddgauss` has the plan's own RDP and
    rho (common.privacy.ddgauss), for add/remove and for replacement."""
    import numpy as np

    from common.privacy.ddgauss import plan_ddgauss

    plan = plan_ddgauss(clip=1.0, dim=1000, sigma=0.8, n_noise=3)
    orders = [1.5, 2.0, 4.0, 32.0]
    for replacement in (False, True):
        mechanism = DistributedDiscreteGaussian.from_plan(plan, replacement=replacement)
        assert mechanism.dimension == plan.padded_dim and mechanism.contributors == 3
        assert np.allclose([mechanism.rdp(a) for a in orders],
                           plan.rdp(orders, replacement=replacement), rtol=1e-12)
        assert mechanism.zcdp_rho == pytest.approx(plan.rho(replacement=replacement), rel=1e-12)
        restored = mechanism_from_json_dict(json.loads(mechanisms_to_json([mechanism]))[0])
        assert restored == mechanism
