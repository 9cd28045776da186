"""Unit-level ghost clipping is exact: one pass gives the per-record reference's sum."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.models.tables.mlp import TabularMLP
from site_agent.patient_dp import clipped_gradient_sum
from site_agent.patient_steps import clipped_patient_sum, patient_groups
from site_agent.task_loss import TaskLoss, record_loss_fn
from site_agent.training_config import TrainingConfig
from site_agent.unit_clipping import UnitClipper, supports_unit_clipping, unit_pairs


class _SmallConv(nn.Module):
    """Conv2d (padded, strided, with and without bias), GroupNorm, LayerNorm, Linear."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.ReLU(),
            nn.Conv2d(16, 64, 3), nn.ReLU(),  # deep, small map: the pair Gram rule
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(64), nn.Linear(64, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _ids(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([p for p, n in enumerate(sizes) for _ in range(n)])


def _flat(model: nn.Module, sums: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([sums[name].reshape(-1) for name, _ in model.named_parameters()])


def test_unit_pairs_are_each_pair_of_distinct_same_unit_records_once() -> None:
    unit = torch.tensor([2, 0, 2, 1, 2])
    i, j = unit_pairs(unit, 3)
    got = sorted(zip(i.tolist(), j.tolist()))
    want = sorted(
        (min(a, b), max(a, b)) for a in range(5) for b in range(a + 1, 5) if unit[a] == unit[b]
    )
    got = sorted((min(a, b), max(a, b)) for a, b in got)
    assert got == want


@pytest.mark.parametrize("clip", [0.05, 1.0, 100.0])
@pytest.mark.parametrize("task", ["binary", "multiclass"])
@pytest.mark.parametrize("arch", ["mlp", "conv"])
def test_one_pass_clipped_sum_equals_per_record_reference(arch: str, task: str,
                                                          clip: float) -> None:
    torch.manual_seed(3)
    classes = 1 if task == "binary" else 3
    sizes = [1, 3, 2, 7, 1, 4]  # the 7-record patient makes explicit and pair rules meet
    ids = _ids(sizes)
    if arch == "mlp":
        model: nn.Module = TabularMLP(6, hidden=(32, 16))  # pair rule, then explicit
        if classes > 1:
            model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, classes))
        x = torch.randn(len(ids), 6) * 2
    else:
        model = _SmallConv(classes)
        x = torch.randn(len(ids), 3, 8, 8)
    if task == "binary":
        y = torch.randint(0, 2, (len(ids),)).float()
        loss_task = "binary"
    else:
        y = torch.randint(0, classes, (len(ids),))
        loss_task = "multiclass"
    assert supports_unit_clipping(model)
    reference = clipped_gradient_sum(
        model, x, y, ids, max_grad_norm=clip, loss_fn=record_loss_fn(loss_task)
    )
    clipper = UnitClipper(model, max_grad_norm=clip, loss_per_record=TaskLoss(loss_task, "none"))
    sums, loss = clipper.clipped_sum(x, y, ids, len(sizes))
    torch.testing.assert_close(_flat(model, sums), reference, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, TaskLoss(loss_task, "sum")(model(x), y))
    assert all(p.grad is None for p in model.parameters())  # nothing else written


@pytest.mark.parametrize("physical", [1, 3, 5, 8, 1000])
def test_split_steps_equal_the_unsplit_sum(physical: int) -> None:
    """A physical batch smaller than a step (even than one patient) splits the step
    into whole-patient groups and chunks; the clipped sum does not change."""
    torch.manual_seed(4)
    model = _SmallConv(1)
    sizes = [2, 6, 1, 3, 1]
    ids = _ids(sizes)
    x, y = torch.randn(len(ids), 3, 8, 8), torch.randint(0, 2, (len(ids),)).float()
    perm = torch.randperm(len(ids))  # records arrive in sampled order, not by patient
    config = TrainingConfig(batch_size=4, max_physical_batch_size=physical, max_grad_norm=0.3)
    clipper = UnitClipper(model, max_grad_norm=0.3, loss_per_record=TaskLoss("binary", "none"))
    sums, loss = clipped_patient_sum(
        model, perm, ids[perm], len(sizes), inputs=lambda r: x[r], labels=y,
        record_loss=record_loss_fn("binary"), config=config, device=torch.device("cpu"),
        clipper=clipper,
    )
    reference = clipped_gradient_sum(model, x, y, ids, max_grad_norm=0.3)
    torch.testing.assert_close(_flat(model, sums), reference, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss, TaskLoss("binary", "sum")(model(x), y))


def test_patient_groups_respect_the_limit() -> None:
    assert patient_groups([2, 6, 1, 3, 1], 5) == [(0, 1), (1, 2), (2, 5)]
    assert patient_groups([1, 1, 1], 1) == [(0, 1), (1, 2), (2, 3)]


def test_a_layer_applied_twice_is_refused() -> None:
    layer = nn.Linear(3, 3)
    model = nn.Sequential(layer, nn.ReLU(), layer)
    clipper = UnitClipper(model, max_grad_norm=1.0,
                          loss_per_record=lambda out, y: out.sum(dim=1) * y)
    from common.core.errors import ConfigError

    with pytest.raises(ConfigError, match="once per forward"):
        clipper.clipped_sum(torch.randn(4, 3), torch.ones(4), torch.arange(4), 4)


def test_a_tiny_memory_budget_splits_steps_and_keeps_the_sum() -> None:
    """The physical batch comes from the budget; a budget below a patient batch splits
    each step into smaller physical batches, and the clipped sum is the unsplit one."""
    import numpy as np

    from common.core.errors import ConfigError
    from site_agent.data import SiteData
    from site_agent.memory_budget import estimate_step_memory
    from site_agent.trainer import LocalTrainer

    torch.manual_seed(5)
    sizes = [1 + p % 3 for p in range(60)]
    ids = _ids(sizes)
    x = np.random.default_rng(0).normal(size=(len(ids), 3, 8, 8)).astype(np.float32)
    y = (np.arange(len(ids)) % 2).astype(np.float64)
    data = SiteData(x, y, ids.numpy().astype(str), source="test images")
    probe = _SmallConv(1)
    step = estimate_step_memory(probe, (3, 8, 8), path="unit-ghost", device=torch.device("cpu"))
    assert step.fixed > 0 and step.per_record > 0

    def trainer(budget: int | None) -> LocalTrainer:
        config = TrainingConfig(batch_size=20, max_physical_batch_size=1024, memory_budget=budget,
                                noise_multiplier=1.0, max_grad_norm=0.3, delta=1e-3)
        torch.manual_seed(5)
        return LocalTrainer(lambda: _SmallConv(1), data, config, seed=1)

    roomy = trainer(step.fixed + 1000 * step.per_record)
    tight = trainer(step.fixed + 3 * step.per_record)
    assert roomy.config.max_physical_batch_size == 1000
    assert tight.config.max_physical_batch_size == 3
    assert tight.grad_sample_mode == "ghost-per-patient"
    records = torch.arange(len(ids))
    sums = []
    for t in (roomy, tight):
        clipped, _ = clipped_patient_sum(
            t.model, records, ids, len(sizes), inputs=t._inputs, labels=t.labels,
            record_loss=record_loss_fn("binary"), config=t.config, device=t.device,
            clipper=t._unit_clipper,
        )
        sums.append(_flat(t.model, clipped))
    torch.testing.assert_close(sums[0], sums[1], rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError, match="memory_budget"):
        trainer(step.fixed + step.per_record // 2)


def test_an_in_place_change_of_a_layer_output_takes_the_reference_path() -> None:
    """ReLU(inplace=True) on a GroupNorm output would hand autograd the ReLU's gradient;
    the trainer notices on one forward pass and keeps the exact per-record path."""
    import numpy as np

    from site_agent.data import SiteData
    from site_agent.trainer import LocalTrainer

    def factory() -> nn.Module:
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(inplace=True),
                             nn.Flatten(), nn.Linear(4 * 4 * 4, 1))

    ids = np.array([str(p // 2) for p in range(120)])
    data = SiteData(np.zeros((120, 1, 6, 6), np.float32), np.zeros(120), ids, source="t")
    config = TrainingConfig(batch_size=10, noise_multiplier=1.0, delta=1e-3)
    trainer = LocalTrainer(factory, data, config, seed=0)
    assert trainer.privacy_unit == "patient"
    assert trainer.grad_sample_mode == "functorch-per-patient"
    clipper = UnitClipper(factory(), max_grad_norm=1.0,
                          loss_per_record=TaskLoss("binary", "none"))
    from common.core.errors import ConfigError

    with pytest.raises(ConfigError, match="in-place"):
        clipper.check(torch.zeros(2, 1, 6, 6))


@pytest.mark.parametrize(("name", "size"), [("resnet18-gn", 16), ("resnet18-gn", 32), ("cnn", 16)])
def test_registry_image_models_match_the_reference(name: str, size: int) -> None:
    """The study models themselves (residual blocks, GroupNorm, strided convs), at the
    image sizes benchmarked (ResNet's last stage on 1x1 maps)."""
    from common.models import ModelSpec
    from common.models.build import build_model

    torch.manual_seed(6)
    model = build_model(ModelSpec(name=name), in_channels=1, image_size=size)
    ids = _ids([1, 3, 2])
    x, y = torch.randn(len(ids), 1, size, size), torch.randint(0, 2, (len(ids),)).float()
    clipper = UnitClipper(model, max_grad_norm=0.1, loss_per_record=TaskLoss("binary", "none"))
    clipper.check(x)
    sums, _ = clipper.clipped_sum(x, y, ids, 3)
    reference = clipped_gradient_sum(model, x, y, ids, max_grad_norm=0.1)
    torch.testing.assert_close(_flat(model, sums), reference, rtol=1e-4, atol=1e-6)


def test_unit_pairs_with_self_add_each_record_paired_with_itself() -> None:
    unit = torch.tensor([2, 0, 2, 1, 2, 0])
    i, j = unit_pairs(unit, 3, include_self=True)
    got = sorted((min(a, b), max(a, b)) for a, b in zip(i.tolist(), j.tolist()))
    want = sorted(
        (a, b) for a in range(6) for b in range(a, 6) if unit[a] == unit[b]
    )
    assert got == want


def test_a_clipper_reused_over_steps_of_different_sizes_stays_exact() -> None:
    """The pair gathers' workspace is kept from step to step: a larger step, then a
    smaller one, then a larger one again each give the per-record reference's sum."""
    torch.manual_seed(5)
    model = TabularMLP(6, hidden=(32, 16))
    clipper = UnitClipper(model, max_grad_norm=0.2, loss_per_record=TaskLoss("binary", "none"))
    for sizes in ([4, 1, 6, 2, 3], [2, 1], [1, 5, 5, 1, 3, 2, 2]):
        ids = _ids(sizes)
        perm = torch.randperm(len(ids))
        x, y = torch.randn(len(ids), 6) * 2, torch.randint(0, 2, (len(ids),)).float()
        reference = clipped_gradient_sum(
            model, x, y, ids, max_grad_norm=0.2, loss_fn=record_loss_fn("binary")
        )
        sums, _ = clipper.clipped_sum(x[perm], y[perm], ids[perm], len(sizes))
        torch.testing.assert_close(_flat(model, sums), reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("frozen", ["0.weight", "0.bias", "2.weight", "2.bias"])
def test_paired_linear_layers_with_a_frozen_weight_or_bias_stay_exact(frozen: str) -> None:
    """The paired layers' terms are summed together (one gather, one product with a 0/1
    segment matrix): a layer training its weight alone, or its bias alone, still adds
    exactly its own trainable parameters' Gram terms. Reference: each patient's gradient
    of the trainable parameters by autograd, clipped, summed."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                          nn.Linear(16, 1), nn.Flatten(0))
    dict(model.named_parameters())[frozen].requires_grad_(False)
    sizes = [3, 1, 5, 2, 4]
    ids = _ids(sizes)
    x, y = torch.randn(len(ids), 6) * 2, torch.randint(0, 2, (len(ids),)).float()
    clip = 0.3
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    loss = TaskLoss("binary", "sum")
    want = [torch.zeros_like(p) for _, p in trained]
    for unit in range(len(sizes)):
        rows = ids == unit
        grads = torch.autograd.grad(loss(model(x[rows]), y[rows]), [p for _, p in trained])
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        for acc, g in zip(want, grads):
            acc.add_(g * min(1.0, clip / (float(norm) + 1e-6)))
    clipper = UnitClipper(model, max_grad_norm=clip, loss_per_record=TaskLoss("binary", "none"))
    sums, _ = clipper.clipped_sum(x, y, ids, len(sizes))
    assert frozen not in sums
    got = torch.cat([sums[name].reshape(-1) for name, _ in trained])
    torch.testing.assert_close(got, torch.cat([w.reshape(-1) for w in want]),
                               rtol=1e-4, atol=1e-6)
