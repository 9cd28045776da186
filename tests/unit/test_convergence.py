"""The end-of-study verdict: was the model still improving? (common.releases.convergence)"""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from common.releases import convergence


def test_rising_auc_is_improving_and_flat_is_not() -> None:
    assert convergence.auc_trend([0.5, 0.6, 0.7, 0.8]).improving is True
    assert convergence.auc_trend([0.80, 0.801, 0.802, 0.803]).improving is False
    assert convergence.auc_trend([0.8]).improving is None
    # A NaN round (no evaluation) is skipped, not read as a drop.
    assert convergence.auc_trend([0.6, math.nan, 0.7]).improving is True


def test_loss_trend_is_relative() -> None:
    assert convergence.loss_trend([1.0, 0.9, 0.8]).improving is True
    assert convergence.loss_trend([0.100, 0.0995, 0.0992]).improving is False


@given(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=20))
def test_verdict_follows_the_window_change(values: list[float]) -> None:
    t = convergence.auc_trend(values)
    window = min(convergence.WINDOW, len(values) - 1)
    assert t.first == values[-1 - window] and t.last == values[-1]
    assert t.improving == (values[-1] - values[-1 - window] > convergence.AUC_TOLERANCE)
