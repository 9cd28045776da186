"""A site's per-round privacy bookkeeping stays flat without changing what is charged.

A 50-round study on a real signed ledger, planned round by round from the ledger
(`plan_training_noise`) with its DP evaluation, the way the site runs it. What each
entry charged is compared with a composition of the same history computed here from
Opacus's own RDP functions (Mironov 2017; Mironov, Talwar & Zhang 2019) and
Proposition 14 of Kairouz, Liu & Steinke 2021, with no memo or cache of the product
involved: it must be equal (within float rounding) and never below."""

from __future__ import annotations

import datetime as dt
import warnings
from pathlib import Path

import numpy as np

from common.core.config import SitePolicySection
from common.privacy import accountant, prv
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import DistributedDiscreteGaussian, Gaussian, Mechanism, Segment
from site_agent import dp_release
from tests.privacy.conftest import Pki

NOW = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
ROUNDS = 50
Q, STEPS, DELTA, BUDGET = 0.02, 50, 1e-5, 8.0


class _ReferenceRdp:
    """The history in RDP, every mechanism's RDP from Opacus's functions, summed in
    order. RDP composes by addition, so the running sum after a prefix of the history is
    the same sum a from-scratch composition of that prefix adds up (term by term, in the
    same order); a mechanism met again reuses its own term, computed here once."""

    def __init__(self) -> None:
        self.orders = list(accountant.RDP_ORDERS)
        self.total = np.zeros(len(self.orders))
        self._terms: dict[Mechanism, np.ndarray] = {}

    def _term(self, m: Mechanism) -> np.ndarray:
        from opacus.accountants.analysis.rdp import compute_rdp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            if isinstance(m, Segment):
                return np.asarray(compute_rdp(
                    q=m.sample_rate, noise_multiplier=m.noise_multiplier, steps=m.steps,
                    orders=self.orders))
            if isinstance(m, Gaussian):
                return np.asarray(compute_rdp(q=1.0, noise_multiplier=m.noise_multiplier,
                                              steps=m.count, orders=self.orders))
            assert isinstance(m, DistributedDiscreteGaussian)
            return m.count * np.array([m.rdp(a) for a in self.orders])

    def add(self, m: Mechanism) -> None:
        if m not in self._terms:
            self._terms[m] = self._term(m)
        self.total += self._terms[m]

    def epsilon(self) -> float:
        from opacus.accountants.analysis.rdp import get_privacy_spent

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            epsilon, _ = get_privacy_spent(orders=self.orders, rdp=list(self.total),
                                           delta=DELTA)
        return float(epsilon)


def test_fifty_round_study_charges_the_exact_composition(
    tmp_path: Path, pki_material: Pki
) -> None:
    accountant.clear_composition_caches()
    ledger = PrivacyLedger(tmp_path / "l.db", site_id="hospital-a", budget_epsilon=BUDGET,
                           delta=DELTA, privacy_unit="patient", signer=pki_material.signer_a)
    ledger.reserve(0, [Gaussian(10.0, 1.0)], now=NOW, purpose="count")
    evaluation = [dp_release.evaluation_mechanism(noise_std=10.0, n_noise=2, bins=20)]
    policy = SitePolicySection(planned_rounds=ROUNDS)
    sigmas = []
    for round_number in range(1, ROUNDS + 1):
        plan = dp_release.plan_training_noise(
            ledger, policy=policy, announced_rounds=ROUNDS, study_rounds=ROUNDS,
            sample_rate=Q, steps_per_round=STEPS, evaluation=evaluation,
        )
        segment = [Segment(plan.noise_multiplier, Q, STEPS)]
        after = ledger.require(round_number, segment, also=[("evaluation", evaluation)])
        ledger.reserve(round_number, segment, now=NOW)
        entry = ledger.reserve(round_number, evaluation, now=NOW, purpose="evaluation")
        assert entry.epsilon_after == after  # the write-ahead charges what it previewed
        sigmas.append(plan.noise_multiplier)

    # One mechanism for the whole study: the segments merge.
    assert len(set(sigmas)) == 1
    entries = ledger.entries()
    assert len(entries) == 1 + 2 * ROUNDS
    # The study spends its budget by its end, never more.
    assert 0.9 * BUDGET <= ledger.spent() <= BUDGET
    history: list[Mechanism] = []
    composed = _ReferenceRdp()
    for index, entry in enumerate(entries):
        history.extend(entry.mechanisms)
        for mechanism in entry.mechanisms:
            composed.add(mechanism)
        if index % 20 == 2 or index == len(entries) - 1:  # from the first evaluation
            reference = composed.epsilon()
            assert entry.accountant_used == "rdp"  # a DDGauss in the history: RDP throughout
            assert entry.epsilon_after >= reference - 1e-12 * reference
            assert abs(entry.epsilon_after - reference) <= 1e-9 * reference
    # And a fresh composition with every cache cleared gives the ledger's last figure.
    accountant.clear_composition_caches()
    assert accountant.compose_epsilon(history, delta=DELTA) == ledger.spent()


def test_prv_plan_keeps_its_sigma_and_charges_a_fresh_composition(
    tmp_path: Path, pki_material: Pki
) -> None:
    """Without evaluation the history stays in PRV (Gopi, Lee & Wutschitz 2021): each
    round re-planned from the ledger keeps the first round's sigma, and the charge is a
    fresh composition of the same history, caches cleared."""
    accountant.clear_composition_caches()
    ledger = PrivacyLedger(tmp_path / "l.db", site_id="hospital-a", budget_epsilon=BUDGET,
                           delta=DELTA, privacy_unit="patient", signer=pki_material.signer_a)
    policy = SitePolicySection(planned_rounds=4)
    sigmas = []
    for round_number in range(1, 5):
        plan = dp_release.plan_training_noise(
            ledger, policy=policy, announced_rounds=4, study_rounds=4, sample_rate=Q,
            steps_per_round=STEPS,
        )
        ledger.reserve(round_number, [Segment(plan.noise_multiplier, Q, STEPS)], now=NOW)
        sigmas.append(plan.noise_multiplier)
    assert len(set(sigmas)) == 1
    assert 0.9 * BUDGET <= ledger.spent() <= BUDGET
    accountant.clear_composition_caches()
    fresh = accountant.account(ledger.history(), delta=DELTA)
    assert fresh.accountant == "prv"
    assert fresh.epsilon == ledger.spent()


def test_prv_is_opacus_own_composition() -> None:
    """The PRV composition (its domain sized from cached RDP curves) is Opacus's: the
    epsilon is Opacus's own PRVAccountant's on the same history (Gopi, Lee & Wutschitz
    2021), never below it and above it by at most the accountant's allowance."""
    from opacus.accountants import PRVAccountant

    histories = [
        [(1.3, Q, STEPS * 7), (10.0, 1.0, 1)],
        [(0.9, 0.05, 40), (1.7, Q, 120), (25.0, 1.0, 2)],
    ]
    for history in histories:
        accountant.clear_composition_caches()
        mechanisms: list[Mechanism] = [
            Gaussian(sigma, 1.0, steps) if q == 1.0 else Segment(sigma, q, steps)
            for sigma, q, steps in history
        ]
        ours = accountant.account(mechanisms, delta=DELTA)
        theirs = PRVAccountant()
        theirs.history = sorted(history)
        with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
            warnings.simplefilter("ignore", UserWarning)
            expected = float(theirs.get_epsilon(DELTA, eps_error=accountant.PRV_EPS_ERROR))
        assert ours.accountant == "prv"
        assert expected <= ours.epsilon <= expected * (1 + 2 * prv.PRV_ROUNDING_RELATIVE)
