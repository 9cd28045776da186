"""Epsilon of a site's WHOLE history of DP mechanisms, composed in one accountant call.

A site's ledger records mechanisms (`common.privacy.mechanisms`): DP-SGD's
Poisson-subsampled Gaussian (`Segment` = `SampledGaussian`), plain Gaussian releases
(`Gaussian`) and the distributed discrete Gaussian (`DistributedDiscreteGaussian`).
Privacy loss across rounds is obtained by composing the whole history in one call,
never by summing per-round epsilons (basic composition, far too pessimistic).

Accountants:

* ``"prv"`` (default): numerical composition of privacy-loss random variables, Gopi,
  Lee & Wutschitz, "Numerical Composition of Differential Privacy", NeurIPS 2021
  (`common.privacy.prv`; the same figures as Opacus's PRVAccountant). The value
  returned is the *upper* bound (estimate + ``eps_error``).
* ``"pld"``: Google's dp_accounting privacy-loss distributions (Koskela et al. 2020;
  Doroshenko et al., "Connect the Dots", PETS 2022), pessimistic discretisation, so an
  upper bound too. Composes heterogeneous Gaussian and sampled-Gaussian events.
* ``"rdp"``: Renyi DP, Mironov, CSF 2017, with the sampled-Gaussian RDP of Mironov,
  Talwar & Zhang 2019 (`common.privacy.rdp`), converted with Balle et al. 2020. Looser,
  always usable.

PRV and RDP are computed here with numpy/scipy alone: a process that only reports an
epsilon never imports torch or Opacus.

PLD/PRV express only (sampled) Gaussians. A history containing a distributed discrete
Gaussian (a zCDP/RDP guarantee, Kairouz, Liu & Steinke, ICML 2021, Proposition 14) is
composed entirely in RDP, and the report says so. Whenever PLD/PRV fails (a mesh too
large for this machine, a numerical error), RDP is used instead, flagged: RDP is a valid
(larger) upper bound, so a fallback never under-reports. Deterministic: same history,
same epsilon.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.core.errors import ConfigError
from common.privacy import prv
from common.privacy.mechanisms import (
    MECHANISM_TYPES,
    DistributedDiscreteGaussian,
    Gaussian,
    Mechanism,
    SampledGaussian,
    Segment,
)
from common.privacy.rdp import epsilon_from_rdp, sampled_gaussian_rdp

ACCOUNTANTS = ("prv", "pld", "rdp")

# dp_accounting PLD discretisation of the privacy loss (pessimistic rounding: an upper
# bound whatever the interval). 1e-3 is within ~1e-3 of 1e-4 on typical DP-SGD
# histories and about ten times faster.
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3

__all__ = [
    "ACCOUNTANTS",
    "DistributedDiscreteGaussian",
    "EpsilonReport",
    "Gaussian",
    "Mechanism",
    "RoundNoisePlan",
    "SampledGaussian",
    "Segment",
    "account",
    "clear_composition_caches",
    "compose_epsilon",
    "epsilon_added",
    "epsilon_after",
    "plan_noise_multiplier",
    "plan_round_noise",
]

# Opacus's default RDP orders plus larger ones: for small epsilons (lots of noise) the
# optimal order is above 63 and Opacus would warn and return a looser bound.
RDP_ORDERS: tuple[float, ...] = (
    *(1 + x / 10.0 for x in range(1, 100)),
    *(float(a) for a in range(12, 64)),
    64.0,
    80.0,
    96.0,
    128.0,
    192.0,
    256.0,
    512.0,
    1024.0,
)

# Largest PRV discretisation mesh we accept (points). Each point costs a few float64 /
# complex128 array cells during the FFT convolution; 4M points stay well under 1 GiB.
MAX_PRV_DOMAIN_POINTS = 4_000_000

# PRV error parameter (the reference implementation's default), fixed here so a change
# of default elsewhere cannot silently change a ledger's recomputed epsilons.
PRV_EPS_ERROR = 0.01

# First step of the sigma search, from one evaluation: epsilon ~ sigma^(-exponent). For
# DP-SGD the local exponent runs from about 1 (much noise) to over 2 (little); 1.5 lands
# near the answer from either side, and the secant takes over after it.
FIRST_STEP_EXPONENT = 1.5

# Opacus's bound on the noise-multiplier search (opacus.accountants.utils.MAX_SIGMA).
MAX_NOISE_MULTIPLIER = 1e6


@dataclass(frozen=True)
class EpsilonReport:
    """Result of one composition: which accountant actually produced `epsilon`.

    `accountant` is the one used; when PRV could not be used it is ``"rdp"``,
    `requested_accountant` stays ``"prv"`` and `fallback_reason` says why.
    """

    epsilon: float
    delta: float
    accountant: str
    requested_accountant: str = ""
    fallback_reason: str | None = None

    @property
    def fell_back(self) -> bool:
        return self.fallback_reason is not None


def _check_delta(delta: float) -> None:
    if isinstance(delta, bool) or not isinstance(delta, int | float):
        raise ConfigError("delta", f"must be a number, got {delta!r}")
    if not (math.isfinite(delta) and 0 < delta < 1):
        raise ConfigError("delta", f"must be in (0, 1), got {delta!r}")


def _check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ConfigError("accountant", f"must be one of {ACCOUNTANTS}, got {accountant!r}")


@dataclass(frozen=True)
class CanonicalHistory:
    """A history merged per identical mechanism (composition is commutative): Gaussian-
    type events as (noise multiplier, sample rate, count), DDGauss releases with counts."""

    gaussians: tuple[tuple[float, float, int], ...]
    ddgauss: tuple[DistributedDiscreteGaussian, ...]

    def __bool__(self) -> bool:
        return bool(self.gaussians or self.ddgauss)


def canonical_mechanisms(mechanisms: Iterable[Mechanism]) -> CanonicalHistory:
    """Merge equal mechanisms wherever they occur, drop empty ones, sort.

    Merging is exact (composition is commutative), keeps the accountant fast, and makes
    the result independent of history order, hence reproducible by `verify`. A Gaussian
    of noise multiplier m is the sampled Gaussian with q = 1 (one "step" per release).
    """
    steps_by_mechanism: dict[tuple[float, float], int] = {}
    ddgauss_counts: dict[DistributedDiscreteGaussian, int] = {}
    for mechanism in mechanisms:
        if not isinstance(mechanism, MECHANISM_TYPES):
            raise ConfigError(
                "mechanisms", f"expected a mechanism, got {type(mechanism).__name__}"
            )
        if isinstance(mechanism, Segment):
            if mechanism.steps == 0:
                continue
            key = (mechanism.noise_multiplier, mechanism.sample_rate)
            steps_by_mechanism[key] = steps_by_mechanism.get(key, 0) + mechanism.steps
        elif isinstance(mechanism, Gaussian):
            key = (mechanism.noise_multiplier, 1.0)
            steps_by_mechanism[key] = steps_by_mechanism.get(key, 0) + mechanism.count
        else:
            single = DistributedDiscreteGaussian(
                noise_variance_per_site=mechanism.noise_variance_per_site,
                contributors=mechanism.contributors,
                l2_sensitivity=mechanism.l2_sensitivity,
                dimension=mechanism.dimension,
                l1_sensitivity=mechanism.l1_sensitivity,
            )
            ddgauss_counts[single] = ddgauss_counts.get(single, 0) + mechanism.count
    gaussians = tuple(
        (sigma, q, steps) for (sigma, q), steps in sorted(steps_by_mechanism.items())
    )
    ddgauss = tuple(
        DistributedDiscreteGaussian(
            noise_variance_per_site=m.noise_variance_per_site,
            contributors=m.contributors,
            l2_sensitivity=m.l2_sensitivity,
            dimension=m.dimension,
            l1_sensitivity=m.l1_sensitivity,
            count=count,
        )
        for m, count in sorted(
            ddgauss_counts.items(),
            key=lambda item: repr(sorted(item[0].to_json_dict().items(), key=str)),
        )
    )
    return CanonicalHistory(gaussians, ddgauss)


def _prv_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Gopi, Lee & Wutschitz 2021 upper bound (`common.privacy.prv`), refusing meshes
    larger than MAX_PRV_DOMAIN_POINTS."""
    return prv.prv_epsilon(history, delta=delta, eps_error=PRV_EPS_ERROR,
                           max_points=MAX_PRV_DOMAIN_POINTS)


