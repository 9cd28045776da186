"""One-run privacy auditing: an epsilon LOWER bound from canary membership guesses.

Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023
(arXiv:2305.08846). m canaries are each included in the training data independently
with probability 1/2; after ONE training run an attacker guesses "in" or "out" for r
of them (abstaining on the other m - r) and gets v right. Their Theorem 5.2
(approximate DP; Theorem 3.1 is the delta = 0 case) says: if training is
(epsilon, delta)-DP, then for every v

    P[V >= v] <= f(v) + 2 m delta * max_{i = 1..v} (f(v - i) - f(v)) / i,
    f(k) = P[Binomial(r, e^eps / (1 + e^eps)) >= k],

i.e. the number of correct guesses is (up to the delta term) no better than r rounds
of eps-randomized response. `audit_p_value` is that right-hand side; the paper's
Algorithm for the lower bound (its appendix code, `get_eps_audit`) bisects for the
largest epsilon at which the observed v still has p-value < alpha: every epsilon below
the returned bound is rejected at confidence 1 - alpha.

What a lower bound proves and does not (docs/privacy.md "Privacy audit"): a bound
above the claimed epsilon is evidence of a bug in the implementation or in its
accounting; a bound below it proves nothing about the claim, since a weak attack
always yields a small bound. At confidence 95% an honest mechanism still exceeds its
epsilon 5% of the time, by design. The bound cannot exceed what r guesses can show:
with all r guesses right and delta = 0 it is log(q / (1 - q)) for q = alpha^(1/r),
about ln(r / ln(1/alpha)) = ln(r / 3.0) at 95% (the paper's Figure 1 shows this cap).

Choosing r: the paper's experiments take the best of several abstention levels
without correcting for it. We test a FIXED grid of r values chosen before looking at
the scores, each at level alpha / len(grid) (Bonferroni), so the reported maximum
holds at the stated confidence; the price is a cap of ln(r / ln(len(grid)/alpha)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.core.errors import ConfigError

DEFAULT_CONFIDENCE = 0.95
# Fractions of the m canaries the attacker guesses on (the rest it abstains on).
DEFAULT_GUESS_FRACTIONS: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0)
_BISECTION_STEPS = 60
_EPS_CEILING = 1e3


def _check_counts(m: int, r: int, v: int) -> None:
    if not 0 <= v <= r <= m:
        raise ConfigError("canaries", f"need 0 <= correct ({v}) <= guesses ({r}) <= m ({m})")


def _check_delta(delta: float) -> None:
    if not 0.0 <= delta < 1.0:
        raise ConfigError("delta", "must be in [0, 1)")


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ConfigError("confidence", "1 - confidence must be in (0, 1)")


def _binomial_log_pmf(r: int, k: int, log_q: float, log_1mq: float) -> float:
    log_comb = math.lgamma(r + 1) - math.lgamma(k + 1) - math.lgamma(r - k + 1)
    # 0 * log(0) = 0: a certain outcome has pmf 1, not nan.
    head = k * log_q if k else 0.0
    tail = (r - k) * log_1mq if r - k else 0.0
    return log_comb + head + tail


def _binomial_pmfs(r: int, epsilon: float) -> list[float]:
    """P[Binomial(r, e^eps/(1+e^eps)) = k] for k = 0..r, stable for large epsilon."""
    log_q = -math.log1p(math.exp(-epsilon))
    log_1mq = -(epsilon + math.log1p(math.exp(-epsilon)))
    return [math.exp(_binomial_log_pmf(r, k, log_q, log_1mq)) for k in range(r + 1)]


def audit_p_value(*, m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[>= v of r guesses correct] under (epsilon, delta)-DP.

    Steinke, Nasr, Jagielski 2023, Theorem 5.2 (the right-hand side quoted in the
    module docstring), clipped to 1.
    """
    _check_counts(m, r, v)
    _check_delta(delta)
    if not epsilon >= 0:
        raise ConfigError("epsilon", "must be >= 0")
    pmf = _binomial_pmfs(r, epsilon)
    tail = math.fsum(pmf[v:])
    worst = 0.0
    window = 0.0  # f(v - i) - f(v) = P[v - i <= Binomial < v]
    for i in range(1, v + 1):
        window += pmf[v - i]
        worst = max(worst, window / i)
    return min(1.0, tail + 2.0 * m * delta * worst)


def epsilon_lower_bound(
    *, m: int, r: int, v: int, delta: float, alpha: float = 1.0 - DEFAULT_CONFIDENCE
) -> float:
    """Largest epsilon rejected at level `alpha` by v correct out of r guesses.

    Bisection as in the paper's algorithm (the p-value grows with epsilon); the lower
    end is returned, so the bound errs on the sound side. 0 when even epsilon = 0
    explains v (random guessing).
    """
    _check_counts(m, r, v)
    _check_delta(delta)
    _check_alpha(alpha)
    if audit_p_value(m=m, r=r, v=v, epsilon=0.0, delta=delta) >= alpha:
        return 0.0
    low, high = 0.0, 1.0
    while audit_p_value(m=m, r=r, v=v, epsilon=high, delta=delta) < alpha:
        low, high = high, 2.0 * high
        if high > _EPS_CEILING:
            return low
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if audit_p_value(m=m, r=r, v=v, epsilon=middle, delta=delta) < alpha:
            low = middle
        else:
            high = middle
    return low


