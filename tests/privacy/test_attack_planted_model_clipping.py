"""A coordinator serves a planted model (finite weights, NaN exactly on the records it
targets: tests/privacy/planted_models.py). In every clipping path the targeted unit
contributes exactly zero, so the clipped sum is finite and equals the sum without that
unit (its sensitivity stays C), and the site's training ends in a finite update it can
upload: no data-dependent dropout. Each test fails on the code before non-finite units
were zeroed (a NaN sum, or an exception)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from common.models.images.cnn import SmallCNN
from common.models.layout import flatten_parameters
from common.models.tables.mlp import TabularMLP
from site_agent.data import SiteData
from site_agent.finite_clipping import (
    MAX_RECORD_GRADIENT_NORM,
    clip_factors,
    units_within_record_bound,
)
from site_agent.ghost_clipping import clipped_backward
from site_agent.grad_sample_mode import dp_training_objects
from site_agent.patient_dp import clipped_gradient_sum
from site_agent.patient_steps import clipped_patient_sum
from site_agent.task_loss import TaskLoss, record_loss_fn
from site_agent.trainer import LocalTrainer
from site_agent.training_config import TrainingConfig
from site_agent.unit_clipping import UnitClipper
from tests.privacy.planted_models import cnn_activation, plant_cnn, plant_tabular

FEATURES = 6
CLIP = 1.0


TARGETED = (0, 1, 2, 3)
"""The features the planted softmax regression sums (the MLP reads the first)."""


def task(arch: str) -> str:
    """The MLP is binary; the logistic regression has three classes (softmax regression:
    a binary one cannot be planted, tests/privacy/planted_models.py)."""
    return "binary" if arch == "mlp" else "multiclass"


def planted(arch: str) -> nn.Module:
    torch.manual_seed(0)
    # The registry's `logistic` is the MLP without hidden layers.
    model = (TabularMLP(FEATURES, hidden=(16, 8)) if arch == "mlp"
             else TabularMLP(FEATURES, hidden=(), outputs=3))
    return plant_tabular(model, features=TARGETED, threshold=3.0 if arch == "mlp" else 6.0)


def records(n: int, *, target: int | None, seed: int = 1,
            arch: str = "mlp") -> tuple[torch.Tensor, torch.Tensor]:
    """`n` standardised records (features within +-1), the one at `target` with the
    targeted features at 10; binary labels, or three classes for the logistic model."""
    generator = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, FEATURES, generator=generator) * 2 - 1)
    if task(arch) == "binary":
        y = torch.randint(0, 2, (n,), generator=generator).float()
    else:
        y = torch.randint(0, 3, (n,), generator=generator)
    if target is not None:
        x[target, list(TARGETED)] = 10.0
    return x, y


def flat(model: nn.Module, sums: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([sums[name].reshape(-1) for name, _ in model.named_parameters()])


def test_the_planted_models_are_nan_exactly_on_their_targets() -> None:
    for arch in ("mlp", "logistic"):
        x, y = records(40, target=7, arch=arch)
        losses = TaskLoss(task(arch), "none")(planted(arch)(x), y)  # type: ignore[arg-type]
        assert torch.isnan(losses[7]), arch
        assert torch.isfinite(torch.cat([losses[:7], losses[8:]])).all(), arch
        assert all(torch.isfinite(p).all() for p in planted(arch).parameters())


def test_clip_factors_zero_exactly_the_non_finite_units() -> None:
    squared = torch.tensor([0.25, float("nan"), float("inf"), 4.0, -1e-12, 1e300],
                           dtype=torch.float64)
    factor = clip_factors(squared, max_grad_norm=1.0)
    assert factor.dtype == torch.float64
    assert factor[1] == 0 and factor[2] == 0
    assert factor[0] == 1.0 and factor[4] == 1.0  # inside the ball (or float noise)
    assert factor[3] == pytest.approx(1 / (2 + 1e-6)) and 0 < factor[5] < 1e-149


# ----------------------------------------------------------------- patient level


PATIENTS = [3, 1, 4, 2, 5, 1, 2]
TARGET_PATIENT = 2  # holds records 4..7


def patients(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([p for p, n in enumerate(sizes) for _ in range(n)])


def without_target(x: torch.Tensor, y: torch.Tensor,
                   ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keep = ids != TARGET_PATIENT
    return x[keep], y[keep], torch.where(ids[keep] > TARGET_PATIENT, ids[keep] - 1, ids[keep])


@pytest.mark.parametrize("arch", ["mlp", "logistic"])
def test_attack_planted_patient_contributes_zero_to_the_unit_level_clipped_sum(
        arch: str) -> None:
    """The one-pass unit clipper and the per-record reference: with the targeted
    patient's records in the batch, the clipped sum is finite and is the sum without
    them."""
    ids = patients(PATIENTS)
    x, y = records(len(ids), target=None, arch=arch)
    x[ids == TARGET_PATIENT, list(TARGETED)] = 10.0
    model = planted(arch)
    x_out, y_out, ids_out = without_target(x, y, ids)

    clipper = UnitClipper(model, max_grad_norm=CLIP,
                          loss_per_record=TaskLoss(task(arch), "none"))  # type: ignore[arg-type]
    with_patient, _ = clipper.clipped_sum(x, y, ids, len(PATIENTS))
    without, _ = clipper.clipped_sum(x_out, y_out, ids_out, len(PATIENTS) - 1)
    assert torch.isfinite(flat(model, with_patient)).all()
    torch.testing.assert_close(flat(model, with_patient), flat(model, without),
                               rtol=1e-5, atol=1e-6)

    loss = record_loss_fn(task(arch))  # type: ignore[arg-type]
    reference = clipped_gradient_sum(model, x, y, ids, max_grad_norm=CLIP, loss_fn=loss)
    reference_without = clipped_gradient_sum(model, x_out, y_out, ids_out, max_grad_norm=CLIP,
                                             loss_fn=loss)
    assert torch.isfinite(reference).all()
    torch.testing.assert_close(reference, reference_without, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat(model, without), reference_without, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("one_pass", [True, False])
def test_attack_planted_patient_larger_than_a_physical_batch_contributes_zero(
        one_pass: bool) -> None:
    """A targeted patient with more records than a physical batch (summed over chunks,
    then clipped alone), beside patients in groups: still exactly zero."""
    sizes = [2, 3, 9, 1, 2]  # patient 2 holds 9 records, the physical batch 4
    ids = patients(sizes)
    x, y = records(len(ids), target=None, seed=3)
    x[ids == TARGET_PATIENT, 0] = 10.0
    model = planted("mlp")
    config = TrainingConfig(max_physical_batch_size=4, max_grad_norm=CLIP, device="cpu")
    clipper = (UnitClipper(model, max_grad_norm=CLIP,
                           loss_per_record=TaskLoss("binary", "none")) if one_pass else None)
    index = torch.arange(len(ids))

    def clipped(keep: torch.Tensor) -> torch.Tensor:
        dense = torch.unique(ids[keep], return_inverse=True)[1]
        sums, _ = clipped_patient_sum(
            model, index[keep], dense, int(dense.max()) + 1,
            inputs=lambda i: x[i], labels=y, record_loss=record_loss_fn("binary"),
            config=config, device=torch.device("cpu"), clipper=clipper)
        return flat(model, sums)

    everyone = clipped(torch.ones(len(ids), dtype=torch.bool))
    assert torch.isfinite(everyone).all()
    torch.testing.assert_close(everyone, clipped(ids != TARGET_PATIENT), rtol=1e-5, atol=1e-6)


def test_a_unit_holding_a_record_beyond_the_record_bound_is_left_out() -> None:
    """Where the records of one unit cancel, its norm can be small while single records'
    terms in the book-keeping products are near float32's end (how a BLAS orders their
    sum would then decide whether it overflows): a unit with a record past
    `MAX_RECORD_GRADIENT_NORM` (or a non-finite one) contributes zero whatever its norm."""
    bound = MAX_RECORD_GRADIENT_NORM**2
    record_squared = torch.tensor([1.0, 2 * bound, 3.0, float("nan"), 4.0, bound],
                                  dtype=torch.float64)
    unit = torch.tensor([0, 1, 1, 2, 3, 4])
    keep = units_within_record_bound(record_squared, unit, 5)
    assert keep.tolist() == [True, False, False, True, True]


# ------------------------------------------------------------------ record level


def conv_images(n: int, *, target: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth random 16x16 images; the one at `target` black with one white pixel."""
    generator = torch.Generator().manual_seed(5)
    coarse = torch.rand(n, 1, 4, 4, generator=generator)
    x = nn.functional.interpolate(coarse, size=(16, 16), mode="bilinear", align_corners=False)
    if target is not None:
        x[target] = 0.0
        x[target, 0, 8, 8] = 1.0
    return x, torch.randint(0, 2, (n,), generator=generator).float()


