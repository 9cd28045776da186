"""The accountant's own RDP and PRV (numpy/scipy, no torch) against Opacus's.

Opacus is imported here only, as the reference: its `compute_rdp` / `get_privacy_spent`
(Mironov, Talwar & Zhang 2019; Balle et al. 2020) and its `PRVAccountant` (Gopi, Lee &
Wutschitz 2021). Ours must agree to tight tolerance and never report less: the
accountant is an upper bound, so a figure below the reference would be a leak."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from common.privacy import accountant, prv, rdp
from common.privacy.mechanisms import Gaussian, Mechanism, Segment

SIGMAS = (0.5, 0.8, 1.0, 1.3, 2.5, 10.0)
RATES = (1e-4, 0.01, 0.05, 0.3, 1.0)
DELTAS = (1e-5, 1e-8)

# RDP one-step curves: relative, plus absolute for figures near zero (tiny q).
RDP_RELATIVE, RDP_ABSOLUTE = 1e-9, 1e-11
# Epsilons: PRV figures carry a rounding allowance of 1e-7 relative (the two
# implementations' own rounding differs by ~1e-8); RDP ones 1e-10 relative plus 1e-12
# per step. Both below the ledger's recomposition tolerance (1e-6), so ledgers written
# with Opacus's figures still verify.
EPSILON_RELATIVE = 2e-7
RDP_EPSILON_RELATIVE = 1e-7


def _opacus_rdp(q: float, sigma: float, steps: int, orders: tuple[float, ...]) -> np.ndarray:
    from opacus.accountants.analysis.rdp import compute_rdp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=steps,
                                      orders=list(orders)), dtype=np.float64)


def _opacus_rdp_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    from opacus.accountants.analysis.rdp import get_privacy_spent

    total = sum(_opacus_rdp(q, sigma, steps, accountant.RDP_ORDERS)
                for sigma, q, steps in history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        epsilon, _ = get_privacy_spent(orders=list(accountant.RDP_ORDERS), rdp=list(total),
                                       delta=delta)
    return float(epsilon)


def _opacus_prv_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    from opacus.accountants import PRVAccountant

    reference = PRVAccountant()
    reference.history = sorted(history)  # the accountant's canonical order
    with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
        warnings.simplefilter("ignore", UserWarning)
        return float(reference.get_epsilon(delta, eps_error=accountant.PRV_EPS_ERROR))


def _mechanisms(history: list[tuple[float, float, int]]) -> list[Mechanism]:
    return [Gaussian(sigma, 1.0, steps) if q == 1.0 else Segment(sigma, q, steps)
            for sigma, q, steps in history]


@pytest.mark.parametrize(("sigma", "q"), list(itertools.product(SIGMAS, RATES)))
def test_one_step_rdp_curve_matches_opacus_and_never_falls_below(sigma: float,
                                                                  q: float) -> None:
    for orders in (accountant.RDP_ORDERS, prv.PRV_RDP_ORDERS):
        ours = rdp.sampled_gaussian_rdp(q=q, sigma=sigma, orders=orders)
        theirs = _opacus_rdp(q, sigma, 1, orders)
        assert np.array_equal(np.isfinite(ours), np.isfinite(theirs))
        finite = np.isfinite(theirs)
        assert (ours[finite] >= theirs[finite]).all()
        assert np.allclose(ours[finite], theirs[finite], rtol=RDP_RELATIVE, atol=RDP_ABSOLUTE)


def test_rdp_to_epsilon_conversion_is_balle_et_al_as_opacus() -> None:
    from opacus.accountants.analysis.rdp import get_privacy_spent

    orders = accountant.RDP_ORDERS
    curve = rdp.sampled_gaussian_rdp(q=0.02, sigma=1.1, orders=orders) * 700
    for delta in DELTAS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            expected = get_privacy_spent(orders=list(orders), rdp=list(curve), delta=delta)
        assert rdp.epsilon_from_rdp(orders=orders, rdp=curve, delta=delta) == (
            pytest.approx(float(expected[0]), rel=1e-14), float(expected[1]))


# Single mechanisms over a (sigma, q, steps) grid and mixed histories (DP-SGD at several
# rates and sigmas, plain Gaussian releases), as a site's ledger holds them.
SINGLE = [
    [(sigma, q, steps)]
    for sigma, q, steps in [
        (0.6, 0.01, 1000), (0.8, 0.02, 250), (1.0, 0.02, 2500), (1.3, 0.05, 40),
        (0.5, 0.3, 10), (0.9, 0.2, 30), (4.0, 0.5, 10), (2.0, 1.0, 5), (25.0, 1.0, 1),
        (1.1, 0.001, 3000),
    ]
]
MIXED = [
    [(1.3, 0.02, 350), (10.0, 1.0, 1)],
    [(0.9, 0.05, 40), (1.7, 0.02, 120), (25.0, 1.0, 2)],
    [(0.8, 0.001, 4000), (1.1, 0.02, 400), (5.0, 1.0, 3)],
    [(0.6, 0.01, 300), (0.8, 0.01, 300), (2.0, 1.0, 1), (1.0, 0.05, 10)],
]


@pytest.mark.parametrize("history", SINGLE + MIXED, ids=str)
def test_rdp_epsilon_matches_opacus_and_never_falls_below(
    history: list[tuple[float, float, int]]
) -> None:
    for delta in DELTAS:
        accountant.clear_composition_caches()
        ours = accountant.account(_mechanisms(history), delta=delta, accountant="rdp")
        theirs = _opacus_rdp_epsilon(history, delta)
        assert ours.accountant == "rdp"
        assert theirs <= ours.epsilon <= theirs * (1 + RDP_EPSILON_RELATIVE)


@pytest.mark.parametrize("history", SINGLE + MIXED, ids=str)
def test_prv_epsilon_matches_opacus_and_never_falls_below(
    history: list[tuple[float, float, int]]
) -> None:
    for delta in DELTAS:
        accountant.clear_composition_caches()
        ours = accountant.account(_mechanisms(history), delta=delta)
        theirs = _opacus_prv_epsilon(history, delta)
        assert ours.accountant == "prv" and not ours.fell_back
        assert theirs <= ours.epsilon <= theirs * (1 + EPSILON_RELATIVE)
