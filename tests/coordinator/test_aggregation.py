"""`decode_round_sum` (windowed, in place) equals the whole-vector formula.

The coordinator decodes and steps in UPDATE_CHUNK_ELEMENTS windows (and FedAvg in
place) to keep its memory near one model; the result must be bit-for-bit what
decode_sum + weighted_mean + FedAvg.step give on the whole vector.
"""

from __future__ import annotations

import numpy as np
import pytest

from common.core.errors import ValidationError
from common.crypto.quantize import decode_sum
from coordinator.aggregation import UPDATE_CHUNK_ELEMENTS, decode_round_sum
from coordinator.optimizers import FedAvg, apply_step, weighted_mean

BINS = 2


def _aggregate(dim: int, *, count: int, bits: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, count * ((1 << bits) - 1), size=dim + 1 + 2 * BINS, dtype=np.uint32)


@pytest.mark.parametrize("server_lr", [1.0, 0.7])
def test_windowed_update_is_bitwise_the_whole_vector_update(server_lr: float) -> None:
    rng = np.random.default_rng(7)
    dim = 2 * UPDATE_CHUNK_ELEMENTS + 12_345  # three windows, the last one partial
    count, bits, clip, cap = 5, 24, 1.0, 1_000_000
    aggregate = _aggregate(dim, count=count, bits=bits)
    aggregate[dim] = 1234  # the summed weights
    global_flat = rng.normal(size=dim).astype(np.float32)

    floats, integers = decode_sum(aggregate, float_length=dim, clip=clip, bits=bits, count=count)
    expected_delta = weighted_mean(floats * cap, float(integers[0]))
    expected_model = FedAvg(server_lr).step(global_flat, expected_delta)

    decoded = decode_round_sum(
        aggregate, model_dim=dim, count=count, clip=clip, bits=bits, weight_cap=cap,
        histogram_bins=BINS, evaluation_only=False,
    )
    assert decoded.weight_sum == 1234
    delta = decoded.mean_delta
    assert delta is not None
    model = apply_step(FedAvg(server_lr), global_flat.copy(), delta,
                       window=UPDATE_CHUNK_ELEMENTS)

    assert delta.dtype == np.float32
    assert np.array_equal(delta, expected_delta)
    assert np.array_equal(model, expected_model)
    assert not np.array_equal(model, global_flat)  # the step did something


def test_evaluation_round_yields_metrics_and_no_delta() -> None:
    dim = 16
    aggregate = np.zeros(dim + 1 + 2 * BINS, dtype=np.uint32)
    aggregate[dim] = 50
    aggregate[dim + 1 :] = [3, 1, 1, 3]  # negatives low, positives high
    decoded = decode_round_sum(
        aggregate, model_dim=dim, count=2, clip=1.0, bits=20, weight_cap=100,
        histogram_bins=BINS, evaluation_only=True,
    )
    assert decoded.mean_delta is None
    assert decoded.metrics["contributors"] == 2.0
    assert "auc" in decoded.metrics


def test_zero_summed_weight_applies_nothing() -> None:
    aggregate = _aggregate(32, count=3, bits=20)
    aggregate[32] = 0
    decoded = decode_round_sum(
        aggregate, model_dim=32, count=3, clip=1.0, bits=20, weight_cap=100,
        histogram_bins=BINS, evaluation_only=False,
    )
    assert decoded.mean_delta is None


@pytest.mark.parametrize("bad", [np.zeros(10, np.int64), np.zeros(3, np.uint32)])
def test_malformed_aggregate_is_refused(bad: np.ndarray) -> None:
    with pytest.raises(ValidationError):
        decode_round_sum(bad, model_dim=8, count=2, clip=1.0, bits=20, weight_cap=10,
                         histogram_bins=BINS, evaluation_only=False)


def test_released_histogram_sets_the_next_rounds_edges() -> None:
    """The coordinator decodes a round's histogram with the edges it announced and
    derives the next round's from the released sum; a site reading those from the
    next announcement counts the band in many buckets (common.releases.evaluation)."""
    from common.releases.evaluation import score_histogram
    from common.releases.evaluation_edges import default_edges, round_edges

    bins, dim = 20, 16
    rng = np.random.default_rng(9)
    labels = (rng.random(3000) < 0.3).astype(np.int64)
    scores = 0.42 + 0.05 / (1 + np.exp(-(rng.normal(size=3000) + labels)))
    announced = tuple(float(e) for e in default_edges(bins))
    aggregate = np.zeros(dim + 1 + 2 * bins, dtype=np.uint32)
    aggregate[dim + 1 :] = score_histogram(scores, labels, bins=bins)
    decoded = decode_round_sum(
        aggregate, model_dim=dim, count=3, clip=1.0, bits=20, weight_cap=100,
        histogram_bins=bins, evaluation_only=True, histogram_edges=announced,
    )
    assert decoded.metrics["auc"] == 0.5  # one bucket holds the whole band
    following = decoded.next_histogram_edges()
    assert following is not None and len(following) == bins + 1
    (edges,) = round_edges(following, bins=bins)
    # The released bucket, [0.34, 0.5), and around it now hold all but the end buckets.
    assert np.all((edges[1:-1] > 0.3) & (edges[1:-1] < 0.55))
    aggregate[dim + 1 :] = score_histogram(scores, labels, edges=edges)
    again = decode_round_sum(
        aggregate, model_dim=dim, count=3, clip=1.0, bits=20, weight_cap=100,
        histogram_bins=bins, evaluation_only=True, histogram_edges=following,
    )
    assert again.metrics["auc"] > 0.7
    # A round that evaluated nothing keeps the edges as they were.
    aggregate[dim + 1 :] = 0
    quiet = decode_round_sum(
        aggregate, model_dim=dim, count=3, clip=1.0, bits=20, weight_cap=100,
        histogram_bins=bins, evaluation_only=True, histogram_edges=following,
    )
    assert quiet.next_histogram_edges() is None