@functools.lru_cache(maxsize=1024)
def _sampled_gaussian_rdp_step(sigma: float, q: float) -> np.ndarray:
    """RDP of ONE step of the Poisson-subsampled Gaussian at every order of RDP_ORDERS
    (Mironov, Talwar & Zhang 2019; `common.privacy.rdp`), read-only.

    RDP composes additively (Mironov, CSF 2017, Proposition 1), so `steps` steps cost
    `steps * curve`. Cached per (sigma, q): a site's history repeats a handful of
    mechanisms, and the series per order is what an RDP composition spends its time on."""
    curve = sampled_gaussian_rdp(q=q, sigma=sigma, orders=RDP_ORDERS)
    curve.setflags(write=False)
    return curve


def _rdp_epsilon(history: CanonicalHistory, delta: float) -> float:
    """RDP of the whole history on RDP_ORDERS, converted once to (epsilon, delta)
    (Balle et al. 2020, Theorem 21).

    Sampled Gaussians: Mironov, Talwar & Zhang 2019 (`common.privacy.rdp`, the same
    figures as Opacus's RDPAccountant); each DDGauss release adds Proposition 14's RDP at
    every order (Kairouz, Liu & Steinke 2021)."""
    orders = np.array(RDP_ORDERS, dtype=np.float64)
    total = np.zeros_like(orders)
    for sigma, q, steps in history.gaussians:
        total += _sampled_gaussian_rdp_step(sigma, q) * steps
    for mechanism in history.ddgauss:
        total += mechanism.count * np.array([mechanism.rdp(float(a)) for a in orders])
    epsilon, _ = epsilon_from_rdp(orders=RDP_ORDERS, rdp=total, delta=delta)
    return float(epsilon)


