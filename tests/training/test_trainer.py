"""Private local training: real Opacus DP-SGD on small synthetic data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.core.errors import ConfigError, DataError
from common.models.build import build_model
from common.models.layout import flatten_parameters, load_flat_parameters
from common.models.tables.mlp import TabularMLP
from common.privacy.accountant import Segment, compose_epsilon
from common.releases.evaluation import metrics_from_scores
from site_agent.data import SiteData
from site_agent.device import select_device
from site_agent.ghost_clipping import conv_ghost_norms
from site_agent.grad_sample_mode import (
    GRAD_SAMPLE_MODES,
    choose_grad_sample_mode,
    measure_grad_sample_modes,
    pick_faster_mode,
)
from site_agent.synthetic import FEATURES
from site_agent.trainer import LocalTrainer, predict_scores
from site_agent.training_config import TrainingConfig
from tests.training.helpers import multiclass_metrics_from_scores

ROUNDS = 3
BASE = TrainingConfig(
    batch_size=64,
    max_physical_batch_size=256,
    lr=0.5,
    target_epsilon=4.0,
    delta=1e-5,
    planned_rounds=ROUNDS,
    privacy_unit="record",
    grad_sample_mode="ghost",
    device="cpu",
)


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)  # same initial model for every trainer
    return TabularMLP(len(FEATURES))


def run_rounds(trainer: LocalTrainer, rounds: int) -> tuple[np.ndarray, list[Segment]]:
    weights = flatten_parameters(trainer.model)
    history: list[Segment] = []
    for _ in range(rounds):
        planned = trainer.planned_segments()
        result = trainer.train_round(weights)
        assert result.segments == planned  # what the ledger wrote ahead is what ran
        assert result.delta_flat.dtype == np.float32
        weights = weights + result.delta_flat
        history += result.segments
    return weights, history


def auc_of(weights: np.ndarray, held_out: SiteData) -> float:
    model = mlp()
    load_flat_parameters(model, weights)
    return metrics_from_scores(predict_scores(model, held_out.features), held_out.labels).auc


def test_dp_training_learns_and_spends_exactly_the_planned_budget(site_split) -> None:
    train, held_out = site_split
    trainer = LocalTrainer(mlp, train, BASE, seed=1)
    assert trainer.grad_sample_mode == "ghost" and trainer.privacy_unit == "record"
    assert trainer.sample_rate == pytest.approx(64 / len(train))
    before = auc_of(flatten_parameters(trainer.model), held_out)
    weights, history = run_rounds(trainer, ROUNDS)
    after = auc_of(weights, held_out)
    assert after > max(before, 0.5) + 0.2, (before, after)
    assert after > 0.8
    epsilon = compose_epsilon(history, delta=BASE.delta)
    # Calibrated once for the whole schedule: the target holds at the end, and is nearly met.
    assert BASE.target_epsilon - 0.05 <= epsilon <= BASE.target_epsilon
    one_round = compose_epsilon(history[:1], delta=BASE.delta)
    assert one_round < 0.75 * epsilon  # not a per-round calibration


@pytest.mark.parametrize("max_grad_norm", [1.0, 1e-3])  # 1e-3: every record is clipped
def test_ghost_and_hooks_compute_the_same_step(site_split, max_grad_norm: float) -> None:
    # Why `auto` may choose between them by timing alone: the same clipped sum and noise.
    train, _ = site_split
    config = TrainingConfig(**{**BASE.__dict__, "max_grad_norm": max_grad_norm})
    ghost = LocalTrainer(mlp, train, config, seed=3)
    hooks = LocalTrainer(
        mlp, train, TrainingConfig(**{**config.__dict__, "grad_sample_mode": "hooks"}), seed=3
    )
    assert (ghost.grad_sample_mode, hooks.grad_sample_mode) == ("ghost", "hooks")
    start = flatten_parameters(ghost.model)
    a = ghost.train_round(start, local_epochs=1)
    b = hooks.train_round(start, local_epochs=1)
    # Same Poisson batches and noise (same seed), clipped per sample either way.
    np.testing.assert_allclose(a.delta_flat, b.delta_flat, rtol=1e-4, atol=1e-5)
    assert np.linalg.norm(a.delta_flat) > 0


def test_physical_batch_splitting_does_not_change_the_step(site_split) -> None:
    train, _ = site_split
    whole = LocalTrainer(mlp, train, BASE, seed=4)
    split = LocalTrainer(
        mlp, train, TrainingConfig(**{**BASE.__dict__, "max_physical_batch_size": 16}), seed=4
    )
    start = flatten_parameters(whole.model)
    a = whole.train_round(start)
    b = split.train_round(start)
    np.testing.assert_allclose(a.delta_flat, b.delta_flat, rtol=1e-4, atol=1e-5)


def test_different_seeds_give_different_noise(site_split) -> None:
    train, _ = site_split
    start = flatten_parameters(mlp())
    a = LocalTrainer(mlp, train, BASE, seed=5).train_round(start)
    b = LocalTrainer(mlp, train, BASE, seed=6).train_round(start)
    assert not np.allclose(a.delta_flat, b.delta_flat)


def test_nonprivate_baseline_and_fedprox_pull(site_split) -> None:
    train, _ = site_split
    config = TrainingConfig(**{**BASE.__dict__, "dp": False})
    free = LocalTrainer(mlp, train, config, seed=0)
    assert free.planned_segments() == [] and free.noise_multiplier == 0.0
    start = flatten_parameters(free.model)
    plain = free.train_round(start, local_epochs=2)
    assert plain.privacy_unit == "none" and plain.segments == []
    prox = LocalTrainer(mlp, train, config, seed=0).train_round(
        start, local_epochs=2, fedprox_mu=1.0
    )
    # The proximal term pulls towards the global weights: a strictly smaller update.
    assert np.linalg.norm(prox.delta_flat) < 0.8 * np.linalg.norm(plain.delta_flat)


def test_fedprox_with_dp_runs_and_shrinks_update(site_split) -> None:
    train, _ = site_split
    start = flatten_parameters(mlp())
    plain = LocalTrainer(mlp, train, BASE, seed=8).train_round(start)
    prox = LocalTrainer(mlp, train, BASE, seed=8).train_round(start, fedprox_mu=1.0)
    assert np.linalg.norm(prox.delta_flat) < np.linalg.norm(plain.delta_flat)


def test_conv_model_uses_opacus_two_pass_ghost_and_matches_hooks() -> None:
    # Conv/GroupNorm layers are not book-keepable: ghost mode keeps Opacus' own two
    # backward passes there, and must still compute the same step as hook mode.
    rng = np.random.default_rng(0)
    images = SiteData(
        features=rng.normal(size=(120, 1, 8, 8)).astype(np.float32),
        labels=rng.integers(0, 2, size=120),
        patient_ids=None,
    )
    deltas = {}
    for mode in ("ghost", "hooks"):
        config = TrainingConfig(
            **{**BASE.__dict__, "batch_size": 30, "grad_sample_mode": mode, "planned_rounds": 1}
        )

        def cnn() -> torch.nn.Module:
            torch.manual_seed(0)
            return _BinaryHead(build_model("cnn", in_channels=1, num_classes=2))

        trainer = LocalTrainer(cnn, images, config, seed=0)
        assert trainer.grad_sample_mode == mode
        assert getattr(trainer.trained_module, "bookkeeping", False) is False
        deltas[mode] = trainer.train_round(flatten_parameters(trainer.model)).delta_flat
    assert np.isfinite(deltas["ghost"]).all() and np.linalg.norm(deltas["ghost"]) > 0
    np.testing.assert_allclose(deltas["ghost"], deltas["hooks"], rtol=1e-3, atol=1e-5)


def test_mlp_ghost_uses_bookkeeping(site_split) -> None:
    train, _ = site_split
    trainer = LocalTrainer(mlp, train, BASE, seed=0)
    assert trainer.trained_module.bookkeeping is True


class _BinaryHead(torch.nn.Module):
    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).squeeze(-1)


def test_config_and_data_errors(site_split) -> None:
    train, _ = site_split
    with pytest.raises(ConfigError):
        TrainingConfig(batch_size=0)
    with pytest.raises(ConfigError) as info:
        LocalTrainer(mlp, train, TrainingConfig(**{**BASE.__dict__, "batch_size": 10**6}), seed=0)
    assert info.value.field == "batch_size"
    tiny = train.subset(np.arange(20))
    with pytest.raises(DataError, match="too few"):
        LocalTrainer(mlp, tiny, BASE, seed=0)
    no_ids = SiteData(train.features, train.labels, None)
    with pytest.raises(ConfigError):
        LocalTrainer(
            mlp, no_ids, TrainingConfig(**{**BASE.__dict__, "privacy_unit": "patient"}), seed=0
        )


def test_device_selection() -> None:
    assert select_device("cpu").type == "cpu"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError):
            select_device("cuda")
    with pytest.raises(ConfigError):
        select_device("tpu")


def three_classes(data: SiteData) -> SiteData:
    """A learnable 3-class label from the synthetic features (tertiles of a projection)."""
    score = data.features[:, 0] + 0.5 * data.features[:, 1]
    labels = np.digitize(score, np.quantile(score, [1 / 3, 2 / 3]))
    return SiteData(data.features, labels.astype(np.int64), data.patient_ids)


def multiclass_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlp", in_features=len(FEATURES), num_classes=3)


MULTI = TrainingConfig(**{**BASE.__dict__, "task": "multiclass", "num_classes": 3})


def test_multiclass_cross_entropy_ghost_matches_hooks_and_learns(site_split) -> None:
    train, held_out = (three_classes(d) for d in site_split)
    deltas = {}
    for mode in ("ghost", "hooks"):
        config = TrainingConfig(**{**MULTI.__dict__, "grad_sample_mode": mode})
        trainer = LocalTrainer(multiclass_mlp, train, config, seed=3)
        assert trainer.grad_sample_mode == mode
        deltas[mode] = trainer.train_round(flatten_parameters(trainer.model)).delta_flat
    np.testing.assert_allclose(deltas["ghost"], deltas["hooks"], rtol=1e-3, atol=1e-5)
    trainer = LocalTrainer(multiclass_mlp, train, MULTI, seed=3)
    assert trainer.trained_module.bookkeeping is True  # CE keeps the one-pass path
    weights, _ = run_rounds(trainer, ROUNDS)
    model = multiclass_mlp()
    load_flat_parameters(model, weights)
    scores = predict_scores(model, held_out.features, task="multiclass")
    assert scores.shape == (len(held_out), 3)
    metrics = multiclass_metrics_from_scores(scores, held_out.labels)
    assert min(metrics.per_class_auc) > 0.7


def test_multiclass_patient_level_and_nonprivate_run(site_split) -> None:
    train, _ = site_split
    train = three_classes(train)
    for unit, dp in (("patient", True), ("auto", False)):
        config = TrainingConfig(**{**MULTI.__dict__, "privacy_unit": unit, "dp": dp})
        trainer = LocalTrainer(multiclass_mlp, train, config, seed=0)
        result = trainer.train_round(flatten_parameters(trainer.model))
        assert np.isfinite(result.mean_loss) and np.linalg.norm(result.delta_flat) > 0


def test_labels_outside_the_classes_are_a_data_error(site_split) -> None:
    train, _ = site_split
    bad = SiteData(train.features, np.full(len(train), 3), train.patient_ids, source="x.csv")
    with pytest.raises(DataError, match=r"class indices 0\.\.2"):
        LocalTrainer(multiclass_mlp, bad, MULTI, seed=0)
    with pytest.raises(ConfigError):
        TrainingConfig(task="multiclass", num_classes=2)


def test_pick_faster_mode_takes_the_smaller_measured_time() -> None:
    assert pick_faster_mode({"ghost": 2.0, "hooks": 1.0}) == "hooks"
    assert pick_faster_mode({"ghost": 1.0, "hooks": 2.0}) == "ghost"
    assert pick_faster_mode({"ghost": 1.0, "hooks": 1.0}) == "ghost"  # tie: ghost
    assert pick_faster_mode({"hooks": 5.0}) == "hooks"  # ghost could not run
    assert pick_faster_mode({"ghost": float("nan"), "hooks": 3.0}) == "hooks"
    assert pick_faster_mode({"ghost": 0.0, "hooks": 3.0, "other": 0.1}) == "hooks"
    with pytest.raises(ConfigError, match="grad_sample_mode"):
        pick_faster_mode({})
    with pytest.raises(ConfigError, match="grad_sample_mode"):
        pick_faster_mode({"ghost": float("inf")})


@pytest.mark.parametrize(
    ("name", "shape", "kwargs"),
    [("mlp", (5,), {"in_features": 5}), ("cnn", (1, 8, 8), {"in_channels": 1, "image_size": 8})],
)
def test_measurement_returns_a_choice_and_leaves_the_model_alone(
    name: str, shape: tuple[int, ...], kwargs: dict[str, int]
) -> None:
    torch.manual_seed(0)
    model = build_model(name, **kwargs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    config = TrainingConfig(**{**BASE.__dict__, "batch_size": 16, "grad_sample_mode": "auto"})
    seconds = measure_grad_sample_modes(
        model, input_shape=shape, config=config, device=torch.device("cpu"), steps=2
    )
    assert set(seconds) == set(GRAD_SAMPLE_MODES)
    assert all(np.isfinite(t) and t > 0 for t in seconds.values())
    assert pick_faster_mode(seconds) in GRAD_SAMPLE_MODES
    assert torch.equal(torch.get_rng_state(), rng_before)  # global RNG untouched
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    # No Opacus hook was left on the model: a plain backward pass stores no per-sample grads.
    model(torch.randn(4, *shape)).sum().backward()
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_auto_measures_once_logs_the_choice_and_trains_as_that_mode(
    site_split, caplog: pytest.LogCaptureFixture
) -> None:
    train, held_out = site_split
    config = TrainingConfig(**{**BASE.__dict__, "grad_sample_mode": "auto"})
    with caplog.at_level("INFO", logger="site_agent.trainer"):
        auto = LocalTrainer(mlp, train, config, seed=9)
    choice = auto.grad_sample_choice
    assert choice is not None and choice.source == "measured"
    assert set(choice.seconds_per_step) == set(GRAD_SAMPLE_MODES)
    assert auto.grad_sample_mode == choice.mode == pick_faster_mode(choice.seconds_per_step)
    assert choice.batch_shape == (64, len(FEATURES)) and choice.device == "cpu"
    assert any(
        "grad_sample_mode auto" in r.getMessage() and f"picked {choice.mode}" in r.getMessage()
        for r in caplog.records
    )
    weights, history = run_rounds(auto, 2)
    assert auto.grad_sample_choice is choice  # measured once per trainer, not per round
    assert auc_of(weights, held_out) > 0.7 and len(history) == 2
    # The measurement consumed none of the trainer's sampling or noise randomness: the
    # auto trainer takes exactly the step of a trainer configured with the mode it chose.
    start = flatten_parameters(mlp())
    measured = LocalTrainer(mlp, train, config, seed=10)
    fixed = TrainingConfig(**{**BASE.__dict__, "grad_sample_mode": measured.grad_sample_mode})
    configured = LocalTrainer(mlp, train, fixed, seed=10)
    assert configured.grad_sample_choice is not None
    assert configured.grad_sample_choice.source == "configured"
    np.testing.assert_array_equal(
        measured.train_round(start).delta_flat, configured.train_round(start).delta_flat
    )


def test_multi_process_rule_picks_ghost_for_linear_and_large_conv_models() -> None:
    assert choose_grad_sample_mode(build_model("mlp", in_features=3), "auto") == "ghost"
    assert choose_grad_sample_mode(build_model("cnn", in_channels=1), "auto") == "hooks"
    assert choose_grad_sample_mode(build_model("cnn", in_channels=1), "ghost") == "ghost"
    resnet = build_model("resnet18-gn", in_channels=1)
    assert choose_grad_sample_mode(resnet, "auto") == "ghost"
    assert choose_grad_sample_mode(resnet, "hooks") == "hooks"


@pytest.mark.parametrize(
    ("conv", "size"),
    [
        (torch.nn.Conv2d(3, 4, 3, padding=1), 10),  # large T: explicit per-sample grads
        (torch.nn.Conv2d(8, 64, 3, stride=2, padding=1, bias=False), 4),  # small T: ghost
        (torch.nn.Conv2d(2, 4, 3, groups=2), 6),  # grouped: Opacus' sampler
    ],
)
def test_conv_ghost_norms_equal_explicit_per_sample_gradient_norms(conv, size) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, conv.in_channels, size, size)
    out = conv(x)
    backprops = torch.randn_like(out)
    norms = conv_ghost_norms(conv, [x], backprops)
    for i in range(5):
        grads = torch.autograd.grad(
            (conv(x[i : i + 1]) * backprops[i : i + 1]).sum(), list(conv.parameters())
        )
        for param, grad in zip(conv.parameters(), grads):
            torch.testing.assert_close(norms[param][i], grad.norm(), rtol=1e-4, atol=1e-5)
