"""One-run audit maths (Steinke, Nasr, Jagielski 2023, Theorem 5.2)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from common.core.errors import ConfigError
from common.privacy.audit import (
    audit_from_scores,
    audit_p_value,
    epsilon_lower_bound,
    guess_grid,
    membership_auc,
    tpr_at_fpr,
)

# (m, r, v, delta) -> bound at 95%, computed independently with mpmath at 50 digits
# (binomial pmfs from exact binomial coefficients, root of p(eps) = 0.05). The
# (1000, 600, 600) case is the example in the paper's appendix code.
PINNED = [
    ((1000, 100, 80, 1e-5), 0.955318534955),
    ((1000, 600, 600, 1e-5), 5.27039946351),
    ((200, 40, 38, 1e-5), 1.73858453571),
    ((500, 50, 45, 0.0), 1.39360412251),
]


def exact_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Theorem 5.2's right-hand side with math.comb: a second, direct implementation."""
    q = math.exp(eps) / (1.0 + math.exp(eps))

    # Each binomial term computed once; every tail adds its terms in the same order.
    terms = [math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(r + 1)]

    def tail(k: int) -> float:
        k = max(k, 0)
        return sum(terms[k:])

    worst = max(((tail(v - i) - tail(v)) / i for i in range(1, v + 1)), default=0.0)
    return min(1.0, tail(v) + 2 * m * delta * worst)


@pytest.mark.parametrize(("args", "expected"), PINNED)
def test_pinned_bounds(args: tuple[int, int, int, float], expected: float) -> None:
    m, r, v, delta = args
    assert epsilon_lower_bound(m=m, r=r, v=v, delta=delta) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(("args", "expected"), PINNED)
def test_bound_is_where_the_exact_p_value_crosses_alpha(
    args: tuple[int, int, int, float], expected: float
) -> None:
    m, r, v, delta = args
    bound = epsilon_lower_bound(m=m, r=r, v=v, delta=delta)
    assert exact_p_value(m, r, v, bound - 1e-6, delta) < 0.05
    assert exact_p_value(m, r, v, bound + 1e-6, delta) >= 0.05


def test_p_value_matches_direct_computation() -> None:
    for m, r, v, eps, delta in [(100, 20, 15, 0.5, 1e-3), (1000, 100, 70, 1.0, 1e-5),
                                (50, 50, 50, 3.0, 0.0), (300, 30, 0, 2.0, 1e-4)]:
        ours = audit_p_value(m=m, r=r, v=v, epsilon=eps, delta=delta)
        assert ours == pytest.approx(exact_p_value(m, r, v, eps, delta), rel=1e-9)


def test_random_guessing_gives_zero() -> None:
    for r in (10, 100, 1000):
        assert epsilon_lower_bound(m=1000, r=r, v=r // 2, delta=1e-5) == 0.0
        assert epsilon_lower_bound(m=1000, r=r, v=0, delta=1e-5) == 0.0


def test_grows_with_accuracy() -> None:
    bounds = [epsilon_lower_bound(m=1000, r=100, v=v, delta=1e-5) for v in range(50, 101, 5)]
    assert all(b2 >= b1 for b1, b2 in itertools.pairwise(bounds))
    assert bounds[-1] > bounds[len(bounds) // 2] > 0


def epsilon_cap(*, r: int, alpha: float = 0.05) -> float:
    """The most r guesses can show (all correct, delta = 0): log(q/(1-q)), q = alpha^(1/r).

    About ln(r / ln(1/alpha)), i.e. ln(r/3) at 95%: the closed form the one-run audit's
    bound (`epsilon_lower_bound`) must reach when every guess is right."""
    log_q = math.log(alpha) / r
    return log_q - math.log(-math.expm1(log_q))


def test_all_correct_is_capped_near_ln_r_over_3() -> None:
    for r in (10, 100, 1000, 10000):
        cap = epsilon_cap(r=r)
        assert epsilon_lower_bound(m=r, r=r, v=r, delta=0.0) == pytest.approx(cap, abs=1e-9)
        # Closed form: q = 0.05^(1/r), eps = log(q / (1 - q)).
        q = 0.05 ** (1 / r)
        assert cap == pytest.approx(math.log(q / (1 - q)), rel=1e-9)
        if r >= 100:  # ln(r / ln 20) is the large-r form of the cap
            assert abs(cap - math.log(r / 3.0)) < 0.02
        # delta > 0 only lowers it.
        assert epsilon_lower_bound(m=r, r=r, v=r, delta=1e-5) <= cap


def test_monotone_in_delta() -> None:
    deltas = [0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3]
    bounds = [epsilon_lower_bound(m=1000, r=200, v=170, delta=d) for d in deltas]
    assert all(b2 <= b1 for b1, b2 in itertools.pairwise(bounds))
    assert bounds[0] > bounds[-1]


def test_validation() -> None:
    with pytest.raises(ConfigError):
        epsilon_lower_bound(m=10, r=11, v=1, delta=1e-5)
    with pytest.raises(ConfigError):
        epsilon_lower_bound(m=10, r=10, v=11, delta=1e-5)
    with pytest.raises(ConfigError):
        epsilon_lower_bound(m=10, r=10, v=5, delta=1.0)
    with pytest.raises(ConfigError):
        audit_p_value(m=10, r=10, v=5, epsilon=-1.0, delta=0.0)


def test_auc_and_tpr() -> None:
    included = np.array([True] * 4 + [False] * 4)
    assert membership_auc(np.arange(8.0)[::-1], included) == 1.0
    assert membership_auc(np.arange(8.0), included) == 0.0
    assert membership_auc(np.zeros(8), included) == 0.5
    scores = np.array([5.0, 4.0, 0.5, 0.2, 3.0, 0.4, 0.3, 0.1])
    # Outside scores 3, .4, .3, .1: a threshold above 3 has FPR 0 and catches 5 and 4.
    assert tpr_at_fpr(scores, included, fpr=0.01) == 0.5
    assert tpr_at_fpr(scores, included, fpr=0.25) == 0.75  # one FP allowed: t above 0.4


def test_scan_is_bonferroni_corrected() -> None:
    rng = np.random.default_rng(0)
    included = rng.random(400) < 0.5
    perfect = np.where(included, 1.0, 0.0) + rng.random(400) * 0.1
    result = audit_from_scores(perfect, included, delta=1e-5)
    grid = guess_grid(400)
    assert [o.guesses for o in result.outcomes] == grid
    # Perfect scores: every level is all-correct except r = m (the classes are unequal).
    assert all(o.correct == o.guesses for o in result.outcomes[:-1])
    alpha = 0.05 / len(grid)
    best = max(result.outcomes, key=lambda o: o.epsilon_lower_bound)
    assert result.epsilon_lower_bound == pytest.approx(
        epsilon_lower_bound(m=400, r=best.guesses, v=best.correct, delta=1e-5, alpha=alpha)
    )
    assert result.attack_auc == 1.0 and result.tpr_at_1pct_fpr == 1.0
    # The correction costs something relative to a single pre-chosen r.
    assert result.epsilon_lower_bound < epsilon_lower_bound(
        m=400, r=best.guesses, v=best.correct, delta=1e-5
    )


def test_random_scores_give_small_bound() -> None:
    rng = np.random.default_rng(1)
    included = rng.random(1000) < 0.5
    result = audit_from_scores(rng.random(1000), included, delta=1e-5)
    assert result.epsilon_lower_bound < 0.3
    assert 0.4 < result.attack_auc < 0.6
