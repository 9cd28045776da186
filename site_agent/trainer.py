"""Private local training at a site: Opacus DP-SGD (ghost clipping), patient-level DP.

Privacy plan (DESIGN.md "Privacy"): the noise multiplier is calibrated ONCE for the
whole planned schedule, ``planned_rounds x local steps per round``, with the shared
accountant, so the site's target epsilon holds at the END of training rather than per
round. Each round's mechanism is known before it runs (`planned_segments`) so the site
agent can check its ledger and write the spend ahead of training.

Each local step is one Poisson-subsampled Gaussian mechanism (Abadi et al. 2016,
"Deep Learning with Differential Privacy", Alg. 1): every unit (record or patient) is
in the batch independently with probability q = batch_size / N; a fixed number of
steps per epoch, round(N / batch_size), is taken so the accounting is exact.

Record level uses Opacus: ghost clipping (Li et al. 2022, "Large Language Models Can
Be Strong Differentially Private Learners") or per-sample-gradient hooks; with
``grad_sample_mode = "auto"`` the trainer times a few steps of each on a copy of its
model, on its device, with synthetic inputs of its physical batch shape, and keeps the
faster (`measure_grad_sample_modes`, `pick_faster_mode`). For models whose
trainable layers are all Linear, the clipped sum comes from one backward pass by
book-keeping (Bu et al. 2023, see `_GhostModule`); other models run Opacus' two-pass
ghost clipping, with mixed ghost norms for Conv2d (Bu et al. 2022, see
`conv_ghost_norms`). Opacus' optimizers add the noise either way. The loss follows
the task: BCE with logits (binary) or cross-entropy (multi-class), `TaskLoss`.
Image datasets (`site_agent.imaging.ImageDataset`) are decoded per physical batch.
Large logical batches are split into physical batches with the protocol of Opacus'
`BatchMemoryManager` (`signal_skip_step`), driven directly from tensor indices: no
DataLoader, which is most of the per-step cost for a small tabular model
(docs/benchmarks.md has the measurements).

Randomness: batches and noise come from torch generators seeded by `seed`. Tests pass
fixed seeds; the site agent must pass a fresh seed from the OS CSPRNG for every
trainer, since noise an attacker can predict protects nothing.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping
from opacus.optimizers import (
    DistributedDPOptimizer,
    DistributedDPOptimizerFastGradientClipping,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
)
from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)
from opacus.utils.module_utils import trainable_modules
from opacus.utils.tensor_utils import unfold2d
from torch import nn

from common.errors import ConfigError, DataError
from common.models import Task, output_units
from common.models.build import check_dp_compatible
from common.models.layout import flatten_parameters, load_flat_parameters
from common.privacy.accountant import Segment, plan_noise_multiplier
from site_agent.data import SiteData, check_cohort_size
from site_agent.device import select_device
from site_agent.imaging import ImageDataset
from site_agent.patient_dp import (
    LossFn,
    PatientSampler,
    clipped_unit_sum,
    per_record_gradients,
)

logger = logging.getLogger(__name__)

PrivacyUnit = Literal["patient", "record", "none"]


@dataclass(frozen=True)
class TrainingConfig:
    """How a site trains locally. `batch_size` is the EXPECTED logical batch, in units."""

    batch_size: int = 256
    max_physical_batch_size: int = 1024
    local_epochs: int = 1
    lr: float = 0.1
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = 0.0
    max_grad_norm: float = 1.0
    target_epsilon: float = 8.0
    delta: float = 1e-5
    planned_rounds: int = 10
    fedprox_mu: float = 0.0
    accountant: str = "prv"
    dp: bool = True
    privacy_unit: Literal["auto", "patient", "record"] = "auto"
    grad_sample_mode: Literal["ghost", "hooks", "auto"] = "auto"
    device: str = "auto"
    # Issue 10: the DP count of units (sample rate and steps come from it, never from N)
    # and the noise multiplier the site planned from its ledger (None: plan here).
    released_units: int | None = None
    noise_multiplier: float | None = None
    task: Task = "binary"
    num_classes: int = 2

    def __post_init__(self) -> None:
        positive_ints = ("batch_size", "max_physical_batch_size", "local_epochs", "planned_rounds")
        for name in positive_ints:
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        for name in ("lr", "max_grad_norm", "target_epsilon"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be positive")
        if not 0.0 < self.delta < 1.0:
            raise ConfigError("delta", "must be in (0, 1)")
        if self.fedprox_mu < 0 or self.momentum < 0:
            raise ConfigError("fedprox_mu", "fedprox_mu and momentum must be >= 0")
        if self.optimizer not in ("sgd", "adam"):
            raise ConfigError("optimizer", "must be 'sgd' or 'adam'")
        if self.privacy_unit not in ("auto", "patient", "record"):
            raise ConfigError("privacy_unit", "must be 'auto', 'patient' or 'record'")
        if self.grad_sample_mode not in ("ghost", "hooks", "auto"):
            raise ConfigError("grad_sample_mode", "must be 'ghost', 'hooks' or 'auto'")
        output_units(task=self.task, num_classes=self.num_classes)  # raises ConfigError


@dataclass(frozen=True)
class TrainResult:
    """What one local round produced; `delta_flat` = new - global, float32."""

    delta_flat: np.ndarray
    num_samples: int
    segments: list[Segment]
    seconds: float
    device: str
    privacy_unit: PrivacyUnit
    mean_loss: float


def _linear_norm_sample(
    layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient norms of a Linear layer on [batch, features] inputs.

    Ghost norm (Goodfellow 2015; Li et al. 2022): the per-sample weight gradient is the
    outer product g_i a_i^T, whose Frobenius norm is ||g_i|| ||a_i||, so no per-sample
    gradient is ever materialised. Same maths as Opacus' sampler, without its generic
    einsum dispatch, which dominates the cost for small tabular models.
    """
    if backprops.dim() != 2:
        result: dict[nn.Parameter, torch.Tensor] = _OPACUS_LINEAR_NORM(
            layer, activations, backprops
        )
        return result
    g_sq = backprops.square().sum(dim=1)
    out = {}
    if layer.weight.requires_grad:
        a_sq = activations[0].to(backprops.dtype).square().sum(dim=1)
        out[layer.weight] = (g_sq * a_sq).sqrt()
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = g_sq.sqrt()
    return out


