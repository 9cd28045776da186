"""Which record-level DP-SGD path a trainer runs: ghost clipping or per-sample-gradient
hooks (`GradSampleChoice`).

With ``grad_sample_mode = "auto"`` a single trainer times a few steps of each on a copy
of its model, on its device, with synthetic inputs of its physical batch shape, and keeps
the faster (`measure_grad_sample_modes`, `pick_faster_mode`). A site measures once per
study, when it joins (`prepared_grad_sample_choice`: the model built, before any key is
sent, so no round waits for it), and keeps the decision in its state directory, so a
restart does not measure again. Ranks of a multi-process trainer must agree, so they
follow a rule instead (`choose_grad_sample_mode`).
`dp_training_objects` and `distributed_dp_objects` build the Opacus module, DP optimizer
and loss of the chosen mode.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DistributedDPOptimizerFastGradientClipping
from torch import nn

from common.core.errors import ConfigError, StateError, ValidationError
from common.core.fileio import atomic_write
from common.core.parsing import parse_json
from site_agent.ghost_clipping import (
    DistributedHooksOptimizer,
    GhostLoss,
    GhostModule,
    GhostOptimizer,
    HooksOptimizer,
    all_linear,
)
from site_agent.task_loss import TaskLoss
from site_agent.training_config import TrainingConfig

logger = logging.getLogger(__name__)

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
    gradient (ghost: `GhostModule.bookkeeping_backward` and Opacus'
    `GradSampleModuleFastGradientClipping.get_clipping_coef`; hooks: Opacus'
    `DPOptimizer.clip_and_accumulate`), and the same noise draw (`FlatNoiseMixin`).
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


def base_optimizer(params: Any, config: TrainingConfig) -> torch.optim.Optimizer:
    """The configured local optimizer (SGD with momentum, or Adam) over `params`."""
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)


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
    return _wrapped_dp_objects(
        mode, model, base_optimizer(model.parameters(), config),
        optimizer_classes=(GhostOptimizer, HooksOptimizer), config=config,
        noise_multiplier=noise_multiplier, expected_batch_size=config.batch_size,
        generator=generator,
    )


def _wrapped_dp_objects(
    mode: GradSampleMode,
    model: nn.Module,
    base: torch.optim.Optimizer,
    *,
    optimizer_classes: tuple[type[Any], type[Any]],
    config: TrainingConfig,
    noise_multiplier: float,
    expected_batch_size: float,
    generator: torch.Generator,
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[..., Any]]:
    """(wrapped module, DP optimizer, loss) of `mode` over `model` (a plain module or
    DPDDP), its DP optimizer the (ghost, hooks) class of `optimizer_classes` around
    `base`: one process or distributed differ only in those classes and the batch."""
    ghost_class, hooks_class = optimizer_classes
    optimizer_kwargs: dict[str, Any] = {
        "noise_multiplier": noise_multiplier,
        "max_grad_norm": config.max_grad_norm,
        "expected_batch_size": expected_batch_size,
        "loss_reduction": "mean",
        "generator": generator,
    }
    if mode == "ghost":
        module = GhostModule(
            model,
            batch_first=True,
            loss_reduction="mean",
            max_grad_norm=config.max_grad_norm,
            use_ghost_clipping=True,
        )
        ghost = ghost_class(base, **optimizer_kwargs)
        return module, ghost, GhostLoss(module, ghost, TaskLoss(config.task), "mean")
    hooks = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    return hooks, hooks_class(base, **optimizer_kwargs), TaskLoss(config.task)


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


MODE_STATE_FILE = "grad-sample-mode.json"
"""The site's `auto` decision for the study it joined (`prepared_grad_sample_choice`)."""


def prepared_grad_sample_choice(
    model: nn.Module,
    *,
    input_shape: tuple[int, ...],
    config: TrainingConfig,
    device: torch.device,
    state: Path,
    key: str,
) -> GradSampleChoice:
    """`auto`'s decision for one study, measured once (`measure_grad_sample_modes` on a
    physical batch of ``min(batch_size, max_physical_batch_size)`` synthetic records)
    and kept in `state`/MODE_STATE_FILE under `key` (the study, model, device and batch
    shape it was measured for): a restarted site reads it back instead of measuring
    again. The batch is the study's, not capped by this site's record count, so the
    decision depends on no site data. A file for another key is replaced."""
    shape = (min(config.batch_size, config.max_physical_batch_size), *input_shape)
    path = state / MODE_STATE_FILE
    saved = _saved_choice(path, key)
    if saved is not None:
        mode, seconds = saved
        choice = GradSampleChoice(mode=mode, source="measured", batch_shape=shape,
                                  device=str(device), seconds_per_step=seconds)
        logger.info("grad_sample_mode auto (kept from %s): %s", path, choice.describe())
        return choice
    seconds = measure_grad_sample_modes(model, input_shape=input_shape, config=config,
                                        device=device)
    choice = GradSampleChoice(mode=pick_faster_mode(seconds), source="measured",
                              batch_shape=shape, device=str(device), seconds_per_step=seconds)
    state.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(
        {"key": key, "mode": choice.mode, "seconds_per_step": dict(seconds)}).encode())
    logger.info("grad_sample_mode auto: %s", choice.describe())
    return choice


def _saved_choice(path: Path, key: str) -> tuple[GradSampleMode, dict[str, float]] | None:
    """The (mode, timings) saved under `key`, None when the file is absent or for
    another key; StateError when it is unreadable."""
    if not path.exists():
        return None
    try:
        raw = parse_json(path.read_bytes())
        if raw["key"] != key:
            return None
        mode = raw["mode"]
        seconds = {str(m): float(v) for m, v in raw["seconds_per_step"].items()}
    except (OSError, ValidationError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateError(
            f"{path} is unreadable ({exc}): it holds this site's measured grad_sample_mode; "
            "delete it to measure again"
        ) from None
    if mode not in GRAD_SAMPLE_MODES:
        raise StateError(f"{path}: mode {mode!r} is not one of {GRAD_SAMPLE_MODES}; "
                         "delete it to measure again")
    return mode, seconds


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


def distributed_dp_objects(
    model: nn.Module,
    *,
    config: TrainingConfig,
    noise_multiplier: float,
    generator: torch.Generator,
    world_size: int,
    batch_shape: tuple[int, ...],
    device: str,
) -> tuple[GradSampleChoice, str, tuple[nn.Module, torch.optim.Optimizer, Callable[..., Any]]]:
    """(choice, mode label, (wrapped module, DP optimizer, loss)) of multi-process DP-SGD.

    Opacus DPDDP (rank 0's weights broadcast) + the distributed DP optimizers: each rank
    clips its own per-sample gradients, rank 0 alone adds the noise, and the sum is
    all-reduced: the same Gaussian mechanism as one process.
    """
    # All ranks must run the same mode, so no per-rank measurement here: the rule.
    mode = choose_grad_sample_mode(model, config.grad_sample_mode)
    choice = GradSampleChoice(
        mode=mode,
        source="configured" if config.grad_sample_mode == mode else "rule",
        batch_shape=batch_shape,
        device=device,
    )
    base = base_optimizer(model.parameters(), config)
    objects = _wrapped_dp_objects(
        mode, DPDDP(model), base,
        optimizer_classes=(DistributedDPOptimizerFastGradientClipping,
                           DistributedHooksOptimizer),
        config=config, noise_multiplier=noise_multiplier,
        expected_batch_size=config.batch_size / world_size, generator=generator,
    )
    return choice, f"{mode}-distributed", objects
