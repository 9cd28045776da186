"""The accountant against an independent one (Google dp-accounting's PLD accountant)."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants.utils import get_noise_multiplier

from common.core.errors import ConfigError
from common.privacy.accountant import (
    RDP_ORDERS,
    Segment,
    account,
    canonical_mechanisms,
    compose_epsilon,
    epsilon_after,
    plan_noise_multiplier,
)

DELTA = 1e-5


def pld_epsilon(segments: list[Segment], delta: float) -> float:
    """Reference: Poisson-subsampled Gaussian composed with dp-accounting's PLD."""
    accountant = PLDAccountant(value_discretization_interval=1e-3)
    for segment in segments:
        event = dp_accounting.PoissonSampledDpEvent(
            segment.sample_rate, dp_accounting.GaussianDpEvent(segment.noise_multiplier)
        )
        accountant.compose(dp_accounting.SelfComposedDpEvent(event, segment.steps))
    return float(accountant.get_epsilon(delta))


# (sigma, q, steps) settings spanning small to large epsilon.
SETTINGS = [
    [Segment(1.0, 0.01, 1000)],
    [Segment(2.0, 0.05, 200)],
    [Segment(0.8, 0.004, 1500)],
    # A heterogeneous history: two rounds with different noise and sampling.
    [Segment(1.1, 0.02, 300), Segment(0.8, 0.01, 200)],
]


@pytest.mark.parametrize("segments", SETTINGS, ids=lambda s: repr([x.as_tuple() for x in s]))
def test_prv_matches_pld_and_rdp_is_an_upper_bound(segments: list[Segment]) -> None:
    reference = pld_epsilon(segments, DELTA)
    prv = account(segments, delta=DELTA)
    rdp = compose_epsilon(segments, delta=DELTA, accountant="rdp")
    assert prv.accountant == "prv" and not prv.fell_back
    # Opacus returns the PRV upper bound (estimate + eps_error 0.01); PLD is also tight.
    assert prv.epsilon == pytest.approx(reference, rel=0.02, abs=0.015)
    assert rdp >= prv.epsilon
    # And the composed value is far below the basic-composition sum of single steps.
    single_step = [Segment(s.noise_multiplier, s.sample_rate, 1) for s in segments]
    basic = sum(
        compose_epsilon([s], delta=DELTA, accountant="rdp") * seg.steps
        for s, seg in zip(single_step, segments)
    )
    assert rdp < basic


def test_two_halves_compose_to_the_whole_and_not_to_the_sum() -> None:
    half = Segment(1.0, 0.01, 500)
    whole = compose_epsilon([Segment(1.0, 0.01, 1000)], delta=DELTA)
    halves = compose_epsilon([half, half], delta=DELTA)
    assert halves == pytest.approx(whole, rel=1e-12)
    # Summing per-round epsilons (basic composition) would overstate the spend.
    assert compose_epsilon([half], delta=DELTA) * 2 > whole * 1.2


def test_history_order_does_not_change_epsilon() -> None:
    history = [Segment(1.1, 0.02, 300), Segment(0.8, 0.01, 200), Segment(1.1, 0.02, 100)]
    forward = compose_epsilon(history, delta=DELTA)
    backward = compose_epsilon(list(reversed(history)), delta=DELTA)
    assert forward == pytest.approx(backward, rel=1e-12)
    assert list(canonical_mechanisms(history).gaussians) == [(0.8, 0.01, 200), (1.1, 0.02, 400)]


def test_empty_history_and_zero_steps_cost_nothing() -> None:
    assert compose_epsilon([], delta=DELTA) == 0.0
    assert compose_epsilon([Segment(1.0, 0.5, 0)], delta=DELTA) == 0.0
    report = account([], delta=DELTA, accountant="rdp")
    assert (report.epsilon, report.accountant) == (0.0, "rdp")