_OPACUS_LINEAR_NORM = GradSampleModuleFastGradientClipping.NORM_SAMPLERS[nn.Linear]


def _conv2d_norm_sample(
    layer: nn.Conv2d, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient norms of a Conv2d layer, by mixed ghost clipping.

    Bu et al. 2022 ("Scalable and Efficient Training of Large Convolutional Neural
    Networks with Differential Privacy", NeurIPS, Sec. 3): with A_i the unfolded
    input [D, T] and G_i the output gradient [O, T] of sample i, the weight gradient
    is G_i A_i^T and ||G_i A_i^T||_F^2 = <A_i^T A_i, G_i^T G_i> (two T x T Gram
    matrices, the "ghost norm"). That costs ~T^2 (D + O) per sample, the explicit
    per-sample gradient ~T D O; each layer takes the cheaper (ghost where
    2 T^2 < D O: the deep layers of a ResNet, which hold most parameters). Opacus
    has no conv norm sampler and materialises every per-sample gradient instead.
    """
    a = activations[0].to(backprops.dtype)
    n = a.shape[0]
    out: dict[Any, torch.Tensor] = {}  # keyed by parameter (stubs type it Tensor)
    unfolded = unfold2d(
        a,
        kernel_size=layer.kernel_size,
        padding=layer.padding,
        stride=layer.stride,
        dilation=layer.dilation,
    )  # [n, D, T]
    grads = backprops.reshape(n, layer.out_channels, -1)  # [n, O, T]
    if layer.weight.requires_grad:
        d, t = unfolded.shape[1], unfolded.shape[2]
        if 2 * t * t < d * layer.out_channels:
            gram_a = torch.bmm(unfolded.transpose(1, 2), unfolded)
            gram_g = torch.bmm(grads.transpose(1, 2), grads)
            squared = (gram_a * gram_g).sum(dim=(1, 2))
        else:
            squared = torch.bmm(grads, unfolded.transpose(1, 2)).square().sum(dim=(1, 2))
        out[layer.weight] = squared.clamp_min(0.0).sqrt()
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = grads.sum(dim=2).norm(dim=1)
    return out


def conv_ghost_norms(
    layer: nn.Conv2d, activations: list[torch.Tensor], backprops: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """Mixed ghost norms for plain (ungrouped, zero-padded) Conv2d; Opacus' own
    per-sample gradients (then their norms) for anything else."""
    if layer.groups == 1 and layer.padding_mode == "zeros":
        return _conv2d_norm_sample(layer, activations, backprops)
    samples = _OPACUS_CONV_GRAD(layer, activations, backprops)
    return {p: g.reshape(g.shape[0], -1).norm(dim=1) for p, g in samples.items()}


_OPACUS_CONV_GRAD = GradSampleModuleFastGradientClipping.GRAD_SAMPLERS[nn.Conv2d]


class _GhostModule(GradSampleModuleFastGradientClipping):  # type: ignore[misc]
    """Opacus ghost clipping, plus book-keeping for models made of Linear layers.

    Opacus' ghost clipping runs TWO backward passes: one to get per-sample gradient
    norms, a second on the re-weighted loss sum_i c_i * loss_i to get the clipped
    gradient sum. For a Linear layer on [batch, features] inputs that second pass is
    unnecessary: the clipped sum is (c * G)^T A, with A the layer inputs and G the
    per-sample output gradients the first pass already produced. This is the
    "book-keeping" trick of Bu et al. 2023 ("Differentially Private Optimization on
    Large Model at Small Cost", ICML, Alg. 1). Models with any other trainable layer
    (or Linear layers on sequences) keep Opacus' two-pass path unchanged.
    """

    NORM_SAMPLERS = {**GradSampleModuleFastGradientClipping.NORM_SAMPLERS}
    NORM_SAMPLERS[nn.Linear] = _linear_norm_sample
    NORM_SAMPLERS[nn.Conv2d] = conv_ghost_norms

    def __init__(self, m: nn.Module, **kwargs: Any) -> None:
        trainable = [module for _, module in trainable_modules(m)]
        # Book-keeping only where every trainable layer is a plain Linear layer.
        self.bookkeeping = bool(trainable) and all(type(x) is nn.Linear for x in trainable)
        self._bk_layers: list[nn.Linear] = [x for x in trainable if type(x) is nn.Linear]
        self._bk_records: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]] = []
        super().__init__(m, **kwargs)  # calls add_hooks

    def add_hooks(self, **kwargs: Any) -> None:
        """Opacus' hooks, or for book-keeping models one light forward hook per layer.

        Opacus wraps every module in full backward hooks; book-keeping only needs each
        Linear layer's input A and output (to differentiate the loss against).
        """
        if not self.bookkeeping:
            super().add_hooks(**kwargs)
            return
        self._module.autograd_grad_sample_hooks = []
        self.autograd_grad_sample_hooks = self._module.autograd_grad_sample_hooks
        for layer in self._bk_layers:
            self.autograd_grad_sample_hooks.append(
                layer.register_forward_hook(self._bk_forward_hook)
            )
        self.enable_hooks()

    def _bk_forward_hook(self, layer: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if not (self.hooks_enabled and layer.training and torch.is_grad_enabled()):
            return
        if output.dim() != 2 or any(r[0] is layer for r in self._bk_records):
            # Sequences or a layer applied twice (tied weights): not book-keepable.
            self._bk_records.clear()
            raise ConfigError("grad_sample_mode", "book-keeping needs each Linear once, 2-D")
        self._bk_records.append((layer, inputs[0].detach(), output))

    def bookkeeping_backward(self, loss_per_sample: torch.Tensor) -> None:
        """Set p.grad = sum_i min(1, C / ||g_i||) g_i with ONE pass over activations only.

        d(sum_i loss_i)/d(output) gives every sample's output gradient G (rows are
        independent across samples); the per-sample weight gradient is g_i a_i^T, so
        ||grad_i||^2 = sum_layers ||g_i||^2 (||a_i||^2 + 1 [bias]) and the clipped sum
        is (c * G)^T A. No parameter gradient of the unclipped loss is ever formed.
        """
        records, self._bk_records = self._bk_records, []
        if len(records) != len(self._bk_layers):
            raise ConfigError("grad_sample_mode", "book-keeping saw an incomplete forward pass")
        grads = torch.autograd.grad(loss_per_sample.sum(), [out for _, _, out in records])
        squared = torch.zeros_like(loss_per_sample, dtype=grads[0].dtype)
        for (layer, activation, _), g in zip(records, grads):
            factor = torch.zeros_like(squared)
            if layer.weight.requires_grad:
                factor = factor + activation.to(g.dtype).square().sum(dim=1)
            if layer.bias is not None and layer.bias.requires_grad:
                factor = factor + 1.0
            squared = squared + g.square().sum(dim=1) * factor
        norms = squared.sqrt()
        self._per_sample_gradient_norms = norms
        coefficients = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)  # as Opacus
        for (layer, activation, _), g in zip(records, grads):
            weighted = g * coefficients.unsqueeze(1)
            if layer.weight.requires_grad:
                layer.weight.grad = weighted.t().mm(activation.to(g.dtype))
            if layer.bias is not None and layer.bias.requires_grad:
                layer.bias.grad = weighted.sum(dim=0)


class _GhostLossTensor(DPTensorFastGradientClipping):  # type: ignore[misc]
    """Ghost-clipping loss whose backward uses book-keeping when the model allows it."""

    def backward(self) -> None:
        if getattr(self.module, "bookkeeping", False):
            self.module.bookkeeping_backward(self.loss_per_sample)
        else:
            super().backward()


class _GhostLoss(DPLossFastGradientClipping):  # type: ignore[misc]
    def __call__(self, *args: Any, **kwargs: Any) -> DPTensorFastGradientClipping:
        loss = super().__call__(*args, **kwargs)
        return _GhostLossTensor(self.module, self.optimizer, loss.loss_per_sample, "mean")


class _FlatNoiseMixin:
    """Draw the Gaussian noise of a step as ONE flat vector, split over the parameters.

    Same distribution as Opacus' per-tensor draws (N(0, (sigma C)^2) per coordinate),
    one generator call instead of one per tensor; and ghost and hook modes then
    consume the generator identically, so equal seeds give equal noise in both.
    """

    params: list[torch.nn.Parameter]
    expected_batch_size: float
    loss_reduction: str
    noise_multiplier: float
    max_grad_norm: float
    generator: torch.Generator | None

    def add_noise(self) -> None:
        params = self.params
        total = sum(p.numel() for p in params)
        noise = torch.normal(
            0.0,
            self.noise_multiplier * self.max_grad_norm,
            size=(total,),
            generator=self.generator,
            device=params[0].device,
        )
        # Opacus' scale_grad (divide by the expected batch size) is fused in here.
        scale = 1.0 / self.expected_batch_size if self.loss_reduction == "mean" else 1.0
        offset = 0
        for p in params:
            n = p.numel()
            summed = p.summed_grad
            noisy = summed + noise[offset : offset + n].view_as(summed)
            p.grad = noisy.mul_(scale).view_as(p)
            offset += n

    def scale_grad(self) -> None:
        """Already done in `add_noise`."""


class _GhostOptimizer(_FlatNoiseMixin, DPOptimizerFastGradientClipping):  # type: ignore[misc]
    """Opacus' ghost-clipping optimizer without its per-step deep copies.

    Opacus deep-copies every gradient to accumulate it; for a small model that Python
    overhead costs more than the arithmetic. Same maths: summed_grad = sum of the
    (already clipped) chunk gradients.
    """

    def accumulate(self) -> None:
        for p in self.params:
            if p.summed_grad is not None:
                p.summed_grad.add_(p.grad)
            else:
                p.summed_grad = p.grad.detach().clone()


class _HooksOptimizer(_FlatNoiseMixin, DPOptimizer):  # type: ignore[misc]
    """Opacus' per-sample-gradient optimizer with the shared flat noise draw."""


@functools.lru_cache(maxsize=64)
def _planned_noise_multiplier(
    *, target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str
) -> float:
    """plan_noise_multiplier, memoised: the search runs the accountant dozens of times."""
    return plan_noise_multiplier(
        target_epsilon=target_epsilon,
        delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant=accountant,
    )


def _distributed_rank_and_size() -> tuple[int, int]:
    """(rank, world size) of an initialised torch.distributed group, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class TaskLoss(nn.Module):
    """The study's loss: BCE with logits (binary, one logit) or cross-entropy (K logits).

    `reduction` is an attribute because Opacus' ghost-clipping wrapper switches it to
    "none" to get per-sample losses. A binary model may output [B] or [B, 1].
    """

    def __init__(self, task: Task, reduction: str = "mean") -> None:
        super().__init__()
        self.task = task
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.task == "binary":
            return nn.functional.binary_cross_entropy_with_logits(
                logits.reshape(targets.shape), targets.to(logits.dtype), reduction=self.reduction
            )
        return nn.functional.cross_entropy(logits, targets.long(), reduction=self.reduction)


def record_loss_fn(task: Task) -> LossFn:
    """Summed loss of ONE record, as the per-record gradient code (vmap) calls it."""
    if task == "binary":

        def binary(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.binary_cross_entropy_with_logits(
                out.reshape(-1), target.reshape(-1).to(out.dtype), reduction="sum"
            )

        return binary

    def multiclass(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            out.reshape(1, -1), target.reshape(1).long(), reduction="sum"
        )

    return multiclass


def all_linear(model: nn.Module) -> bool:
    """True when every trainable layer is a plain Linear (book-keeping ghost applies)."""
    trainable = [module for _, module in trainable_modules(model)]
    return bool(trainable) and all(type(m) is nn.Linear for m in trainable)


GradSampleMode = Literal["ghost", "hooks"]
GRAD_SAMPLE_MODES: tuple[GradSampleMode, ...] = ("ghost", "hooks")
MEASURED_STEPS = 3
"""Timed steps per mode when `auto` measures (after one untimed warm-up step each)."""


@dataclass(frozen=True)
class GradSampleChoice:
    """Which record-level DP path a trainer runs, and why.

    `source`: "configured" (the study or site asked for it), "measured" (`auto`: the
    faster of the modes timed on this model, device and batch shape) or "rule" (`auto`
    where no measurement runs: multi-process training, whose ranks must agree).
    `seconds_per_step` holds the measured best step time of each mode that ran.
    """

    mode: GradSampleMode
    source: Literal["configured", "measured", "rule"]
    batch_shape: tuple[int, ...]
    device: str
    seconds_per_step: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        timings = ", ".join(
            f"{mode} {seconds * 1e3:.1f} ms" for mode, seconds in self.seconds_per_step.items()
        )
        measured = f"measured per step {timings}; " if timings else ""
        shape = "x".join(str(n) for n in self.batch_shape)
        return f"{measured}picked {self.mode} ({self.source}; batch {shape} on {self.device})"


def pick_faster_mode(seconds_per_step: Mapping[str, float]) -> GradSampleMode:
    """The mode with the smaller measured step time (ghost on a tie).

    Choosing by timing costs no privacy: both modes compute the same clipped sum,
    sum_i min(1, C / (||g_i|| + 1e-6)) g_i, with ||g_i|| the norm of record i's whole
    gradient (ghost: `_GhostModule.bookkeeping_backward` and Opacus'
    `GradSampleModuleFastGradientClipping.get_clipping_coef`; hooks: Opacus'
    `DPOptimizer.clip_and_accumulate`), and the same noise draw (`_FlatNoiseMixin`).
    """
    usable = {
        mode: float(seconds)
        for mode, seconds in seconds_per_step.items()
        if mode in GRAD_SAMPLE_MODES and math.isfinite(seconds) and seconds > 0
    }
    if not usable:
        raise ConfigError(
            "grad_sample_mode",
            f"neither ghost nor hooks could be timed on this model ({dict(seconds_per_step)!r})",
        )
    return min(GRAD_SAMPLE_MODES, key=lambda m: usable.get(m, math.inf))


def dp_training_objects(
    mode: GradSampleMode,
    model: nn.Module,
    *,
    config: TrainingConfig,
    noise_multiplier: float,
    generator: torch.Generator,
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[..., Any]]:
    """(wrapped module, DP optimizer, loss) of one record-level DP-SGD mode.

    Raises NotImplementedError or ValueError when Opacus cannot wrap `model` so.
    """
    if config.optimizer == "adam":
        base: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    else:
        base = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    optimizer_kwargs: dict[str, Any] = {
        "noise_multiplier": noise_multiplier,
        "max_grad_norm": config.max_grad_norm,
        "expected_batch_size": config.batch_size,
        "loss_reduction": "mean",
        "generator": generator,
    }
    if mode == "ghost":
        module = _GhostModule(
            model,
            batch_first=True,
            loss_reduction="mean",
            max_grad_norm=config.max_grad_norm,
            use_ghost_clipping=True,
        )
        ghost = _GhostOptimizer(base, **optimizer_kwargs)
        return module, ghost, _GhostLoss(module, ghost, TaskLoss(config.task), "mean")
    hooks = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    return hooks, _HooksOptimizer(base, **optimizer_kwargs), TaskLoss(config.task)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_grad_sample_modes(
    model: nn.Module,
    *,
    input_shape: tuple[int, ...],
    config: TrainingConfig,
    device: torch.device,
    steps: int = MEASURED_STEPS,
) -> dict[str, float]:
    """Best seconds per DP-SGD step of each record-level mode, measured on `device`.

    Each mode wraps its own deep copy of `model` and takes one warm-up step, then
    `steps` timed steps, the modes interleaved so machine load hits them alike; the
    minimum is kept (load only ever adds time). A step is one physical batch of
    ``min(batch_size, max_physical_batch_size)`` SYNTHETIC records of `input_shape`
    (standard normal inputs, random labels): forward, per-sample clipping, noise and
    the optimizer step. No site data is read, `model` is left untouched, and the noise
    comes from a generator of its own, so nothing here is released or accounted. A
    mode Opacus cannot run on this model is left out.
    """
    if steps < 1:
        raise ConfigError("steps", "must be >= 1")
    physical = min(config.batch_size, config.max_physical_batch_size)
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = torch.randn((physical, *input_shape), generator=generator, device=device)
    if config.task == "binary":
        labels = torch.randint(0, 2, (physical,), generator=generator, device=device).float()
    else:
        labels = torch.randint(
            0, config.num_classes, (physical,), generator=generator, device=device
        )
    runs: dict[str, tuple[nn.Module, Any, Callable[..., Any]]] = {}
    for mode in GRAD_SAMPLE_MODES:
        try:
            runs[mode] = dp_training_objects(
                mode, copy.deepcopy(model), config=config, noise_multiplier=1.0,
                generator=generator,
            )
        except (NotImplementedError, ValueError) as exc:
            logger.info("grad_sample_mode %s cannot run on this model: %s", mode, exc)
    seconds: dict[str, list[float]] = {mode: [] for mode in runs}
    with warnings.catch_warnings():
        # Opacus' full backward hooks warn when inputs need no grad (they never do here).
        warnings.simplefilter("ignore", UserWarning)
        for step in range(steps + 1):
            for mode in list(runs):
                module, optimizer, criterion = runs[mode]
                _synchronize(device)
                started = time.perf_counter()
                try:
                    optimizer.signal_skip_step(do_skip=False)
                    criterion(module(inputs), labels).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                except (NotImplementedError, ValueError, ConfigError) as exc:
                    logger.info("grad_sample_mode %s failed on this model: %s", mode, exc)
                    del runs[mode], seconds[mode]
                    continue
                _synchronize(device)
                if step > 0:  # the first step is warm-up (allocation, lazy init)
                    seconds[mode].append(time.perf_counter() - started)
    del runs
    return {mode: min(values) for mode, values in seconds.items()}


class LocalTrainer:
    """Trains one site's model for a round from the global weights; DP by default.

    Opacus wrapping happens once, in the constructor; each round loads the new global
    weights into the same (wrapped) model and optimizer.
    """

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        data: SiteData | ImageDataset,
        config: TrainingConfig,
        *,
        seed: int,
    ) -> None:
        self.config = config
        self.device = select_device(config.device)
        self.model = model_factory().to(self.device)
        if len(data) == 0:
            raise DataError("no training records", file=data.source or None)
        # Tables live on the device whole; images are decoded on access (bounded cache).
        self._images: ImageDataset | None = None
        self.features = torch.zeros(0)
        if isinstance(data, ImageDataset):
            self._images = data
        else:
            self.features = torch.as_tensor(data.features, dtype=torch.float32, device=self.device)
        self.loss = TaskLoss(config.task)
        self._record_loss = record_loss_fn(config.task)
        self.labels = self._label_tensor(np.asarray(data.labels), data.source)
        self.num_samples = len(data)
        self.rank, self.world_size = _distributed_rank_and_size()
        # Ranks sample disjoint shards independently; only rank 0 adds noise.
        self._sampling_generator = torch.Generator().manual_seed(seed + 7919 * self.rank)
        self._noise_generator = torch.Generator(device=self.device).manual_seed(seed + 1)

        self.privacy_unit: PrivacyUnit = self._choose_unit(data)
        if self.privacy_unit == "patient":
            ids = data.patient_ids if data.patient_ids is not None else np.array([])
            _, inverse = np.unique(ids, return_inverse=True)
            self._patient_of_record = torch.as_tensor(inverse, device=self.device)
            self.num_units = int(inverse.max()) + 1
        else:
            self.num_units = self.num_samples
        if config.dp:
            check_cohort_size(
                self.num_units,
                delta=config.delta,
                unit=self.privacy_unit,
                file=data.source or None,
            )
        if config.batch_size > self.num_units:
            raise ConfigError(
                "batch_size", f"{config.batch_size} exceeds the {self.num_units} available units"
            )
        # The DP count when the site released one: q and steps then depend on N only
        # through that count (Poisson sampling at rate q stays what is accounted).
        rate_units = config.released_units or self.num_units
        self.sample_rate = min(config.batch_size / rate_units, 1.0)
        # A fixed number of steps per epoch (= 1/q) makes the accounting exact and
        # independent of the sampled batch sizes.
        self.steps_per_epoch = max(1, round(rate_units / config.batch_size))

        self.noise_multiplier = 0.0
        if config.dp and config.noise_multiplier is not None:
            self.noise_multiplier = config.noise_multiplier
        elif config.dp:
            self.noise_multiplier = _planned_noise_multiplier(
                target_epsilon=config.target_epsilon,
                delta=config.delta,
                sample_rate=self.sample_rate,
                steps=config.planned_rounds * config.local_epochs * self.steps_per_epoch,
                accountant=config.accountant,
            )
        self.grad_sample_mode = "none"
        self.grad_sample_choice: GradSampleChoice | None = None
        if self.world_size > 1 and self.privacy_unit != "record":
            raise ConfigError(
                "privacy_unit", "multi-process training is implemented for record-level DP-SGD only"
            )
        # Record i belongs to rank i % world_size: each record is in exactly one shard
        # and is sampled there with probability q, so (sigma, q, steps) are unchanged.
        self._shard = torch.arange(self.rank, self.num_samples, self.world_size)
        self._build_training_objects()

    # ----------------------------------------------------------------- setup
    def _label_tensor(self, labels: np.ndarray, source: str) -> torch.Tensor:
        """Labels as the loss needs them: float 0/1 (binary) or class indices."""
        k = self.config.num_classes
        if labels.size and not (
            np.all(np.isfinite(labels)) and np.all(labels == np.round(labels))
            and labels.min() >= 0 and labels.max() < k
        ):
            raise DataError(f"labels must be class indices 0..{k - 1}", file=source or None)
        dtype = torch.float32 if self.config.task == "binary" else torch.int64
        return torch.as_tensor(labels, device=self.device).to(dtype)

    def _inputs(self, index: torch.Tensor) -> torch.Tensor:
        """Model inputs of the records at `index` (images decoded from disk on demand)."""
        if self._images is None:
            return self.features[index]
        return self._images.load(index.cpu().numpy()).to(self.device)

    def _choose_unit(self, data: SiteData | ImageDataset) -> PrivacyUnit:
        if not self.config.dp:
            return "none"
        wanted = self.config.privacy_unit
        if wanted == "patient" and data.patient_ids is None:
            raise ConfigError("privacy_unit", "patient-level DP needs a patient id column")
        if wanted == "record" or data.patient_ids is None:
            return "record"
        return "patient"

    def _base_optimizer(self, params: Any) -> torch.optim.Optimizer:
        if self.config.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.config.lr)
        return torch.optim.SGD(params, lr=self.config.lr, momentum=self.config.momentum)

    def _build_training_objects(self) -> None:
        cfg = self.config
        if cfg.dp:
            check_dp_compatible(self.model)
        if self.privacy_unit in ("none", "patient"):
            self.optimizer = self._base_optimizer(self.model.parameters())
            self.trained_module: nn.Module = self.model
            if self.privacy_unit == "patient":
                self.grad_sample_mode = "functorch-per-patient"
                self._patient_sampler = PatientSampler(
                    self._patient_of_record, sample_rate=self.sample_rate
                )
            logger.info("training with privacy unit %s", self.privacy_unit)
            return
        if self.world_size > 1:
            self._build_distributed()
            return
        self.grad_sample_choice = self._choose_grad_sample_mode()
        mode = self.grad_sample_choice.mode
        try:
            module, optimizer, criterion = dp_training_objects(
                mode,
                self.model,
                config=cfg,
                noise_multiplier=self.noise_multiplier,
                generator=self._noise_generator,
            )
        except (NotImplementedError, ValueError) as exc:
            raise ConfigError("grad_sample_mode", f"{mode} unavailable: {exc}") from exc
        self.trained_module, self.optimizer, self._criterion = module, optimizer, criterion
        self.grad_sample_mode = mode
        logger.info("record-level DP-SGD with grad_sample_mode=%s", self.grad_sample_mode)

    def _choose_grad_sample_mode(self) -> GradSampleChoice:
        """The configured mode, or for "auto" the faster one measured on this site's
        model, device and physical batch shape (synthetic inputs, a copy of the model:
        nothing here is trained, released or accounted)."""
        requested = self.config.grad_sample_mode
        physical = min(self.config.batch_size, self.config.max_physical_batch_size)
        shape = (physical, *self._record_shape())
        if requested in ("ghost", "hooks"):
            return GradSampleChoice(
                mode=requested, source="configured", batch_shape=shape, device=str(self.device)
            )
        seconds = measure_grad_sample_modes(
            self.model, input_shape=shape[1:], config=self.config, device=self.device
        )
        choice = GradSampleChoice(
            mode=pick_faster_mode(seconds),
            source="measured",
            seconds_per_step=seconds,
            batch_shape=shape,
            device=str(self.device),
        )
        logger.info("grad_sample_mode auto: %s", choice.describe())
        return choice

    def _record_shape(self) -> tuple[int, ...]:
        """Shape of one model input (an image's (C, H, W) or a table row's width)."""
        if self._images is not None:
            return tuple(self._images.shape)
        return tuple(self.features.shape[1:])

    def _build_distributed(self) -> None:
        """Opacus DPDDP (rank 0's weights broadcast) + the distributed DP optimizers.

        Each rank clips its own per-sample gradients, rank 0 alone adds the noise, and
        the sum is all-reduced: the same Gaussian mechanism as one process.
        """
        cfg = self.config
        wrapped = DPDDP(self.model)
        per_worker_batch = cfg.batch_size / self.world_size
        optimizer_kwargs: dict[str, Any] = {
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": cfg.max_grad_norm,
            "expected_batch_size": per_worker_batch,
            "loss_reduction": "mean",
            "generator": self._noise_generator,
        }
        base = self._base_optimizer(self.model.parameters())
        # All ranks must run the same mode, so no per-rank measurement here: the rule.
        mode = choose_grad_sample_mode(self.model, cfg.grad_sample_mode)
        self.grad_sample_choice = GradSampleChoice(
            mode=mode,
            source="configured" if cfg.grad_sample_mode == mode else "rule",
            batch_shape=(min(cfg.batch_size, cfg.max_physical_batch_size), *self._record_shape()),
            device=str(self.device),
        )
        if mode == "ghost":
            module = _GhostModule(
                wrapped,
                batch_first=True,
                loss_reduction="mean",
                max_grad_norm=cfg.max_grad_norm,
                use_ghost_clipping=True,
            )
            optimizer = DistributedDPOptimizerFastGradientClipping(base, **optimizer_kwargs)
            self._criterion = _GhostLoss(module, optimizer, TaskLoss(cfg.task), "mean")
            self.grad_sample_mode = "ghost-distributed"
        else:
            module = GradSampleModule(wrapped, batch_first=True, loss_reduction="mean")
            optimizer = DistributedDPOptimizer(base, **optimizer_kwargs)
            self._criterion = TaskLoss(cfg.task)
            self.grad_sample_mode = "hooks-distributed"
        self.trained_module, self.optimizer = module, optimizer
        logger.info("distributed DP-SGD, rank %d of %d", self.rank, self.world_size)

    # -------------------------------------------------------------- accounting
    def set_noise_multiplier(self, sigma: float) -> None:
        """Use the noise the site re-planned for this round (from its ledger)."""
        if not (sigma > 0 and sigma < float("inf")):
            raise ConfigError("noise_multiplier", f"must be finite and > 0, got {sigma}")
        self.noise_multiplier = sigma
        for engine in (getattr(self, "_patient_engine", None), getattr(self, "optimizer", None)):
            if engine is not None and hasattr(engine, "noise_multiplier"):
                engine.noise_multiplier = sigma

    def planned_segments(self, local_epochs: int | None = None) -> list[Segment]:
        """The DP mechanism one round will run, known BEFORE training (for the ledger)."""
        if not self.config.dp:
            return []
        epochs = self.config.local_epochs if local_epochs is None else local_epochs
        if epochs < 1:
            raise ConfigError("local_epochs", "must be >= 1")
        return [Segment(self.noise_multiplier, self.sample_rate, epochs * self.steps_per_epoch)]

    # ---------------------------------------------------------------- training
    def train_round(
        self,
        global_flat: np.ndarray,
        *,
        local_epochs: int | None = None,
        lr: float | None = None,
        fedprox_mu: float | None = None,
    ) -> TrainResult:
        """Train from `global_flat`; return the update and the mechanism that ran."""
        cfg = self.config
        epochs = cfg.local_epochs if local_epochs is None else local_epochs
        mu = cfg.fedprox_mu if fedprox_mu is None else fedprox_mu
        segments = self.planned_segments(epochs)
        if mu < 0:
            raise ConfigError("fedprox_mu", "must be >= 0")
        started = time.perf_counter()
        global_vec = np.asarray(global_flat, dtype=np.float32)
        load_flat_parameters(self.model, global_vec)
        self._reset_optimizer(cfg.lr if lr is None else lr)
        anchor = [p.detach().clone() for p in self.model.parameters()] if mu > 0 else None
        self.trained_module.train()
        # Losses stay tensors until the end: a .item() per step is a needless sync.
        losses: list[torch.Tensor] = []
        for _ in range(epochs):
            if self.privacy_unit == "none":
                losses.extend(self._nonprivate_epoch(anchor, mu))
                continue
            for _ in range(self.steps_per_epoch):
                if self.privacy_unit == "patient":
                    losses.append(self._patient_step(anchor, mu))
                else:
                    losses.append(self._record_step(anchor, mu))
        delta = flatten_parameters(self.model) - global_vec
        return TrainResult(
            delta_flat=delta.astype(np.float32),
            num_samples=self.num_samples,
            segments=segments,
            seconds=time.perf_counter() - started,
            device=str(self.device),
            privacy_unit=self.privacy_unit,
            mean_loss=float(torch.stack(losses).nanmean()) if losses else float("nan"),
        )

    def _reset_optimizer(self, lr: float) -> None:
        # Local optimizer state (momentum, Adam moments) does not carry across rounds:
        # each round starts from a new global model.
        base = getattr(self.optimizer, "original_optimizer", self.optimizer)
        base.state.clear()
        for group in base.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def _add_proximal_gradient(self, anchor: list[torch.Tensor] | None, mu: float) -> None:
        """FedProx (Li et al. 2020): add grad of mu/2 ||w - w_global||^2 = mu (w - w_global).

        Added AFTER clipping and noise: the proximal term does not depend on any record,
        so it needs no clipping and costs no privacy (post-processing). Adding it per
        sample would waste clipping budget on a data-independent pull.
        """
        if anchor is None or mu == 0:
            return
        for p, w0 in zip(self.model.parameters(), anchor):
            if p.grad is not None:
                p.grad.add_(p.detach() - w0, alpha=mu)

    def _base_step(self) -> None:
        base = getattr(self.optimizer, "original_optimizer", self.optimizer)
        base.step()

    def _nonprivate_epoch(self, anchor: list[torch.Tensor] | None, mu: float) -> list[torch.Tensor]:
        losses = []
        order = torch.randperm(self.num_samples, generator=self._sampling_generator)
        order = order.to(self.device)
        for batch in order.split(self.config.batch_size):
            self.optimizer.zero_grad(set_to_none=True)
            # Physical chunks accumulate the batch-mean gradient (memory-bounded images).
            total = torch.zeros((), device=self.device)
            for chunk in batch.split(self.config.max_physical_batch_size):
                loss = self.loss(self.model(self._inputs(chunk)), self.labels[chunk])
                (loss * (chunk.numel() / batch.numel())).backward()
                total += loss.detach() * int(chunk.numel())
            self._add_proximal_gradient(anchor, mu)
            self.optimizer.step()
            losses.append(total / int(batch.numel()))
        return losses

    def _poisson_records(self) -> torch.Tensor:
        chosen = torch.rand(self._shard.numel(), generator=self._sampling_generator)
        return self._shard[chosen < self.sample_rate].to(self.device)

    def _record_step(self, anchor: list[torch.Tensor] | None, mu: float) -> torch.Tensor:
        """One DP-SGD step over a Poisson batch, split into physical chunks."""
        batch = self._poisson_records()
        if batch.numel() == 0:
            if self.world_size > 1:
                self._distributed_empty_step(anchor, mu)
            else:
                self._noise_only_step(anchor, mu)
            return torch.tensor(float("nan"), device=self.device)
        optimizer = self.optimizer
        chunks = batch.split(self.config.max_physical_batch_size)
        total_loss = torch.zeros((), device=self.device)
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            # BatchMemoryManager protocol: all but the last chunk only clip+accumulate.
            optimizer.signal_skip_step(do_skip=not last)
            logits = self.trained_module(self._inputs(chunk))
            loss = self._criterion(logits, self.labels[chunk])
            loss.backward()
            total_loss += loss.detach() * int(chunk.numel())
            if last:
                if optimizer.pre_step():
                    if self.world_size > 1:
                        optimizer.reduce_gradients()
                    self._add_proximal_gradient(anchor, mu)
                    self._base_step()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return total_loss / int(batch.numel())

    def _distributed_empty_step(self, anchor: list[torch.Tensor] | None, mu: float) -> None:
        """This rank sampled nothing: contribute a zero sum, but still join the all-reduce
        (and add the noise if rank 0), so every rank takes the same step."""
        optimizer = self.optimizer
        for p in self.model.parameters():
            p.summed_grad = torch.zeros_like(p)
        optimizer.add_noise()
        optimizer.scale_grad()
        optimizer.reduce_gradients()
        self._add_proximal_gradient(anchor, mu)
        self._base_step()
        for p in self.model.parameters():
            p.summed_grad = None
        optimizer.zero_grad(set_to_none=True)

    def _noise_only_step(self, anchor: list[torch.Tensor] | None, mu: float) -> None:
        """An empty Poisson batch still releases noise (the mechanism ran; q is unchanged)."""
        std = self.noise_multiplier * self.config.max_grad_norm
        for p in self.model.parameters():
            noise = torch.normal(
                0.0, std, size=p.shape, generator=self._noise_generator, device=p.device
            )
            p.grad = noise / self.config.batch_size
        self._add_proximal_gradient(anchor, mu)
        self._base_step()
        self.optimizer.zero_grad(set_to_none=True)

    def _patient_step(self, anchor: list[torch.Tensor] | None, mu: float) -> torch.Tensor:
        records, patient_index, num_patients = self._patient_sampler.sample(
            self._sampling_generator
        )
        clipped, loss_sum = self._clipped_patient_sum(records, patient_index, num_patients)
        # Same noise draw as PatientLevelDPSGD (patient_dp.py): per tensor, in order.
        cfg = self.config
        std = self.noise_multiplier * cfg.max_grad_norm
        for name, p in self.model.named_parameters():
            noise = torch.normal(
                0.0, std, size=p.shape, generator=self._noise_generator, device=p.device
            )
            p.grad = (clipped[name] + noise) / cfg.batch_size
        self._add_proximal_gradient(anchor, mu)
        self._base_step()
        self.optimizer.zero_grad(set_to_none=True)
        if records.numel() == 0:
            return torch.tensor(float("nan"), device=self.device)
        return loss_sum / int(records.numel())

    def _clipped_patient_sum(
        self, records: torch.Tensor, patient_index: torch.Tensor, num_patients: int
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Sum of per-patient clipped gradients, memory-bounded by the physical batch.

        Patients are processed in groups of whole patients with at most
        `max_physical_batch_size` records (a larger patient is its own group, its
        records in physical chunks), so per-record and per-patient gradients never
        exceed a physical batch's worth (ResNet-18: 11M parameters each). Clipping is
        per patient and summing is linear, so the result equals one big batch.
        """
        limit = self.config.max_physical_batch_size
        params = {name: p.detach() for name, p in self.model.named_parameters()}
        total = {name: torch.zeros_like(p) for name, p in params.items()}
        loss_sum = torch.zeros((), device=self.device)
        if num_patients == 0:
            return total, loss_sum
        order = torch.argsort(patient_index, stable=True)
        records, patient_index = records[order], patient_index[order]
        counts = torch.bincount(patient_index, minlength=num_patients).tolist()
        groups: list[tuple[int, int]] = []
        first, size = 0, 0
        for patient, count in enumerate(counts):
            if size and size + count > limit:
                groups.append((first, patient))
                first, size = patient, 0
            size += count
        groups.append((first, num_patients))
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        for p0, p1 in groups:
            rows = slice(int(offsets[p0]), int(offsets[p1]))
            group_records, units = records[rows], patient_index[rows] - p0
            per_unit = {
                name: torch.zeros((p1 - p0, *p.shape), dtype=p.dtype, device=p.device)
                for name, p in params.items()
            }
            for start in range(0, int(group_records.numel()), limit):
                chunk = group_records[start : start + limit]
                x, y = self._inputs(chunk), self.labels[chunk]
                grads = per_record_gradients(self.model, params, x, y, self._record_loss)
                for name, g in grads.items():
                    per_unit[name].index_add_(0, units[start : start + limit], g)
                with torch.no_grad():
                    loss_sum += TaskLoss(self.config.task, "sum")(self.model(x), y)
            identity = torch.arange(p1 - p0, device=self.device)
            clipped = clipped_unit_sum(
                per_unit, identity, p1 - p0, max_grad_norm=self.config.max_grad_norm
            )
            for name in total:
                total[name] += clipped[name]
        return total, loss_sum

    # -------------------------------------------------------------- inference
    def predict(self, features: np.ndarray | ImageDataset) -> np.ndarray:
        """Scores of the current local model (for held-out evaluation)."""
        return predict_scores(
            self.model,
            features,
            device=self.device,
            task=self.config.task,
            batch_size=self.config.max_physical_batch_size,
        )


GHOST_MIN_PARAMETERS = 1_000_000
"""The rule's threshold: conv nets at least this large take ghost clipping."""


def choose_grad_sample_mode(model: nn.Module, requested: str) -> Literal["ghost", "hooks"]:
    """The record-level DP path by rule, for multi-process training only.

    A single trainer measures instead (`measure_grad_sample_modes`); ranks of one
    multi-process trainer must run the same mode, so they use this rule, taken from
    `medfed bench dpsgd` on CPU (docs/benchmarks.md): all-Linear models -> ghost
    (book-keeping, one backward pass); conv nets with >= `GHOST_MIN_PARAMETERS` ->
    ghost (mixed ghost norms); smaller conv nets -> hooks. On a GPU the rule can be
    wrong (ResNet-18-GN on an H200: ghost 3.90x, hooks 2.87x non-private), which is
    why single trainers measure.
    """
    if requested == "ghost":
        return "ghost"
    if requested == "hooks":
        return "hooks"
    if all_linear(model):
        return "ghost"
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return "ghost" if parameters >= GHOST_MIN_PARAMETERS else "hooks"


def predict_scores(
    model: nn.Module,
    features: np.ndarray | ImageDataset,
    *,
    device: torch.device | str = "cpu",
    task: Task = "binary",
    batch_size: int = 1024,
) -> np.ndarray:
    """Scores in float64: sigmoid [N] for a binary task, softmax [N, K] for multi-class.

    Runs in batches, so an image folder is scored without loading it whole.
    """
    was_training = model.training
    model.eval()
    n = len(features)
    parts: list[np.ndarray] = []
    with torch.no_grad():
        for start in range(0, n, batch_size):
            index = np.arange(start, min(n, start + batch_size))
            if isinstance(features, ImageDataset):
                x = features.load(index).to(device)
            else:
                x = torch.as_tensor(np.asarray(features[index], dtype=np.float32), device=device)
            logits = model(x)
            if task == "binary":
                scores = torch.sigmoid(logits.reshape(-1))
            else:
                scores = torch.softmax(logits, dim=1)
            parts.append(scores.to("cpu", torch.float64).numpy())
    model.train(was_training)
    if not parts:
        return np.zeros((0,) if task == "binary" else (0, 0), dtype=np.float64)
    return np.concatenate(parts)
