"""The coordinator's windowed decode + FedAvg step equals the whole-vector formula.

`RoundEngine._mean_delta` / `_server_step` work in UPDATE_CHUNK_ELEMENTS windows (and
FedAvg in place) to keep coordinator memory near one model; the result must be
bit-for-bit what decode_sum + weighted_mean + FedAvg.step give on the whole vector.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from common.crypto.quantize import decode_sum
from coordinator.engine import UPDATE_CHUNK_ELEMENTS, RoundEngine
from coordinator.optimizers import FedAvg, weighted_mean


@pytest.mark.parametrize("server_lr", [1.0, 0.7])
def test_windowed_update_is_bitwise_the_whole_vector_update(server_lr: float) -> None:
    rng = np.random.default_rng(7)
    dim = 2 * UPDATE_CHUNK_ELEMENTS + 12_345  # three windows, the last one partial
    count, bits, clip, cap = 5, 24, 1.0, 1_000_000
    aggregate = rng.integers(0, count * ((1 << bits) - 1), size=dim + 3, dtype=np.uint32)
    global_flat = rng.normal(size=dim).astype(np.float32)
    ann = SimpleNamespace(clip=clip, quantization_bits=bits, weight_cap=cap)
    weight_sum = 1234

    floats, _ = decode_sum(aggregate, float_length=dim, clip=clip, bits=bits, count=count)
    expected_delta = weighted_mean(floats * cap, float(weight_sum))
    expected_model = FedAvg(server_lr).step(global_flat, expected_delta)

    engine = SimpleNamespace(model_dim=dim, optimizer=FedAvg(server_lr),
                             global_flat=global_flat.copy())
    delta = RoundEngine._mean_delta(engine, ann, aggregate, count=count,  # type: ignore[arg-type]
                                    weight_sum=weight_sum)
    RoundEngine._server_step(engine, delta)  # type: ignore[arg-type]

    assert delta.dtype == np.float32
    assert np.array_equal(delta, expected_delta)
    assert np.array_equal(engine.global_flat, expected_model)
    assert not np.array_equal(engine.global_flat, global_flat)  # the step did something