def _pld_epsilon(history: CanonicalHistory, delta: float) -> float:
    """dp_accounting's PLD accountant over Poisson-sampled / plain Gaussian events."""
    # dp_accounting: loaded only when a history is composed with the "pld" accountant
    import dp_accounting  # type: ignore[import-untyped]
    from dp_accounting.pld import PLDAccountant  # type: ignore[import-untyped]

    accountant = PLDAccountant(value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
    events: list[Any] = []
    for sigma, q, steps in history.gaussians:
        gaussian = dp_accounting.GaussianDpEvent(sigma)
        event = gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
        events.append(dp_accounting.SelfComposedDpEvent(event, steps))
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    return float(accountant.get_epsilon(delta))


# Compositions by (canonical history, delta, accountant). Every accountant here is a
# deterministic function of the canonical history (the same history always gives the
# same epsilon, which is what lets `verify` recompose a ledger), so a memoised report is
# exactly the one a fresh composition would return. Within a round the site composes the
# same histories several times: the plan's round epsilon (ledger + round + evaluation)
# is the write-ahead check's `preview` and the evaluation `reserve`, and the plan's
# whole-study epsilon is the next round's. The memo makes each of those one composition.
_REPORT_CACHE_SIZE = 256
_REPORTS: OrderedDict[tuple[Any, ...], EpsilonReport] = OrderedDict()
_REPORTS_LOCK = threading.Lock()


def account(
    mechanisms: Sequence[Mechanism], *, delta: float, accountant: str = "prv"
) -> EpsilonReport:
    """(epsilon, delta) of the composition of ALL `mechanisms`, with provenance.

    `accountant` is the one requested; the report's `accountant` is the one used (RDP
    when the history holds a zCDP mechanism or PLD/PRV failed, with the reason).
    Memoised per canonical history (exact: the composition is deterministic)."""
    _check_delta(delta)
    _check_accountant(accountant)
    history = canonical_mechanisms(mechanisms)
    key = (history, float(delta), accountant)
    with _REPORTS_LOCK:
        cached = _REPORTS.get(key)
        if cached is not None:
            _REPORTS.move_to_end(key)
            return cached
    report, deterministic = _account(history, delta=float(delta), accountant=accountant)
    if not deterministic:
        return report  # a fallback after a failure (memory, say) may not recur: not kept
    with _REPORTS_LOCK:
        _REPORTS[key] = report
        while len(_REPORTS) > _REPORT_CACHE_SIZE:
            _REPORTS.popitem(last=False)
    return report


def clear_composition_caches() -> None:
    """Forget every memoised composition, RDP curve and round plan (for benchmarks
    timing the uncached path, and tests composing from scratch)."""
    with _REPORTS_LOCK:
        _REPORTS.clear()
    with _ROUND_PLANS_LOCK:
        _ROUND_PLANS.clear()
    _sampled_gaussian_rdp_step.cache_clear()
    prv.clear_caches()


def _account(
    history: CanonicalHistory, *, delta: float, accountant: str
) -> tuple[EpsilonReport, bool]:
    """The report, and whether it is a function of the history alone (memoisable)."""
    if not history:
        return EpsilonReport(0.0, float(delta), accountant, accountant), True
    if accountant == "rdp":
        return EpsilonReport(_rdp_epsilon(history, delta), float(delta), "rdp", "rdp"), True
    if history.ddgauss:
        reason = (
            "history contains a distributed discrete Gaussian (a zCDP guarantee, Kairouz "
            f"et al. 2021) that {accountant.upper()} cannot express; whole history "
            "composed in RDP"
        )
        report = EpsilonReport(_rdp_epsilon(history, delta), float(delta), "rdp", accountant,
                               reason)
        return report, True
    try:
        if accountant == "prv":
            epsilon = _prv_epsilon(list(history.gaussians), delta)
        else:
            epsilon = _pld_epsilon(history, delta)
        if not math.isfinite(epsilon) or epsilon < 0:
            raise ArithmeticError(f"{accountant.upper()} returned {epsilon!r}")
    except (prv.PrvDomainTooLarge, ArithmeticError, ValueError, MemoryError, RuntimeError) as exc:
        # RDP upper-bounds the true epsilon too, so falling back never under-reports.
        reason = (
            f"{accountant.upper()} accountant unusable for this history ({exc}); RDP bound used"
        )
        report = EpsilonReport(_rdp_epsilon(history, delta), float(delta), "rdp", accountant,
                               reason)
        # The mesh-size refusal is a function of the history; other failures may not be.
        return report, isinstance(exc, prv.PrvDomainTooLarge)
    return EpsilonReport(epsilon, float(delta), accountant, accountant), True


def compose_epsilon(
    mechanisms: Sequence[Mechanism], *, delta: float, accountant: str = "prv"
) -> float:
    """Epsilon after the whole history `mechanisms` (see `account` for provenance)."""
    return account(mechanisms, delta=delta, accountant=accountant).epsilon


def epsilon_after(
    history: Sequence[Mechanism],
    new_segment: Mechanism | Sequence[Mechanism],
    *,
    delta: float,
    accountant: str = "prv",
) -> float:
    """Epsilon the site would have spent after adding `new_segment` to `history`."""
    extra = [new_segment] if isinstance(new_segment, MECHANISM_TYPES) else list(new_segment)
    return compose_epsilon([*history, *extra], delta=delta, accountant=accountant)


def epsilon_added(
    history: Sequence[Mechanism],
    new: Mechanism | Sequence[Mechanism],
    *,
    delta: float,
    accountant: str = "prv",
) -> float:
    """What `new` adds to the site's spend: eps(history + new) - eps(history), both
    composed over the whole history (never a per-release epsilon summed). The measure of
    the per-round cap, `max_epsilon_per_round`, for every release a site makes in one
    round: a training round's plan (`plan_round_noise`), a hospital round, a query or
    other round release."""
    after = epsilon_after(history, new, delta=delta, accountant=accountant)
    before = compose_epsilon(history, delta=delta, accountant=accountant) if history else 0.0
    return after - before


def plan_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
) -> float:
    """Smallest noise multiplier (within tolerance) whose whole planned schedule meets
    `target_epsilon`: calibrated once for rounds x local steps, not per round.

    The returned sigma satisfies ``compose_epsilon([Segment(sigma, q, steps)]) <=
    target_epsilon`` with the same accountant.
    """
    _check_delta(delta)
    _check_accountant(accountant)
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ConfigError("target_epsilon", f"must be finite and > 0, got {target_epsilon!r}")
    if not (math.isfinite(epsilon_tolerance) and 0 < epsilon_tolerance < target_epsilon):
        raise ConfigError("epsilon_tolerance", "must be > 0 and below target_epsilon")
    probe = Segment(1.0, sample_rate, steps)  # validates sample_rate and steps
    if steps == 0:
        raise ConfigError("steps", "must be > 0 to plan a noise multiplier")

    def spent(sigma: float) -> float:
        segment = Segment(sigma, probe.sample_rate, steps)
        return compose_epsilon([segment], delta=delta, accountant=accountant)

    # Evaluated with OUR guarded accountant (Opacus's own search can build a PRV mesh of
    # many GiB for small sigmas), so the planned sigma meets the target with exactly the
    # accounting the ledger will later apply.
    return _smallest_sigma(spent, target_epsilon, epsilon_tolerance)


