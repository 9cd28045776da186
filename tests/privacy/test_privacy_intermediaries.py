"""Adaptive intermediary count (Jiang et al. 2023; med-air/Client-DP-FL select_split_num)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from common.core.errors import ConfigError
from common.privacy.intermediaries import SplitMode, intermediary_ratio, split_count


def count(
    noise: float, agg: float, norms: float, n: int, current: int = 1,
    mode: SplitMode = "default", maximum: int | None = None,
) -> int:
    return split_count(noise_norm=noise, aggregate_norm=agg, unit_norm_sum=norms, hospitals=n,
                       current=current, mode=mode, maximum=maximum)


def test_matches_the_paper_formula_for_one_intermediary() -> None:
    # v = sqrt(N xi / phi), floored, for a hospital measured unsplit.
    for noise, agg, norms, n in [(30.0, 2.0, 5.0, 4), (12.0, 0.5, 3.0, 3), (100.0, 1.0, 4.0, 5),
                                 (7.5, 3.0, 7.5, 9)]:
        xi, phi = noise / agg, norms / agg
        expected = math.floor(math.sqrt(n * xi / phi))
        got = split_count(noise_norm=noise, aggregate_norm=agg, unit_norm_sum=norms, hospitals=n)
        assert got == max(1, expected)


def test_ratio_is_xi_over_phi() -> None:
    assert intermediary_ratio(noise_norm=6.0, aggregate_norm=2.0, unit_norm_sum=3.0) == 2.0


def test_hand_computed_values_from_the_authors_code() -> None:
    # noise 24, aggregate 2, norm sum 4: xi 12, phi 2, ratio 6; N = 6: vn = sqrt(36) = 6.
    assert count(24.0, 2.0, 4.0, 6) == 6
    # current = 3 intermediaries already: default floor(6 * 3) = 18; stable floor(6) * 3
    # = 18; progressive floor((18 - 3) / 2) + 3 = 10.
    assert count(24.0, 2.0, 4.0, 6, 3) == 18
    assert count(24.0, 2.0, 4.0, 6, 3, mode="stable") == 18
    assert count(24.0, 2.0, 4.0, 6, 3, mode="progressive") == 10
    # N = 5: vn = sqrt(30) = 5.477: default floor(5.477 * 2) = 10, stable 5 * 2 = 10,
    # progressive floor((10.954 - 2) / 2) + 2 = 6.
    assert count(24.0, 2.0, 4.0, 5) == 5
    assert count(24.0, 2.0, 4.0, 5, 2) == 10
    assert count(24.0, 2.0, 4.0, 5, 2, mode="stable") == 10
    assert count(24.0, 2.0, 4.0, 5, 2, mode="progressive") == 6
    # N = 7, current 3: vn = sqrt(42) = 6.4807: default floor(19.44) = 19, stable 18,
    # progressive floor(16.44 / 2) + 3 = 11.
    assert count(24.0, 2.0, 4.0, 7, 3) == 19
    assert count(24.0, 2.0, 4.0, 7, 3, mode="stable") == 18
    assert count(24.0, 2.0, 4.0, 7, 3, mode="progressive") == 11


def test_small_noise_shrinks_and_clamps() -> None:
    # ratio 0.05, N = 5: vn = 0.5 < 1 -> floor(current * 0.5): 4 -> 2; 1 -> 0 in the
    # authors' code, which we clamp to 1.
    assert count(0.5, 1.0, 10.0, 5, 4) == 2
    assert count(0.5, 1.0, 10.0, 5, 1) == 1
    assert count(1e4, 1.0, 1.0, 5) == math.floor(math.sqrt(5e4))
    assert count(1e4, 1.0, 1.0, 5, maximum=20) == 20


def test_validation() -> None:
    bad_calls: list[Callable[[], int]] = [
        lambda: count(1.0, 0.0, 1.0, 3), lambda: count(1.0, 1.0, 0.0, 3),
        lambda: count(-1.0, 1.0, 1.0, 3), lambda: count(1.0, 1.0, 1.0, 0),
        lambda: count(1.0, 1.0, 1.0, 3, 0), lambda: count(1.0, 1.0, 1.0, 3, maximum=0),
        lambda: count(float("nan"), 1.0, 1.0, 3),
        lambda: count(1.0, 1.0, 1.0, 3, mode="fast"),  # type: ignore[arg-type]
    ]
    for call in bad_calls:
        with pytest.raises(ConfigError):
            call()
