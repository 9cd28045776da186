"""Patient-level DP: a patient is one privacy unit however many encounters they have."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.models.layout import flatten_parameters, load_flat_parameters
from common.models.tables.mlp import TabularMLP
from common.privacy.accountant import compose_epsilon
from common.releases.evaluation import metrics_from_scores
from site_agent.patient_dp import PatientLevelDPSGD, PatientSampler, clipped_gradient_sum
from site_agent.synthetic import FEATURES
from site_agent.trainer import LocalTrainer, predict_scores
from site_agent.training_config import TrainingConfig

C = 0.5


def _cohort() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """20 ordinary patients (1-3 records), patient 100 with 50 encounters, 101 with 1."""
    gen = torch.Generator().manual_seed(0)
    ids = [p for p in range(20) for _ in range(1 + p % 3)] + [100] * 50 + [101]
    features = torch.randn(len(ids), 6, generator=gen)
    # The frequent flyer's encounters look alike, so their gradients add up coherently.
    features[-51:-1] = features[-51] + 0.05 * torch.randn(50, 6, generator=gen)
    labels = torch.randint(0, 2, (len(ids),), generator=gen).float()
    labels[-51:-1] = 1.0
    return features, labels, torch.tensor(ids)


def _without(patient: int, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor):
    keep = ids != patient
    return x[keep], y[keep], ids[keep]


def test_one_patient_moves_the_clipped_sum_by_at_most_c() -> None:
    torch.manual_seed(1)
    model = TabularMLP(6, hidden=(8,))
    x, y, ids = _cohort()
    full = clipped_gradient_sum(model, x, y, ids, max_grad_norm=C)
    for patient, encounters in ((100, 50), (101, 1)):
        assert int((ids == patient).sum()) == encounters
        rest = clipped_gradient_sum(model, *_without(patient, x, y, ids), max_grad_norm=C)
        assert torch.linalg.vector_norm(full - rest) <= C + 1e-6

    # Record-level clipping (each encounter its own unit) bounds a RECORD, not a patient:
    # removing the 50-encounter patient moves the sum by far more than C.
    records = torch.arange(len(ids))
    full_r = clipped_gradient_sum(model, x, y, records, max_grad_norm=C)
    xr, yr, _ = _without(100, x, y, ids)
    rest_r = clipped_gradient_sum(model, xr, yr, torch.arange(len(yr)), max_grad_norm=C)
    moved = torch.linalg.vector_norm(full_r - rest_r)
    assert moved > 5 * C, float(moved)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.integers(1, 12), min_size=2, max_size=8),
    clip=st.floats(0.01, 5.0),
)
def test_sensitivity_is_c_for_any_grouping(seed: int, sizes: list[int], clip: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TabularMLP(4, hidden=(5,))
    ids = torch.tensor([p for p, n in enumerate(sizes) for _ in range(n)])
    x = torch.randn(len(ids), 4, generator=gen) * 3
    y = torch.randint(0, 2, (len(ids),), generator=gen).float()
    full = clipped_gradient_sum(model, x, y, ids, max_grad_norm=clip)
    removed = int(torch.randint(0, len(sizes), (1,), generator=gen))
    rest = clipped_gradient_sum(model, *_without(removed, x, y, ids), max_grad_norm=clip)
    assert torch.linalg.vector_norm(full - rest) <= clip * (1 + 1e-5) + 1e-6


def test_engine_without_noise_is_clipped_sum_over_expected_and_chunk_invariant() -> None:
    torch.manual_seed(2)
    model = TabularMLP(6, hidden=(8,))
    x, y, ids = _cohort()
    _, dense = torch.unique(ids, return_inverse=True)
    expected = clipped_gradient_sum(model, x, y, ids, max_grad_norm=C) / 10.0
    for chunk in (7, 1000):  # 7 splits the 50-encounter patient across many chunks
        engine = PatientLevelDPSGD(
            model,
            noise_multiplier=0.0,
            max_grad_norm=C,
            expected_patients=10.0,
            max_physical_batch_size=chunk,
            generator=torch.Generator().manual_seed(0),
        )
        engine.compute_grad(x, y, dense, int(dense.max()) + 1)
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_sampler_takes_whole_patients() -> None:
    ids = torch.tensor([0, 0, 0, 1, 2, 2, 3])
    sampler = PatientSampler(ids, sample_rate=0.5)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(200):
        records, dense, k = sampler.sample(gen)
        chosen = set(ids[records].tolist())
        for patient in chosen:  # all or nothing of every patient
            assert int((ids[records] == patient).sum()) == int((ids == patient).sum())
        assert k == len(chosen) and (len(dense) == 0 or int(dense.max()) == k - 1)
        counts.append(k)
    assert 1.5 < np.mean(counts) < 2.5  # E[k] = 0.5 * 4 patients


def test_patient_level_trainer_learns_and_accounts_per_patient(site_split) -> None:
    train, held_out = site_split
    config = TrainingConfig(
        batch_size=40, lr=0.5, target_epsilon=4.0, delta=1e-5, planned_rounds=2, device="cpu"
    )

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return TabularMLP(len(FEATURES))

    trainer = LocalTrainer(mlp, train, config, seed=0)
    assert trainer.privacy_unit == "patient"  # default when the id column exists
    assert trainer.num_units == train.num_patients < len(train)
    weights = flatten_parameters(trainer.model)
    history = []
    for _ in range(2):
        result = trainer.train_round(weights)
        assert result.privacy_unit == "patient"
        weights = weights + result.delta_flat
        history += result.segments
    assert history[0].sample_rate == pytest.approx(40 / train.num_patients)
    assert history[0].steps == round(train.num_patients / 40)
    epsilon = compose_epsilon(history, delta=1e-5)
    assert 3.95 <= epsilon <= 4.0
    model = mlp()
    load_flat_parameters(model, weights)
    auc = metrics_from_scores(predict_scores(model, held_out.features), held_out.labels).auc
    assert auc > 0.8