def guess_grid(m: int, fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS) -> list[int]:
    """The fixed abstention levels: even r = round(f * m), each >= 2, distinct."""
    if m < 2:
        raise ConfigError("canaries", "need at least 2 canaries")
    grid = set()
    for fraction in fractions:
        if not 0.0 < fraction <= 1.0:
            raise ConfigError("guess_fractions", "each must be in (0, 1]")
        grid.add(max(2, 2 * round(fraction * m / 2)))
    return sorted(r for r in grid if r <= m)


@dataclass(frozen=True)
class GuessOutcome:
    """One abstention level of the scan: r guesses (r/2 "in", r/2 "out"), v correct."""

    guesses: int
    correct: int
    epsilon_lower_bound: float


@dataclass(frozen=True)
class AuditResult:
    """The attack's quality and the one-run epsilon lower bound from it."""

    canaries: int
    attack_auc: float
    tpr_at_1pct_fpr: float
    epsilon_lower_bound: float
    best_guesses: int
    confidence: float
    delta: float
    outcomes: tuple[GuessOutcome, ...]


def _check_scores(scores: np.ndarray, included: np.ndarray) -> None:
    if scores.ndim != 1 or scores.shape != included.shape:
        raise ConfigError("scores", "scores and membership must be 1-D and of equal length")
    if not np.all(np.isfinite(scores)):
        raise ConfigError("scores", "membership scores must be finite")
    if included.all() or not included.any():
        raise ConfigError("canaries", "need both included and excluded canaries")


def membership_auc(scores: np.ndarray, included: np.ndarray) -> float:
    """P[score(in) > score(out)] + 0.5 P[tie] (Mann-Whitney), exact."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    _check_scores(scores, included)
    inside, outside = scores[included], np.sort(scores[~included])
    below = np.searchsorted(outside, inside, side="left")
    not_above = np.searchsorted(outside, inside, side="right")
    wins = below.sum() + 0.5 * (not_above - below).sum()
    return float(wins / (inside.size * outside.size))


def tpr_at_fpr(scores: np.ndarray, included: np.ndarray, *, fpr: float = 0.01) -> float:
    """Best true-positive rate of a threshold rule ``score >= t`` whose FPR is <= fpr."""
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    _check_scores(scores, included)
    if not 0.0 <= fpr < 1.0:
        raise ConfigError("fpr", "must be in [0, 1)")
    outside = np.sort(scores[~included])[::-1]
    allowed = math.floor(fpr * outside.size + 1e-9)  # false positives tolerated
    # Any threshold strictly above the (allowed+1)-th largest outside score works.
    limit = outside[allowed] if allowed < outside.size else -np.inf
    return float(np.mean(scores[included] > limit))


def audit_from_scores(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = DEFAULT_CONFIDENCE,
    guess_fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS,
) -> AuditResult:
    """Attack metrics and the scanned one-run lower bound for membership scores.

    Higher score = "more likely in". For each r of the fixed grid the attacker guesses
    "in" for the r/2 highest scores and "out" for the r/2 lowest; each level is tested
    at (1 - confidence) / len(grid), so the maximum over the grid holds at `confidence`.
    Ties in score are broken by a fixed order (canary index), never by membership.
    """
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    _check_scores(scores, included)
    if not 0.0 < confidence < 1.0:
        raise ConfigError("confidence", "must be in (0, 1)")
    m = int(scores.size)
    grid = guess_grid(m, guess_fractions)
    alpha = (1.0 - confidence) / len(grid)
    order = np.argsort(-scores, kind="stable")
    outcomes = []
    for r in grid:
        half = r // 2
        correct = int(included[order[:half]].sum()) + int((~included[order[m - half :]]).sum())
        bound = epsilon_lower_bound(m=m, r=r, v=correct, delta=delta, alpha=alpha)
        outcomes.append(GuessOutcome(guesses=r, correct=correct, epsilon_lower_bound=bound))
    best = max(outcomes, key=lambda o: o.epsilon_lower_bound)
    return AuditResult(
        canaries=m,
        attack_auc=membership_auc(scores, included),
        tpr_at_1pct_fpr=tpr_at_fpr(scores, included, fpr=0.01),
        epsilon_lower_bound=best.epsilon_lower_bound,
        best_guesses=best.guesses,
        confidence=confidence,
        delta=delta,
        outcomes=tuple(outcomes),
    )