@dataclass(frozen=True)
class RoundNoisePlan:
    """What `plan_round_noise` chose and why (all epsilons composed, never summed)."""

    noise_multiplier: float
    epsilon_spent: float  # eps(ledger)
    epsilon_after_round: float  # eps(ledger + this round)
    epsilon_after_plan: float  # eps(ledger + every remaining round)
    round_epsilon: float  # eps(ledger + round) - eps(ledger)
    binding: str  # "budget" or "max_epsilon_per_round"


# Plans by (canonical history, budget, delta, q, steps, rounds, cap, accountant,
# tolerance): a site re-plans the same round (announcement, restart, retry) from the
# same ledger, and the composition is deterministic, so the answer is the same.
_ROUND_PLAN_CACHE_SIZE = 64
_ROUND_PLANS: OrderedDict[tuple[Any, ...], RoundNoisePlan] = OrderedDict()
_ROUND_PLANS_LOCK = threading.Lock()


def plan_round_noise(
    *,
    history: Sequence[Mechanism],
    budget_epsilon: float,
    delta: float,
    sample_rate: float,
    steps_per_round: int,
    remaining_rounds: int,
    max_epsilon_per_round: float | None = None,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
    per_round: Sequence[Mechanism] = (),
    reserved: Sequence[Mechanism] = (),
    warm_start: bool = True,
) -> RoundNoisePlan:
    """Noise multiplier for the next round, planned by the SITE from its own ledger.

    `per_round`: what every planned round releases besides its training (its DP
    evaluation histogram); `reserved`: releases still to come outside those rounds (the
    final evaluation-only round). Both are composed into the plan, so the last planned
    round still fits the budget with its evaluation (without them, a site planning
    exactly the rounds it runs found its last round over budget and declined it).

    Two constraints, both on composed epsilons: the whole remaining plan fits the budget,
    eps(history + remaining_rounds rounds) <= budget_epsilon, and this round costs at most
    the cap, eps(history + round) - eps(history) <= max_epsilon_per_round. Epsilon falls
    as sigma grows, so the smallest sigma meeting both is found by bisection on each and
    the larger one kept. `remaining_rounds` is the site's policy, not an announcement:
    nothing a coordinator says can make a round cost more than the cap.

    `warm_start`: the budget search starts at the sigma of the history's last DP-SGD
    segment at this sample rate. Any sigma the search returns meets both constraints
    (its epsilon within `epsilon_tolerance` below the target, as evaluated), so where
    to start changes the cost, not the guarantee. After a round planned at sigma, the
    plan's history (ledger + round + the rounds left) is the previous plan's history
    again, so the previous sigma still meets the budget with the same epsilon and is
    kept after one composition: every round of a study then releases the same
    mechanism, its segments merge and the ledger's compositions stay as cheap as the
    first round's. The cap is only searched when the chosen sigma breaks it (epsilon
    falls as sigma grows, so a sigma within the cap is at least the cap's smallest).
    """
    _check_delta(delta)
    _check_accountant(accountant)
    if not (math.isfinite(budget_epsilon) and budget_epsilon > 0):
        raise ConfigError("budget_epsilon", f"must be finite and > 0, got {budget_epsilon!r}")
    if isinstance(remaining_rounds, bool) or not isinstance(remaining_rounds, int):
        raise ConfigError("remaining_rounds", f"must be an integer, got {remaining_rounds!r}")
    if remaining_rounds < 1:
        raise ConfigError("remaining_rounds", f"must be >= 1, got {remaining_rounds}")
    if max_epsilon_per_round is not None and not (
        math.isfinite(max_epsilon_per_round) and max_epsilon_per_round > 0
    ):
        raise ConfigError(
            "max_epsilon_per_round", f"must be finite and > 0, got {max_epsilon_per_round!r}"
        )
    if not (math.isfinite(epsilon_tolerance) and epsilon_tolerance > 0):
        raise ConfigError("epsilon_tolerance", "must be finite and > 0")
    probe = Segment(1.0, sample_rate, steps_per_round)  # validates rate and steps
    if steps_per_round == 0:
        raise ConfigError("steps_per_round", "must be > 0 to plan a noise multiplier")
    past = list(history)
    extra, later = list(per_round), list(reserved)
    key = (canonical_mechanisms(past), float(budget_epsilon), float(delta),
           probe.sample_rate, steps_per_round, remaining_rounds, max_epsilon_per_round,
           accountant, float(epsilon_tolerance), canonical_mechanisms(extra),
           canonical_mechanisms(later), warm_start)
    with _ROUND_PLANS_LOCK:
        cached = _ROUND_PLANS.get(key)
        if cached is not None:
            _ROUND_PLANS.move_to_end(key)
            return cached
    spent = compose_epsilon(past, delta=delta, accountant=accountant)
    if budget_epsilon - spent <= epsilon_tolerance:
        raise ConfigError(
            "budget_epsilon",
            f"{spent:.4f} of {budget_epsilon:g} already spent: no round fits the budget",
        )

    # Compositions are deterministic: evaluate each sigma once (the final report reuses
    # the searches' evaluations).
    plan_epsilons: dict[float, float] = {}
    round_epsilons: dict[float, float] = {}

    def plan_epsilon(sigma: float) -> float:
        if sigma not in plan_epsilons:
            rounds = [Segment(sigma, probe.sample_rate, steps_per_round)] * remaining_rounds
            plan_epsilons[sigma] = compose_epsilon(
                [*past, *rounds, *(extra * remaining_rounds), *later], delta=delta,
                accountant=accountant,
            )
        return plan_epsilons[sigma]

    def round_epsilon(sigma: float) -> float:
        if sigma not in round_epsilons:
            segment = Segment(sigma, probe.sample_rate, steps_per_round)
            round_epsilons[sigma] = (
                compose_epsilon([*past, segment, *extra], delta=delta, accountant=accountant)
                - spent
            )
        return round_epsilons[sigma]

    start = _last_sigma(past, sample_rate=probe.sample_rate) if warm_start else None
    sigma = _smallest_sigma(plan_epsilon, budget_epsilon, epsilon_tolerance,
                            start=1.0 if start is None else start)
    binding = "budget"
    if max_epsilon_per_round is not None and (
        not warm_start or round_epsilon(sigma) > max_epsilon_per_round
    ):
        # The budget's sigma is a good first guess: the cap usually binds near it.
        capped = _smallest_sigma(
            round_epsilon, max_epsilon_per_round, epsilon_tolerance, start=sigma
        )
        if capped > sigma:
            sigma, binding = capped, "max_epsilon_per_round"
    after_round = spent + round_epsilon(sigma)
    plan = RoundNoisePlan(
        noise_multiplier=sigma,
        epsilon_spent=spent,
        epsilon_after_round=after_round,
        epsilon_after_plan=plan_epsilon(sigma),
        round_epsilon=after_round - spent,
        binding=binding,
    )
    with _ROUND_PLANS_LOCK:
        _ROUND_PLANS[key] = plan
        while len(_ROUND_PLANS) > _ROUND_PLAN_CACHE_SIZE:
            _ROUND_PLANS.popitem(last=False)
    return plan