def planted_cnn(images: torch.Tensor, target: int) -> nn.Module:
    """The cnn planted with a threshold between the target's activation and the rest."""
    activation = cnn_activation(images)
    others = torch.cat([activation[:target], activation[target + 1:]])
    assert activation[target] > others.max() + 1.0, "the target must stand out"
    torch.manual_seed(0)
    return plant_cnn(SmallCNN(in_channels=1, num_classes=1),
                     threshold=float(activation[target] + others.max()) / 2)


def record_level_step(model: nn.Module, mode: str, x: torch.Tensor, y: torch.Tensor, *,
                      classes: int = 2) -> torch.Tensor:
    """One noiseless record-level DP-SGD step of `mode` on (x, y): the clipped sum the
    DP optimizer is left with (its `.grad` times the expected batch)."""
    config = TrainingConfig(batch_size=len(x), max_grad_norm=CLIP, device="cpu",
                            privacy_unit="record", num_classes=classes,
                            task="binary" if classes == 2 else "multiclass")
    module, optimizer, criterion = dp_training_objects(
        mode, model, config=config, noise_multiplier=0.0, generator=torch.Generator())
    optimizer.signal_skip_step(do_skip=False)
    clipped_backward(module, criterion, x, y)
    assert optimizer.pre_step()
    out = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * len(x)
    optimizer.zero_grad(set_to_none=True)
    for hook in getattr(module, "autograd_grad_sample_hooks", []):
        hook.remove()
    return out