def test_prv_falls_back_to_rdp_for_histories_too_costly_for_prv() -> None:
    # Little noise, huge sampling rate, many steps: the PRV mesh would need ~2e9 points.
    extreme = [Segment(0.3, 0.5, 10_000)]
    report = account(extreme, delta=DELTA)
    assert report.fell_back
    assert report.requested_accountant == "prv"
    assert report.accountant == "rdp"
    assert report.fallback_reason is not None and "PRV" in report.fallback_reason
    assert report.epsilon == compose_epsilon(extreme, delta=DELTA, accountant="rdp")


def test_plan_then_account_meets_the_target() -> None:
    target = 2.0
    sigma = plan_noise_multiplier(target_epsilon=target, delta=DELTA, sample_rate=0.01, steps=800)
    spent = compose_epsilon([Segment(sigma, 0.01, 800)], delta=DELTA)
    assert target - 0.05 <= spent <= target
    # A little less noise would break the target: the plan is not wastefully large.
    assert compose_epsilon([Segment(sigma * 0.95, 0.01, 800)], delta=DELTA) > target


def test_rdp_plan_agrees_with_opacus_search() -> None:
    ours = plan_noise_multiplier(
        target_epsilon=3.0, delta=DELTA, sample_rate=0.02, steps=500, accountant="rdp"
    )
    theirs = get_noise_multiplier(
        target_epsilon=3.0,
        target_delta=DELTA,
        sample_rate=0.02,
        steps=500,
        accountant="rdp",
        alphas=list(RDP_ORDERS),
    )
    assert ours == pytest.approx(theirs, rel=0.01)
    assert compose_epsilon([Segment(ours, 0.02, 500)], delta=DELTA, accountant="rdp") <= 3.0


@settings(max_examples=12, deadline=None)
@given(
    sigmas=st.lists(st.floats(0.6, 5.0), min_size=1, max_size=3),
    rate=st.floats(0.001, 0.2),
    steps=st.integers(1, 300),
    extra_steps=st.integers(1, 300),
)
def test_more_training_never_lowers_epsilon(
    sigmas: list[float], rate: float, steps: int, extra_steps: int
) -> None:
    history = [Segment(sigma, rate, steps) for sigma in sigmas]
    before = compose_epsilon(history, delta=DELTA, accountant="rdp")
    after = epsilon_after(
        history, Segment(sigmas[0], rate, extra_steps), delta=DELTA, accountant="rdp"
    )
    assert math.isfinite(after)
    assert after > before > 0


@settings(max_examples=15, deadline=None)
@given(total=st.integers(2, 2000), cut=st.floats(0.01, 0.99), rate=st.floats(0.001, 0.1))
def test_splitting_a_segment_anywhere_keeps_epsilon(total: int, cut: float, rate: float) -> None:
    first = max(1, min(total - 1, round(total * cut)))
    whole = compose_epsilon([Segment(1.3, rate, total)], delta=DELTA, accountant="rdp")
    split = compose_epsilon(
        [Segment(1.3, rate, first), Segment(1.3, rate, total - first)],
        delta=DELTA,
        accountant="rdp",
    )
    assert split == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"noise_multiplier": 0.0, "sample_rate": 0.1, "steps": 1}, "noise_multiplier"),
        ({"noise_multiplier": float("nan"), "sample_rate": 0.1, "steps": 1}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.0, "steps": 1}, "sample_rate"),
        ({"noise_multiplier": 1.0, "sample_rate": 1.5, "steps": 1}, "sample_rate"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": -1}, "steps"),
        ({"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 2.5}, "steps"),
    ],
)
def test_segment_validation_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        Segment(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_bad_delta_accountant_and_target_are_refused() -> None:
    segments = [Segment(1.0, 0.01, 10)]
    with pytest.raises(ConfigError) as info:
        compose_epsilon(segments, delta=0.0)
    assert info.value.field == "delta"
    with pytest.raises(ConfigError) as info:
        compose_epsilon(segments, delta=DELTA, accountant="gdp")
    assert info.value.field == "accountant"
    with pytest.raises(ConfigError) as info:
        plan_noise_multiplier(target_epsilon=-1.0, delta=DELTA, sample_rate=0.01, steps=10)
    assert info.value.field == "target_epsilon"
