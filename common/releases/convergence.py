"""Was a model still improving when its study ended? A trend over the last rounds.

A study has a fixed number of rounds (its budget is planned for them), so the question at
its end is whether those rounds were enough: the site asks it of its local training loss,
the coordinator of the DP-evaluated AUC of the global model. Pure: the callers pass the
per-round values they already have (nothing new is computed from private data; the AUC
is post-processing of the released, noised histograms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

AUC_TOLERANCE = 0.005
"""An AUC gain under half a point over the window reads as converged."""

LOSS_RELATIVE_TOLERANCE = 0.01
"""A local loss falling by under 1% over the window reads as converged."""

WINDOW = 3
"""Rounds compared: the last value against the one WINDOW rounds earlier."""


@dataclass(frozen=True)
class Trend:
    """``improving`` is None when there are too few rounds to say."""

    improving: bool | None
    first: float
    last: float
    rounds: int

    @property
    def change(self) -> float:
        return self.last - self.first


def trend(
    values: Sequence[float], *, higher_is_better: bool, tolerance: float, relative: bool = False,
    window: int = WINDOW,
) -> Trend:
    """The change of `values` over their last `window` steps, judged against `tolerance`
    (a fraction of the earlier value when `relative`). Non-finite values are skipped."""
    if window < 1:
        raise ValueError("window must be >= 1")
    finite = [float(v) for v in values if math.isfinite(v)]
    if len(finite) < 2:
        value = finite[-1] if finite else math.nan
        return Trend(None, value, value, len(finite) - 1 if finite else 0)
    span = min(window, len(finite) - 1)
    first, last = finite[-1 - span], finite[-1]
    gain = (last - first) if higher_is_better else (first - last)
    bar = tolerance * abs(first) if relative else tolerance
    return Trend(gain > bar, first, last, span)


def auc_trend(aucs: Sequence[float]) -> Trend:
    return trend(aucs, higher_is_better=True, tolerance=AUC_TOLERANCE)


def loss_trend(losses: Sequence[float]) -> Trend:
    return trend(losses, higher_is_better=False, tolerance=LOSS_RELATIVE_TOLERANCE,
                 relative=True)


def describe_auc_trend(aucs: Sequence[float]) -> str:
    """The coordinator's line at a study's end.

    >>> print(describe_auc_trend([0.70, 0.75, 0.79, 0.81]))
    ... # doctest: +NORMALIZE_WHITESPACE
    the DP-evaluated AUC changed by +0.110 over the last 3 training rounds
    (0.700 -> 0.810): the model was still improving when the study ended;
    a study with more rounds may do better
    >>> print(describe_auc_trend([0.812, 0.813, 0.812, 0.814]))
    ... # doctest: +NORMALIZE_WHITESPACE
    the DP-evaluated AUC changed by +0.002 over the last 3 training rounds
    (0.812 -> 0.814): converged (under 0.005)
    """
    t = auc_trend(aucs)
    if t.improving is None:
        return "too few DP-evaluated rounds to say whether the model was still improving"
    head = (f"the DP-evaluated AUC changed by {t.change:+.3f} over the last {t.rounds} "
            f"training rounds ({t.first:.3f} -> {t.last:.3f})")
    if t.improving:
        return (head + ": the model was still improving when the study ended; a study "
                "with more rounds may do better")
    return head + f": converged (under {AUC_TOLERANCE:g})"


def describe_loss_trend(losses: Sequence[float]) -> str:
    """The site's words for its local loss over the rounds it trained.

    >>> describe_loss_trend([0.60, 0.52, 0.47, 0.45])
    'local loss 0.600 -> 0.450 over the last 3 rounds: still falling'
    >>> describe_loss_trend([0.451, 0.450, 0.452, 0.449])
    'local loss 0.451 -> 0.449 over the last 3 rounds: flat (under 1% change)'
    """
    t = loss_trend(losses)
    if t.improving is None:
        return "too few rounds for a loss trend"
    head = f"local loss {t.first:.3f} -> {t.last:.3f} over the last {t.rounds} rounds"
    if t.improving:
        return head + ": still falling"
    return head + f": flat (under {LOSS_RELATIVE_TOLERANCE:.0%} change)"
