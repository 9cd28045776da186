"""How a site trains in a round: the trainer's configuration from the site's settings,
the round plan and the study (`site_training_config`), the expected batch
(`requested_batch_size`, `fit_batch_size`), the local optimizer, DP-SGD's privacy
target (`dp_sgd_budget`), a round's noise planned from the site's ledger
(`round_noise_multiplier`) and the record-level DP path `auto` picks when the site joins
a study (`joined_grad_sample_choice`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from common.core.config import SiteSettings
from common.privacy.ledger import PrivacyLedger
from common.privacy.mechanisms import Mechanism
from common.rounds.announcement import RoundPlan
from site_agent.training_config import TrainingConfig

if TYPE_CHECKING:
    from common.models import Task
    from common.study import Study
    from site_agent.grad_sample_mode import GradSampleChoice


def fit_batch_size(requested: int, *, units: int) -> int:
    """The expected batch, capped at a quarter of the privacy units a site has (a small
    site still gets several steps per epoch, and sampling rate q stays below 1)."""
    return max(1, min(requested, units // 4))


def requested_batch_size(study: Study) -> int:
    """The expected logical batch: the study's, the contract every site trains by."""
    return study.training.batch_size


def local_optimizer(study: Study) -> Literal["sgd", "adam"]:
    """The local optimizer: the study's."""
    return study.training.local_optimizer


def dp_sgd_budget(budget: float, *, record_level: str, study: Study | None) -> float:
    """DP-SGD's target: the site's budget, or beneath hospital-level DP (`record_level`
    not "none") the study's record_epsilon when smaller (the site's budget still caps it)."""
    if record_level == "none" or study is None:
        return budget
    record = study.privacy.record_epsilon
    return budget if record is None else min(budget, record)


DEFAULT_PHYSICAL_CAP = 1024
"""The most records per forward/backward pass when the site set no physical batch."""


def physical_batch_settings(settings: SiteSettings) -> dict[str, Any]:
    """`TrainingConfig`'s physical-batch fields from the site's settings: the site's
    `max_physical_batch_size` when set (and its `memory_budget` when set too), else the
    batch derived from `memory_budget` or, unset, the device's safe default."""
    training = settings.training
    if training.max_physical_batch_size is not None:
        return {"max_physical_batch_size": training.max_physical_batch_size,
                "memory_budget": training.memory_budget}
    return {"max_physical_batch_size": DEFAULT_PHYSICAL_CAP,
            "memory_budget": training.memory_budget or "default"}


def site_training_config(
    settings: SiteSettings,
    plan: RoundPlan,
    *,
    local_epochs: int,
    batch_size: int,
    optimizer: Literal["sgd", "adam"],
    target_epsilon: float,
    dp: bool,
    privacy_unit: Literal["auto", "patient", "record"],
    task: Task,
    num_classes: int,
    released_units: int | None,
    planned: bool,
) -> TrainingConfig:
    """The trainer's configuration: the site's privacy, device and physical-batch
    settings, `plan`'s learning rate, planned rounds and FedProx term, and the given
    study-derived values. With `planned` (a ledger) the noise multiplier is a
    placeholder, re-planned before each round."""
    return TrainingConfig(
        batch_size=batch_size,
        **physical_batch_settings(settings),
        local_epochs=local_epochs,
        lr=plan.learning_rate,
        optimizer=optimizer,
        max_grad_norm=settings.privacy.max_grad_norm,
        target_epsilon=target_epsilon,
        delta=settings.privacy.delta,
        planned_rounds=plan.planned_rounds,
        fedprox_mu=plan.fedprox_mu,
        accountant=settings.privacy.accountant,
        dp=dp,
        privacy_unit=privacy_unit,
        grad_sample_mode=settings.training.grad_sample_mode,
        device=settings.training.device,
        task=task,
        num_classes=num_classes,
        released_units=released_units,
        noise_multiplier=1.0 if planned else None,  # re-planned before each round
    )


def round_noise_multiplier(
    ledger: PrivacyLedger,
    *,
    settings: SiteSettings,
    plan: RoundPlan,
    sample_rate: float,
    steps_per_epoch: int,
    evaluation: Sequence[Mechanism],
    study: Study | None,
    record_level: str,
) -> float:
    """The noise multiplier of `plan`'s DP-SGD, planned from `ledger` with `evaluation`
    (the round's DP evaluation release) reserved in every round left
    (`site_agent.dp_release.plan_training_noise`). Beneath hospital-level DP
    (`record_level` not "none") it is planned on the ledger's DP-SGD path
    (common.privacy.layered: DDGauss rounds above DP-SGD are post-processing) for
    record_epsilon; otherwise on the whole ledger for its budget (no overrides)."""
    from site_agent.dp_release import plan_training_noise

    overrides: dict[str, Any] = {}
    if record_level != "none":
        from common.privacy.layered import dpsgd_path

        pairs = [(e.purpose, e.mechanisms) for e in ledger.entries()]
        overrides = {
            "history": dpsgd_path(pairs),
            "budget_epsilon": dp_sgd_budget(
                ledger.budget_epsilon, record_level=record_level, study=study
            ),
        }
    return plan_training_noise(
        ledger, policy=settings.policy,
        announced_rounds=plan.planned_rounds, sample_rate=sample_rate,
        steps_per_round=plan.local_epochs * steps_per_epoch,
        evaluation=evaluation,
        study_rounds=None if study is None else study.study.rounds, study=study,
        **overrides,
    ).noise_multiplier


def joined_grad_sample_choice(
    settings: SiteSettings,
    study: Study,
    *,
    model: Any,
    record_shape: tuple[int, ...],
    device: str,
) -> GradSampleChoice | None:
    """`grad_sample_mode = "auto"`'s decision for record-level DP-SGD on `study`'s
    `model`, made once when the site joins the study (before any key is sent, so no
    round's noise planning waits for the ~minutes a large network's measurement takes
    on a CPU) and kept in the site's state (`prepared_grad_sample_choice`). None when
    the site configured a mode, or trains as several processes (their ranks follow a
    rule)."""
    import torch
    import torch.distributed as dist

    from site_agent.grad_sample_mode import prepared_grad_sample_choice

    if settings.training.grad_sample_mode != "auto" or (
        dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    ):
        return None
    config = TrainingConfig(
        batch_size=requested_batch_size(study),
        **physical_batch_settings(settings),
        optimizer=local_optimizer(study),
        max_grad_norm=settings.privacy.max_grad_norm,
        dp=True, privacy_unit="record", device=device,
        task=study.study.task, num_classes=len(study.study.classes),
    )
    from common.study import study_sha256

    shape = "x".join(str(n) for n in record_shape)
    physical = min(config.batch_size, config.max_physical_batch_size)
    return prepared_grad_sample_choice(
        model, input_shape=record_shape, config=config, device=torch.device(device),
        state=settings.state,
        key=f"study {study_sha256(study)}, device {device}, batch {physical}x{shape}",
    )
