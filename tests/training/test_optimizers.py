"""Server optimizers against hand-computed steps (Reddi et al. 2021, Algorithm 2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.core.errors import ValidationError
from coordinator.optimizers import FedAdam, FedAvg, FedYogi, weighted_mean


def test_weighted_mean_from_secure_sums() -> None:
    # Two sites: n=10 with delta [1, 2], n=30 with delta [3, -2].
    summed = 10 * np.array([1.0, 2.0]) + 30 * np.array([3.0, -2.0])
    np.testing.assert_allclose(weighted_mean(summed, 40.0), [2.5, -1.0])
    with pytest.raises(ValidationError):
        weighted_mean(summed, 0.0)


def test_fedavg() -> None:
    x = np.array([1.0, -1.0], dtype=np.float32)
    np.testing.assert_allclose(FedAvg().step(x, np.array([0.5, 0.5], np.float32)), [1.5, -0.5])
    np.testing.assert_allclose(FedAvg(server_lr=2.0).step(x, np.array([1, 0], np.float32)), [3, -1])


def test_fedadam_two_steps_by_hand() -> None:
    opt = FedAdam(lr=0.1, beta1=0.9, beta2=0.99, tau=0.01)
    x0 = np.array([0.0], dtype=np.float32)
    d1, d2 = 0.2, -0.1
    x1 = opt.step(x0, np.array([d1], np.float32))
    m1 = 0.1 * d1
    v1 = 0.99 * 0.01**2 + 0.01 * d1**2
    assert x1[0] == pytest.approx(0.1 * m1 / (math.sqrt(v1) + 0.01), rel=1e-5)
    x2 = opt.step(x1, np.array([d2], np.float32))
    m2 = 0.9 * m1 + 0.1 * d2
    v2 = 0.99 * v1 + 0.01 * d2**2
    assert x2[0] == pytest.approx(x1[0] + 0.1 * m2 / (math.sqrt(v2) + 0.01), rel=1e-5)


def test_fedyogi_second_moment_by_hand() -> None:
    opt = FedYogi(lr=0.1, beta1=0.0, beta2=0.9, tau=0.1)
    x1 = opt.step(np.zeros(2, np.float32), np.array([0.5, 0.01], np.float32))
    v_big = 0.01 - 0.1 * 0.25 * np.sign(0.01 - 0.25)  # grows: v < delta^2
    v_small = 0.01 - 0.1 * 1e-4 * np.sign(0.01 - 1e-4)  # shrinks: v > delta^2
    expected = 0.1 * np.array([0.5, 0.01]) / (np.sqrt([v_big, v_small]) + 0.1)
    np.testing.assert_allclose(x1, expected, rtol=1e-5)
    np.testing.assert_allclose(opt.state_dict()["v"], [v_big, v_small], rtol=1e-6)


@pytest.mark.parametrize("cls", [FedAdam, FedYogi])
def test_state_round_trip_resumes_identically(cls) -> None:
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=4).astype(np.float32) for _ in range(4)]
    straight = cls(lr=0.05)
    x = np.zeros(4, np.float32)
    for d in deltas:
        x = straight.step(x, d)
    first = cls(lr=0.05)
    y = np.zeros(4, np.float32)
    for d in deltas[:2]:
        y = first.step(y, d)
    state = {k: v.copy() for k, v in first.state_dict().items()}
    assert all(isinstance(v, np.ndarray) for v in state.values())
    resumed = cls(lr=0.05)
    resumed.load_state_dict(state)
    for d in deltas[2:]:
        y = resumed.step(y, d)
    np.testing.assert_array_equal(x, y)


def test_shape_mismatch_rejected() -> None:
    with pytest.raises(ValidationError):
        FedAdam().step(np.zeros(3, np.float32), np.zeros(2, np.float32))
