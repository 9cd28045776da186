"""The model a site trains: its name for logs and reports (`model_name`), the study's
network (`build_site_model`), and the check that the coordinator's model has the same
wire layout (`check_layout`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.core.codec import TensorSpec
from common.core.config import SiteSettings
from common.core.errors import ConfigError

if TYPE_CHECKING:
    from common.study import Study


def model_name(study: Study | None) -> str:
    """What the site trains, for logs and reports: a registry name or the factory
    ("" before the site joined a study)."""
    if study is None:
        return ""
    return study.model.custom or study.model.name or "mlp"


def build_site_model(
    study: Study | None, settings: SiteSettings, *, in_features: int | None
) -> Any:
    """A fresh network: the study's model (with the site's allowed model factories)."""
    from common.models.build import build_for_study

    if study is None:
        raise ConfigError("study", "no study joined: a site builds the study's model only")
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
