"""A query's accounting: each block's noise spends its statistic's epsilon, and the
blocks compose on a ledger as dp-accounting composes them."""

from __future__ import annotations

import dp_accounting  # type: ignore[import-untyped]
import pytest
from dp_accounting.pld import PLDAccountant  # type: ignore[import-untyped]
from dp_accounting.rdp import RdpAccountant  # type: ignore[import-untyped]

from common.privacy.accountant import RDP_ORDERS, compose_epsilon
from common.privacy.ddgauss import count_rho, epsilon_from_rho
from common.privacy.mechanisms import DistributedDiscreteGaussian
from common.releases.analytics.vector import block_plans, query_blocks
from common.releases.statistics import calibrate_count_sigma, plan_statistics
from tests.analytics.helpers import every_kind_toml, followup_study, query_epsilon, query_of
from tests.study.helpers import hospital_study

STUDY = followup_study()
DELTA = STUDY.privacy.delta


@pytest.mark.parametrize("n_noise", [1, 2, 5])
def test_each_block_spends_its_own_epsilon(n_noise: int) -> None:
    text = every_kind_toml(STUDY).replace("epsilon = 0.5", "epsilon = 0.3", 2)
    query = query_of(text, STUDY)
    for block, spec in zip(query_blocks(query, study=STUDY, n_noise=n_noise),
                           query.statistics, strict=True):
        rho = count_rho(sigma=block.sigma, n_noise=n_noise, l2_sensitivity=block.l2_sensitivity,
                        length=block.length, l1_sensitivity=block.l1_sensitivity)
        spent = epsilon_from_rho(rho, DELTA)
        assert spent <= spec.epsilon * (1 + 1e-9)
        assert spent == pytest.approx(spec.epsilon, rel=1e-4)  # the smallest such noise


def test_the_statistics_release_plans_as_before_through_the_shared_calibration() -> None:
    study = hospital_study()
    plan = plan_statistics(study, n_noise=2)
    assert calibrate_count_sigma(
        epsilon=study.privacy.statistics_epsilon, delta=study.privacy.delta, n_noise=2,
        length=plan.length, l2_sensitivity=plan.l2_sensitivity,
        l1_sensitivity=plan.l1_sensitivity) == plan.sigma


def test_blocks_compose_on_the_ledger_as_dp_accounting_composes_them() -> None:
    """Every block is a distributed discrete Gaussian whose tau terms vanish at planned
    noise, i.e. rho-zCDP with rho = Delta2^2 / (2 sigma^2); dp-accounting's RDP
    accountant composing ZCDpEvent(rho) per block gives the ledger's epsilon, which is
    below the sum of the statistics' epsilons and never below the PLD epsilon of the
    same blocks taken as continuous Gaussians."""
    query = query_of(every_kind_toml(STUDY), STUDY)
    plans = block_plans(query, study=STUDY, n_noise=2)
    mechanisms = [plan.mechanism() for plan in plans]
    assert all(isinstance(m, DistributedDiscreteGaussian) for m in mechanisms)
    ours = compose_epsilon(mechanisms, delta=DELTA, accountant="rdp")

    reference = RdpAccountant(orders=list(RDP_ORDERS))
    for plan in plans:
        rho = plan.l2_sensitivity**2 / (2 * plan.sigma**2)
        assert plan.mechanism().zcdp_rho == pytest.approx(rho, rel=1e-6)
        reference.compose(dp_accounting.ZCDpEvent(rho))
    assert ours == pytest.approx(float(reference.get_epsilon(DELTA)), rel=0.02)

    pld = PLDAccountant()
    for plan in plans:
        pld.compose(dp_accounting.GaussianDpEvent(plan.sigma / plan.l2_sensitivity))
    assert ours >= float(pld.get_epsilon(DELTA))

    assert ours < query.epsilon  # composition beats the sum of the parts
    # `query_epsilon` (zCDP, converted at every order rather than the ledger's grid of
    # orders) agrees with the ledger to a fraction of a percent.
    assert query_epsilon(query, study=STUDY, n_noise=2) == pytest.approx(ours, rel=0.005)


def test_rerunning_a_query_pays_again() -> None:
    """Two releases of the same query cost more than one: identical mechanisms compose
    (count 2), they are not deduplicated."""
    query = query_of(every_kind_toml(STUDY), STUDY)
    once = [plan.mechanism() for plan in block_plans(query, study=STUDY, n_noise=2)]
    single = compose_epsilon(once, delta=DELTA, accountant="rdp")
    assert compose_epsilon(once + once, delta=DELTA, accountant="rdp") > 1.3 * single