def _last_sigma(history: Sequence[Mechanism], *, sample_rate: float) -> float | None:
    """Noise multiplier of the last DP-SGD segment at `sample_rate` in `history`."""
    for mechanism in reversed(history):
        if (isinstance(mechanism, Segment) and mechanism.steps > 0
                and mechanism.sample_rate == sample_rate):
            return float(mechanism.noise_multiplier)
    return None


def _smallest_sigma(
    epsilon_of: Callable[[float], float], target: float, tolerance: float, *, start: float = 1.0
) -> float:
    """Smallest sigma (within `tolerance` on epsilon) with epsilon_of(sigma) <= target;
    epsilon_of must fall as sigma grows.

    Every evaluation is a full composition, seconds for PRV on a loaded machine, so the
    search is a safeguarded secant in (log sigma, log epsilon) through the last two
    evaluations, aimed just below the target (epsilon falls roughly as a power of sigma,
    so this converges in a handful of evaluations where bisection took 15 to 25). It
    keeps a bracket, low with epsilon > target and high with epsilon <= target, and
    bisects whenever the secant would leave it or stalls. The answer is a sigma whose
    epsilon WAS evaluated with `epsilon_of` and met the target, never an extrapolation.
    """
    aim = target - tolerance / 2
    low, high = 0.0, math.inf  # epsilon(low) > target >= epsilon(high)
    points: list[tuple[float, float]] = []
    sigma, slow_steps = start, 0
    while True:
        if sigma > MAX_NOISE_MULTIPLIER:
            raise ConfigError("target_epsilon", "unreachable with any noise multiplier")
        epsilon = epsilon_of(sigma)
        width = high - low
        if epsilon <= target:
            high = sigma
            if target - epsilon <= tolerance:
                return high
        else:
            low = sigma
        if math.isfinite(high) and high - low <= 1e-6 * max(high, 1.0):
            return high  # the tolerance cannot be met more closely; high meets the target
        # Bisect after four evaluations in a row that did not halve the bracket.
        slow_steps = slow_steps + 1 if not high - low <= width / 2 else 0
        points = [*points[-1:], (sigma, epsilon)]
        sigma = _next_sigma(points, aim, low=low, high=high, bisect=slow_steps >= 4)
        if slow_steps >= 4:
            slow_steps = 0