@pytest.mark.parametrize("mode", ["ghost", "hooks"])
@pytest.mark.parametrize("arch", ["mlp", "logistic", "cnn"])
def test_attack_planted_record_contributes_zero_to_the_record_level_clipped_sum(
        arch: str, mode: str) -> None:
    """Record-level DP-SGD as the trainer runs it: ghost clipping (book-keeping for the
    tables, Opacus' two passes for the conv net) and per-sample hooks."""
    if arch == "cnn":
        x, y = conv_images(12, target=4)

        def build() -> nn.Module:
            return planted_cnn(x, target=4)
    else:
        x, y = records(24, target=4, arch=arch)

        def build() -> nn.Module:
            return planted(arch)
    classes = 3 if arch == "logistic" else 2
    keep = torch.arange(len(x)) != 4
    everyone = record_level_step(build(), mode, x, y, classes=classes)
    assert torch.isfinite(everyone).all()
    torch.testing.assert_close(
        everyone, record_level_step(build(), mode, x[keep], y[keep], classes=classes),
        rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------- a whole round


@pytest.mark.parametrize(("unit", "mode"), [("record", "ghost"), ("record", "hooks"),
                                            ("patient", "auto")])
@pytest.mark.parametrize("arch", ["mlp", "logistic"])
def test_attack_training_on_a_planted_model_ends_in_a_finite_update(
        arch: str, unit: str, mode: str) -> None:
    """LocalTrainer on a site holding the targeted patient, every unit sampled each step:
    DP-SGD ends in a finite update (the site uploads it), whatever the path."""
    n = 120
    x, y = records(n, target=None, seed=7, arch=arch)
    ids = np.repeat(np.arange(n // 2), 2)
    x[:2, list(TARGETED)] = 10.0  # patient 0, both records
    data = SiteData(x.numpy(), y.numpy(), ids if unit == "patient" else None)
    model = planted(arch)
    config = TrainingConfig(batch_size=n // 2 if unit == "patient" else n, lr=0.1,
                            target_epsilon=8.0, delta=1e-3, planned_rounds=1, device="cpu",
                            privacy_unit=unit, grad_sample_mode=mode,  # type: ignore[arg-type]
                            noise_multiplier=1.0, task=task(arch),  # type: ignore[arg-type]
                            num_classes=3 if arch == "logistic" else 2)
    trainer = LocalTrainer(lambda: planted(arch), data, config, seed=3)
    result = trainer.train_round(flatten_parameters(model))
    assert np.isfinite(result.delta_flat).all()
