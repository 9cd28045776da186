"""What a site releases beyond DP-SGD, and how it plans its own noise.

* The cohort size: ONE Gaussian count per data set (sensitivity 1, a ledger entry of
  purpose "count"), persisted in the site's state so a restart never re-releases; sample
  rates, steps, FedAvg weights and gauges are computed from it, never from N.
* DP evaluation: one score per privacy unit, a 2 x bins integer histogram noised with
  the distributed discrete Gaussian (Kairouz, Liu & Steinke, ICML 2021) split across the
  round-size floor minus the colluding sites, so the secure sum carries the noise (the
  release itself: `common.releases.plugins.evaluation_histogram`; its ledger budget rules here).
* Noise planning: sigma from the site's remaining budget and its own policy
  (`plan_round_noise`), re-planned every round from what the ledger shows spent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from common.core.config import SitePolicySection
from common.core.errors import ConfigError, EvaluationsUsed, StateError, ValidationError
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from common.crypto.random import RandomSource, numpy_generator, system_random
from common.privacy.accountant import RoundNoisePlan, compose_epsilon, plan_round_noise
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import DistributedDiscreteGaussian, Gaussian, Mechanism
from common.privacy.purpose import Purpose
from common.releases.plugins.evaluation_histogram import EvaluationHistogram
from common.releases.plugins.evaluation_histogram import (
    evaluation_noise_sites as evaluation_noise_sites,
)
from common.releases.seam import NoisePlan
from common.study import Study, per_round_cap

COUNT_STATE_FILE = "cohort-count.json"
PURPOSE_COUNT = Purpose.COUNT
PURPOSE_EVALUATION = Purpose.EVALUATION
PURPOSE_TRAINING = Purpose.TRAINING


# --------------------------------------------------------------------- cohort count


def gaussian_std_for(*, epsilon: float, delta: float, accountant: str) -> float:
    """Smallest noise std (to 1e-3 relative) of a sensitivity-1 Gaussian release whose
    epsilon at `delta` is at most `epsilon` (bisection on the accountant itself)."""
    def eps(std: float) -> float:
        return compose_epsilon([Gaussian(std, 1.0)], delta=delta, accountant=accountant)

    low, high = 0.0, 1.0
    while eps(high) > epsilon:
        low, high = high, high * 2
        if high > 1e9:
            raise ConfigError("count_epsilon", f"{epsilon} is unreachable")
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        if eps(middle) <= epsilon:
            high = middle
        else:
            low = middle
    return high


def noisy_unit_count(units: int, *, std: float, rng: RandomSource = system_random) -> int:
    """The DP count of `units` (Gaussian, sensitivity 1, noise from `rng`): what the
    site's training sizes its sampling rate and steps from (`TrainingConfig.
    released_units`), so they depend on the data only through a DP release."""
    noise = numpy_generator(rng).normal(0.0, std)
    # Rounding and clamping are post-processing of the Gaussian release.
    return max(1, round(float(units + noise)))


@dataclass(frozen=True)
class CohortCount:
    noisy_count: int
    noise_std: float
    ledger_round: int


def release_cohort_count(
    ledger: PrivacyLedger,
    *,
    units: int,
    epsilon: float,
    state: Path,
    now: datetime,
    rng: RandomSource = system_random,
) -> CohortCount:
    """The site's one DP count of its privacy units (persisted; never re-released).

    Write-ahead: the ledger entry is committed before the count exists; a crash between
    the two costs a second entry at the next start, never a free release."""
    path = state / COUNT_STATE_FILE
    if path.exists():
        try:
            raw = parse_json(path.read_bytes())
            return CohortCount(int(raw["noisy_count"]), float(raw["noise_std"]),
                               int(raw["ledger_round"]))
        except (OSError, ValidationError, ValueError, KeyError, TypeError) as exc:
            raise StateError(
                f"{path} is unreadable ({exc}): it holds this site's released cohort count; "
                "restore it from a backup (deleting it would release, and pay for, a new one)"
            ) from None
    std = gaussian_std_for(epsilon=epsilon, delta=ledger.delta, accountant=ledger.accountant)
    previous = [e for e in ledger.entries() if e.purpose == PURPOSE_COUNT]
    ledger_round = max((e.round for e in previous), default=-1) + 1
    ledger.reserve(ledger_round, [Gaussian(std, 1.0)], now=now, purpose=PURPOSE_COUNT)
    noisy = noisy_unit_count(units, std=std, rng=rng)
    released = CohortCount(noisy, std, ledger_round)
    atomic_write(path, json.dumps(
        {"noisy_count": noisy, "noise_std": std, "ledger_round": ledger_round}
    ).encode())
    return released


# ----------------------------------------------------------------------- evaluation


def evaluation_mechanism(
    *, noise_std: float, n_noise: int, bins: int, classes: int = 1
) -> DistributedDiscreteGaussian:
    """The ledger record of one histogram release (`EvaluationHistogram.plan`)."""
    release = EvaluationHistogram(noise_std=noise_std, bins=bins, classes=classes)
    return release.plan(n_noise=n_noise).mechanism()


def noised_histogram(
    histogram: np.ndarray, *, noise_std: float, n_noise: int, rng: RandomSource = system_random
) -> np.ndarray:
    """This site's share of the distributed noise added to its integer counts."""
    counts = np.asarray(histogram, dtype=np.int64)
    plan = NoisePlan(sigma=noise_std, n_noise=n_noise, length=counts.size,
                     l2_sensitivity=1.0, l1_sensitivity=1.0)
    noised: np.ndarray = counts + plan.noise(rng)
    return noised


def one_per_unit(
    unit_ids: np.ndarray | None, *, size: int, rng: RandomSource = system_random
) -> np.ndarray:
    """Indices of one uniformly random record per privacy unit (every record when the
    unit is the record): bounds each unit's histogram contribution to one count."""
    if unit_ids is None:
        return np.arange(size)
    order = numpy_generator(rng).permutation(size)
    _, first = np.unique(np.asarray(unit_ids)[order], return_index=True)
    return np.sort(order[first])


def evaluations_used(ledger: PrivacyLedger) -> int:
    return sum(1 for e in ledger.entries() if e.purpose == PURPOSE_EVALUATION)


def check_evaluation_allowed(ledger: PrivacyLedger, policy: SitePolicySection) -> bool:
    """False once the site's `max_evaluations` are on its ledger."""
    return evaluations_used(ledger) < policy.max_evaluations


def refuse_evaluation_only(round_number: int) -> EvaluationsUsed:
    return EvaluationsUsed(
        f"round {round_number} is evaluation-only and this site's policy max_evaluations "
        "is reached"
    )


# ------------------------------------------------------------------------ planning


def rounds_to_plan(
    policy: SitePolicySection, *, announced: int, study_rounds: int | None = None
) -> int:
    """The training rounds a site plans its noise for.

    Under a study: the study's own ``rounds``, the contract this site accepted (its digest
    is bound into every round's announcement), whatever a round announces. Planning for
    the rounds that will really run is what lets a study spend its budget by its end
    (a 3-round study planned as 10 rounds leaves most of it unused). A coordinator that
    runs MORE rounds than the study gains nothing: the ledger is a privacy filter
    (Rogers, Roth, Ullman & Vadhan, "Privacy Odometers and Filters", NeurIPS 2016;
    Whitehouse, Ramdas, Rogers & Wu, "Fully-Adaptive Composition in Differential
    Privacy", ICML 2023): it composes the whole adaptively chosen history and refuses the
    round that would cross the budget, so the guarantee holds however many rounds are
    asked for.

    Without a study: the site's own policy, raised (never lowered) by the announcement."""
    if study_rounds is not None:
        return max(study_rounds, 1)
    return max(policy.planned_rounds, announced)


def plan_training_noise(
    ledger: PrivacyLedger,
    *,
    policy: SitePolicySection,
    announced_rounds: int,
    sample_rate: float,
    steps_per_round: int,
    evaluation: Sequence[Mechanism] = (),
    history: Sequence[Mechanism] | None = None,
    budget_epsilon: float | None = None,
    study_rounds: int | None = None,
    study: Study | None = None,
) -> RoundNoisePlan:
    """The next round's noise multiplier, from the ledger's composed spend and the
    site's policy (a restart re-plans from the same ledger, so it gets the same answer).

    `evaluation`: this round's DP evaluation release; the plan reserves one per
    remaining round and one more for the final evaluation-only round. `study_rounds`:
    the accepted study's training rounds (`rounds_to_plan`). `study`: the accepted
    study, whose `max_epsilon_per_round` caps the round with the site's own
    (`per_round_cap`, the cap every release is held to). `history` and
    `budget_epsilon` replace the ledger's whole history and budget (DP-SGD beneath
    hospital-level DP plans on its own path: common.privacy.layered).
    """
    done = sum(1 for e in ledger.entries() if e.purpose == PURPOSE_TRAINING)
    remaining = max(
        rounds_to_plan(policy, announced=announced_rounds, study_rounds=study_rounds) - done, 1
    )
    return plan_round_noise(
        history=ledger.history() if history is None else list(history),
        budget_epsilon=ledger.budget_epsilon if budget_epsilon is None else budget_epsilon,
        delta=ledger.delta,
        sample_rate=sample_rate,
        steps_per_round=steps_per_round,
        remaining_rounds=remaining,
        max_epsilon_per_round=per_round_cap(study, site_cap=policy.max_epsilon_per_round)[0],
        accountant=ledger.accountant,
        per_round=evaluation,
        reserved=evaluation,
    )
