"""Ghost clipping for record-level DP-SGD, on top of Opacus.

Opacus' ghost clipping (Li et al. 2022, "Large Language Models Can Be Strong
Differentially Private Learners") with: a single backward pass by book-keeping for models
whose trainable layers are all Linear (Bu et al. 2023, `GhostModule`); mixed ghost norms
for Conv2d (Bu et al. 2022, `conv_ghost_norms`); and ONE flat Gaussian draw per step,
shared by the ghost and per-sample-gradient-hook optimizers (`FlatNoiseMixin`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import (
    DistributedDPOptimizer,
    DPOptimizer,
    DPOptimizerFastGradientClipping,
)
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from opacus.utils.fast_gradient_clipping_utils import (
    DPLossFastGradientClipping,
    DPTensorFastGradientClipping,
)
from opacus.utils.module_utils import trainable_modules
from opacus.utils.tensor_utils import unfold2d
from torch import nn

from common.core.errors import ConfigError
from site_agent.finite_clipping import clip_factors, rows_to_zero, usable, zero_unusable_rows

logger = logging.getLogger(__name__)


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


class GhostModule(GradSampleModuleFastGradientClipping):  # type: ignore[misc]
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
        # Two-pass path: which records of the last backward had a finite gradient norm,
        # and (set when some had not) the ones the trainer runs again (`take_retry`).
        self.usable_samples: torch.Tensor | None = None
        self._retry: torch.Tensor | None = None
        super().__init__(m, **kwargs)  # calls add_hooks

    def get_clipping_coef(self) -> torch.Tensor:
        """Opacus' per-record factor min(1, C / (||g_i|| + 1e-6)), the squared norms
        summed over the parameters in float64, and 0 for a record whose norm is not
        finite (site_agent.finite_clipping); `usable_samples` says which records those
        are."""
        norms = [param._norm_sample for param in self.trainable_parameters]
        device = norms[0].device
        squared = torch.stack(
            [n.to(device=device, dtype=torch.float64) for n in norms]).square().sum(dim=0)
        self.per_sample_gradient_norms = squared.clamp_min(0.0).sqrt()
        self.usable_samples = usable(squared)
        return clip_factors(squared, max_grad_norm=self.max_grad_norm).to(norms[0].dtype)

    def request_retry(self, usable_samples: torch.Tensor) -> None:
        """The clipped backward was not run: the physical batch's records where
        `usable_samples` holds are to be run again on their own (`take_retry`)."""
        self._retry = usable_samples

    def take_retry(self) -> torch.Tensor | None:
        """The records (a bool mask over the last physical batch) the trainer must run
        again alone because others in it had a non-finite gradient, or None; cleared."""
        retry, self._retry = self._retry, None
        return retry

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
        # Sums of squares in float64 (site_agent.finite_clipping).
        squared = torch.zeros_like(loss_per_sample, dtype=torch.float64)
        for (layer, activation, _), g in zip(records, grads):
            factor = torch.zeros_like(squared)
            if layer.weight.requires_grad:
                factor = factor + activation.to(g.dtype).square().sum(dim=1).to(squared.dtype)
            if layer.bias is not None and layer.bias.requires_grad:
                factor = factor + 1.0
            squared = squared + g.square().sum(dim=1).to(squared.dtype) * factor
        self._per_sample_gradient_norms = squared.clamp_min(0.0).sqrt()
        # As Opacus, min(1, C / (||g_i|| + 1e-6)); a record whose gradient is not
        # finite contributes exactly zero (its rows are zeroed, not multiplied by 0).
        keep = rows_to_zero(usable(squared))
        coefficients = clip_factors(squared, max_grad_norm=self.max_grad_norm)
        for (layer, activation, _), g in zip(records, grads):
            weighted = zero_unusable_rows(g, keep) * coefficients.to(g.dtype).unsqueeze(1)
            if layer.weight.requires_grad:
                layer.weight.grad = weighted.t().mm(
                    zero_unusable_rows(activation.to(g.dtype), keep))
            if layer.bias is not None and layer.bias.requires_grad:
                layer.bias.grad = weighted.sum(dim=0)


class GhostLossTensor(DPTensorFastGradientClipping):  # type: ignore[misc]
    """Ghost-clipping loss whose backward uses book-keeping when the model allows it.

    Otherwise Opacus' two passes: per-record norms from the first backward, then the
    backward of sum_i c_i loss_i. When some record's norm is not finite, that second pass
    is not run on this forward (an unusable record's infinite activation times its zero
    factor would be NaN in a weight gradient, poisoning the sum): the module asks the
    trainer to run the usable records again on their own (`GhostModule.take_retry`), which
    gives exactly the clipped sum with the unusable records contributing zero."""

    def backward(self) -> None:
        module = self.module
        if getattr(module, "bookkeeping", False):
            module.bookkeeping_backward(self.loss_per_sample)
            return
        losses = self.loss_per_sample
        reduced = losses.mean(dim=0) if self.loss_reduction == "mean" else losses.sum(dim=0)
        reduced.backward(retain_graph=True)
        self.optimizer.zero_grad()
        coefficients = module.get_clipping_coef()
        kept = getattr(module, "usable_samples", None)
        if kept is not None and not bool(kept.all()):
            module.request_retry(kept)
            return
        second = (coefficients.to(losses.device) * losses).sum()
        module.disable_hooks()
        second.backward()
        module.enable_hooks()


class GhostLoss(DPLossFastGradientClipping):  # type: ignore[misc]
    def __call__(self, *args: Any, **kwargs: Any) -> DPTensorFastGradientClipping:
        loss = super().__call__(*args, **kwargs)
        return GhostLossTensor(self.module, self.optimizer, loss.loss_per_sample, "mean")


def clipped_backward(module: nn.Module, criterion: Callable[..., Any], inputs: torch.Tensor,
                     labels: torch.Tensor) -> torch.Tensor:
    """Forward and clipped backward of one physical batch of record-level DP-SGD (the
    clipped sum left in the parameters' `.grad`); its mean loss. When Opacus' two-pass
    ghost clipping asks for it (`GhostLossTensor`: some record's gradient norm was not
    finite), the usable records run again on their own, so the others contribute
    exactly zero and the sum stays finite (site_agent.finite_clipping)."""
    loss = criterion(module(inputs), labels)
    loss.backward()
    take_retry: Callable[[], torch.Tensor | None] | None = getattr(module, "take_retry", None)
    kept = take_retry() if take_retry is not None else None
    if take_retry is not None and kept is not None:
        logger.warning("a record's gradient is not finite (the served model overflows on "
                       "it): it contributes zero to this step")
        index = torch.nonzero(kept.to(inputs.device), as_tuple=False).reshape(-1)
        if index.numel():
            again = criterion(module(inputs[index]), labels[index])
            again.backward()
        if index.numel() == 0 or take_retry() is not None:
            for p in module.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
    detached: torch.Tensor = loss.detach()
    return detached


class FlatNoiseMixin:
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


class GhostOptimizer(FlatNoiseMixin, DPOptimizerFastGradientClipping):  # type: ignore[misc]
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


class FiniteClippingMixin:
    """Opacus' per-sample clipping (`DPOptimizer.clip_and_accumulate`) with the squared
    norms summed in float64 and a record whose gradient norm is not finite contributing
    exactly zero (site_agent.finite_clipping): its rows are zeroed before the weighted
    sum, where Opacus' factor times an infinite gradient would be NaN."""

    params: list[torch.nn.Parameter]
    max_grad_norm: float

    if TYPE_CHECKING:  # Opacus' DPOptimizer, which the mixin goes with, has these
        @property
        def grad_samples(self) -> list[torch.Tensor]: ...

        def _get_flat_grad_sample(self, p: torch.Tensor) -> torch.Tensor: ...

    def clip_and_accumulate(self) -> None:
        samples = self.grad_samples
        device = samples[0].device
        squared = torch.zeros(len(samples[0]), dtype=torch.float64, device=device)
        for g in samples:
            squared += g.reshape(len(g), -1).square().sum(dim=-1).to(device, torch.float64)
        factor = clip_factors(squared, max_grad_norm=self.max_grad_norm)
        keep = rows_to_zero(usable(squared))
        for p in self.params:
            _check_processed_flag(p.grad_sample)
            grad_sample = zero_unusable_rows(self._get_flat_grad_sample(p).to(p.dtype), keep)
            grad = torch.einsum("i,i...", factor.to(grad_sample.device, p.dtype), grad_sample)
            if p.summed_grad is not None:
                p.summed_grad += grad
            else:
                p.summed_grad = grad
            _mark_as_processed(p.grad_sample)


class HooksOptimizer(FlatNoiseMixin, FiniteClippingMixin, DPOptimizer):  # type: ignore[misc]
    """Opacus' per-sample-gradient optimizer with the shared flat noise draw and finite
    clipping (`FiniteClippingMixin`)."""


class DistributedHooksOptimizer(FiniteClippingMixin, DistributedDPOptimizer):  # type: ignore[misc]
    """Opacus' distributed per-sample-gradient optimizer with finite clipping."""



def all_linear(model: nn.Module) -> bool:
    """True when every trainable layer is a plain Linear (book-keeping ghost applies)."""
    trainable = [module for _, module in trainable_modules(model)]
    return bool(trainable) and all(type(m) is nn.Linear for m in trainable)

