"""Private local training at a site: Opacus DP-SGD (ghost clipping), patient-level DP.

Privacy plan (docs/privacy.md, "2. How noise is calibrated"): the noise multiplier is
calibrated ONCE for the whole planned schedule, ``planned_rounds x local steps per
round``, with the shared accountant, so the site's target epsilon holds at the END of
training rather than per round. Each round's mechanism is known before it runs
(`planned_segments`) so the site agent can check its ledger and write the spend ahead of
training.

Each local step is one Poisson-subsampled Gaussian mechanism (Abadi et al. 2016,
"Deep Learning with Differential Privacy", Alg. 1): every unit (record or patient) is
in the batch independently with probability q = batch_size / N; a fixed number of
steps per epoch, round(N / batch_size), is taken so the accounting is exact.

Record level uses Opacus: ghost clipping (Li et al. 2022, "Large Language Models Can
Be Strong Differentially Private Learners") or per-sample-gradient hooks; with
``grad_sample_mode = "auto"`` the trainer times a few steps of each on a copy of its
model, on its device, with synthetic inputs of its physical batch shape, and keeps the
faster (`site_agent.grad_sample_mode`), unless its site measured when it joined the
study and passed that decision in. For models whose trainable layers are all
Linear, the clipped sum comes from one backward pass by book-keeping (Bu et al. 2023,
see `site_agent.ghost_clipping.GhostModule`); other models run Opacus' two-pass ghost
clipping, with mixed ghost norms for Conv2d (Bu et al. 2022, see
`site_agent.ghost_clipping.conv_ghost_norms`). Opacus' optimizers add the noise either
way. Patient-level steps clip per patient (`site_agent.patient_dp`,
`site_agent.patient_steps`): per-patient norms by ghost clipping and the clipped sum by
book-keeping, one forward and one backward pass (`site_agent.unit_clipping`), or the
per-record reference for a model that has a layer without a unit-norm rule. The loss
follows the task: BCE with logits (binary) or cross-entropy (multi-class),
`site_agent.task_loss.TaskLoss`.
The trainer holds one path for tables and images: its records (`site_agent.site_dataset.
Records`) give it a loader (a table's rows on the device, images decoded per physical batch).
Large logical batches are split into physical batches with the protocol of Opacus'
`BatchMemoryManager` (`signal_skip_step`), driven directly from tensor indices: no
DataLoader, which is most of the per-step cost for a small tabular model
(docs/benchmarks.md has the measurements).

Randomness: batches and noise come from torch generators seeded by `seed`. Tests pass
fixed seeds; the site agent must pass a fresh seed from the OS CSPRNG for every
trainer, since noise an attacker can predict protects nothing.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from common.core.errors import ConfigError, DataError
from common.models import Task
from common.models.build import check_dp_compatible
from common.models.layout import flatten_parameters, load_flat_parameters
from common.privacy.accountant import Segment, plan_noise_multiplier
from site_agent.data import SiteData, check_cohort_size
from site_agent.device import select_device
from site_agent.ghost_clipping import clipped_backward
from site_agent.grad_sample_mode import (
    GradSampleChoice,
    base_optimizer,
    distributed_dp_objects,
    dp_training_objects,
    measure_grad_sample_modes,
    pick_faster_mode,
)
from site_agent.memory_budget import DpPath, fit_physical_batch
from site_agent.patient_dp import PatientSampler
from site_agent.patient_steps import clipped_patient_sum, unit_clipper_for
from site_agent.site_dataset import Records
from site_agent.task_loss import TaskLoss, label_tensor, record_loss_fn
from site_agent.training_config import PrivacyUnit, TrainingConfig, TrainResult

logger = logging.getLogger(__name__)


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


class LocalTrainer:
    """Trains one site's model for a round from the global weights; DP by default.

    Opacus wrapping happens once, in the constructor; each round loads the new global
    weights into the same (wrapped) model and optimizer.
    """

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        data: Records,
        config: TrainingConfig,
        *,
        seed: int,
        grad_sample_choice: GradSampleChoice | None = None,
    ) -> None:
        # `auto`'s decision made when the site joined its study
        # (`prepared_grad_sample_choice`): used instead of measuring here.
        self._prepared_choice = grad_sample_choice
        self.config = config
        self.device = select_device(config.device)
        self.model = model_factory().to(self.device)
        if len(data) == 0:
            raise DataError("no training records", file=data.source or None)
        # Model inputs of record indices (a table's rows on the device, images decoded).
        self._inputs = data.loader(self.device)
        self.record_shape = tuple(data.record_shape)
        self.loss = TaskLoss(config.task)
        self._record_loss = record_loss_fn(config.task)
        self.labels = label_tensor(
            np.asarray(data.labels), config=config, device=self.device, source=data.source
        )
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
        self._unit_clipper = (
            unit_clipper_for(self.model, self._inputs, config)
            if self.privacy_unit == "patient" else None
        )
        path: DpPath = "per-sample" if self.privacy_unit == "record" else "nonprivate"
        if self.privacy_unit == "patient":
            path = "unit-ghost" if self._unit_clipper is not None else "reference"
        self.config = fit_physical_batch(
            config, self.model, self.record_shape, path=path, device=self.device
        )
        self._build_training_objects()

    # ----------------------------------------------------------------- setup
    def _choose_unit(self, data: Records) -> PrivacyUnit:
        if not self.config.dp:
            return "none"
        wanted = self.config.privacy_unit
        if wanted == "patient" and data.patient_ids is None:
            raise ConfigError("privacy_unit", "patient-level DP needs a patient id column")
        if wanted == "record" or data.patient_ids is None:
            return "record"
        return "patient"

    def _build_training_objects(self) -> None:
        cfg = self.config
        if cfg.dp:
            check_dp_compatible(self.model)
        if self.privacy_unit in ("none", "patient"):
            self.optimizer = base_optimizer(self.model.parameters(), cfg)
            self.trained_module: nn.Module = self.model
            if self.privacy_unit == "patient":
                self.grad_sample_mode = (
                    "functorch-per-patient" if self._unit_clipper is None
                    else "ghost-per-patient"
                )
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
        shape = (physical, *self.record_shape)
        if requested in ("ghost", "hooks"):
            return GradSampleChoice(
                mode=requested, source="configured", batch_shape=shape, device=str(self.device)
            )
        prepared = self._prepared_choice
        if (prepared is not None and prepared.device == str(self.device)
                and prepared.batch_shape[1:] == shape[1:]):
            return prepared
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

    def _build_distributed(self) -> None:
        """Opacus DPDDP (rank 0's weights broadcast) + the distributed DP optimizers
        (`distributed_dp_objects`): the same Gaussian mechanism as one process."""
        choice, label, (module, optimizer, criterion) = distributed_dp_objects(
            self.model,
            config=self.config,
            noise_multiplier=self.noise_multiplier,
            generator=self._noise_generator,
            world_size=self.world_size,
            batch_shape=(
                min(self.config.batch_size, self.config.max_physical_batch_size),
                *self.record_shape,
            ),
            device=str(self.device),
        )
        self.grad_sample_choice, self.grad_sample_mode = choice, label
        self.trained_module, self.optimizer, self._criterion = module, optimizer, criterion
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
            total_loss += clipped_backward(self.trained_module, self._criterion,
                                           self._inputs(chunk), self.labels[chunk]) * int(
                chunk.numel())
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
        clipped, loss_sum = clipped_patient_sum(
            self.model,
            records,
            patient_index,
            num_patients,
            inputs=self._inputs,
            labels=self.labels,
            record_loss=self._record_loss,
            config=self.config,
            device=self.device,
            clipper=self._unit_clipper,
        )
        # Same noise draw as PatientLevelDPSGD (patient_dp.py): per tensor, in order.
        cfg = self.config
        std = self.noise_multiplier * cfg.max_grad_norm
        for name, p in self.model.named_parameters():
            noise = torch.normal(
                0.0, std, size=p.shape, generator=self._noise_generator, device=p.device
            )
            p.grad = noise.add_(clipped[name]).div_(cfg.batch_size)  # in place: no copies
        self._add_proximal_gradient(anchor, mu)
        self._base_step()
        self.optimizer.zero_grad(set_to_none=True)
        if records.numel() == 0:
            return torch.tensor(float("nan"), device=self.device)
        return loss_sum / int(records.numel())

    # -------------------------------------------------------------- inference
    def predict(self, features: np.ndarray | Records) -> np.ndarray:
        """Scores of the current local model (for held-out evaluation)."""
        return predict_scores(
            self.model,
            features,
            device=self.device,
            task=self.config.task,
            batch_size=self.config.max_physical_batch_size,
        )


def predict_scores(
    model: nn.Module,
    features: np.ndarray | Records,
    *,
    device: torch.device | str = "cpu",
    task: Task = "binary",
    batch_size: int = 1024,
) -> np.ndarray:
    """Scores in float64: sigmoid [N] for a binary task, softmax [N, K] for multi-class.

    Runs in batches, so an image folder is scored without loading it whole; a bare
    feature array is scored as a table's rows.
    """
    records: Records = (
        SiteData(features, np.zeros(len(features)), None)
        if isinstance(features, np.ndarray) else features
    )
    was_training = model.training
    model.eval()
    n = len(records)
    parts: list[np.ndarray] = []
    with torch.no_grad():
        for start in range(0, n, batch_size):
            index = np.arange(start, min(n, start + batch_size))
            logits = model(records.load(index).to(device))
            if task == "binary":
                scores = torch.sigmoid(logits.reshape(-1))
            else:
                scores = torch.softmax(logits, dim=1)
            parts.append(scores.to("cpu", torch.float64).numpy())
    model.train(was_training)
    if not parts:
        return np.zeros((0,) if task == "binary" else (0, 0), dtype=np.float64)
    return np.concatenate(parts)