def _next_sigma(
    points: list[tuple[float, float]], aim: float, *, low: float, high: float, bisect: bool
) -> float:
    """The next sigma `_smallest_sigma` tries: the log-log secant through the last two
    evaluations (one evaluation: epsilon ~ sigma^-1.5, a step of at most 8x), kept strictly
    inside the bracket; the bracket's middle when that fails."""
    sigma, epsilon = points[-1]
    tiny = 1e-300
    if len(points) == 1 or not math.isfinite(points[0][1]):
        ratio = max(epsilon, tiny) / aim if math.isfinite(epsilon) else 8.0
        step = float(ratio ** (1 / FIRST_STEP_EXPONENT))
        guess = sigma * min(max(step, 1 / 8), 8.0)
    else:
        (s0, e0), (s1, e1) = points
        slope = (math.log(max(e1, tiny)) - math.log(max(e0, tiny))) / (
            math.log(s1) - math.log(s0)
        )
        if not (math.isfinite(slope) and slope < 0):
            bisect = True
            guess = sigma
        else:
            # A step of at most 8x either way; clamped before exp, which overflows where
            # epsilon barely falls (a history that alone exceeds the target).
            exponent = (math.log(aim) - math.log(max(e1, tiny))) / slope
            guess = s1 * math.exp(min(max(exponent, -math.log(8)), math.log(8)))
    if not math.isfinite(high):
        return guess if guess > low else low * 2
    if bisect:
        return (low + high) / 2
    margin = (high - low) / 50
    if not low + margin <= guess <= high - margin:
        # Outside the bracket: the secant overshot; stay inside, near the side it aimed at.
        guess = min(max(guess, low + margin), high - margin)
    return guess
