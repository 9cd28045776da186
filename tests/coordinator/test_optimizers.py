"""The optimizer registry and the windowed in-place step of `coordinator.optimizers`."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest

from common.core.config import SERVER_OPTIMIZERS, OptimizerSection
from coordinator.optimizers import (
    BUILDERS,
    FedAdam,
    FedAvg,
    FedYogi,
    apply_step,
    build_optimizer,
)


@pytest.mark.parametrize(("name", "cls"), [("fedavg", FedAvg), ("fedadam", FedAdam),
                                           ("fedyogi", FedYogi)])
def test_registry_builds_the_configured_optimizer(name: str, cls: type) -> None:
    assert isinstance(build_optimizer(OptimizerSection(name=name, server_lr=0.5)), cls)


def test_only_stateless_optimizers_step_in_place() -> None:
    assert FedAvg().elementwise
    assert not FedAdam().elementwise and not FedYogi().elementwise


@pytest.mark.parametrize("name", ["fedavg", "fedadam", "fedyogi"])
def test_apply_step_equals_one_whole_vector_step(name: str) -> None:
    rng = np.random.default_rng(3)
    flat = rng.normal(size=1000).astype(np.float32)
    delta = rng.normal(size=1000).astype(np.float32)
    expected = build_optimizer(OptimizerSection(name=name)).step(flat.copy(), delta)
    optimizer = build_optimizer(OptimizerSection(name=name))
    stepped = apply_step(optimizer, flat.copy(), delta, window=64)
    assert np.array_equal(stepped, expected)


def test_elementwise_step_reuses_the_model_buffer() -> None:
    flat = np.zeros(100, dtype=np.float32)
    stepped = apply_step(FedAvg(), flat, np.ones(100, dtype=np.float32), window=7)
    assert stepped is flat and np.all(flat == 1.0)


def test_every_server_optimizer_a_study_accepts_is_built_and_no_other() -> None:
    """The names a study/config accept (common.core.config) and the builders (coordinator)
    are one list: a name added on one side only fails here."""
    assert set(BUILDERS) == set(SERVER_OPTIMIZERS)
    for name in SERVER_OPTIMIZERS:
        stepped = build_optimizer(OptimizerSection(name=name)).step(
            np.zeros(4, np.float32), np.ones(4, np.float32))
        assert stepped.shape == (4,) and np.all(np.isfinite(stepped))
    with pytest.raises(pydantic.ValidationError, match="unknown server optimizer 'sgdm'"):
        OptimizerSection(name="sgdm")
