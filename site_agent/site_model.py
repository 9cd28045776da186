"""The model a site trains: its name for logs and reports (`model_name`), the network
built from the study or the site's settings (`build_site_model`), and the check that the
coordinator's model has the same wire layout (`check_layout`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.codec import TensorSpec
from common.config import SiteSettings
from common.errors import ConfigError

if TYPE_CHECKING:
    from common.study import Study


def model_name(study: Study | None, settings: SiteSettings) -> str:
    """What the site trains, for logs and reports: a registry name or the factory."""
    if study is None:
        return settings.training.model
    return study.model.custom or study.model.name or "mlp"


def build_site_model(
    study: Study | None, settings: SiteSettings, *, in_features: int | None
) -> Any:
    """A fresh network: the study's model (with the site's allowed model factories), or
    without a study the site's `training.model`."""
    from common.models import ModelSpec
    from common.models.build import build_for_study, build_model

    if study is None:
        return build_model(ModelSpec(name=settings.training.model), in_features=in_features)
    return build_for_study(
        study,
        in_features=in_features,
        allowed_model_factories=settings.policy.allowed_model_factories,
    )


def check_layout(expected: tuple[TensorSpec, ...], announced: tuple[TensorSpec, ...]) -> None:
    """The coordinator's model must be the architecture this site trains."""
    if tuple(expected) != tuple(announced):
        raise ConfigError(
            "model", "the coordinator's model layout does not match this site's model"
        )


def layout_of(model: Any) -> tuple[TensorSpec, ...]:
    """The model's wire layout (`common.models.layout`, which imports torch)."""
    from common.models.layout import model_layout

    return model_layout(model)
