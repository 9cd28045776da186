"""How to rebuild a network: the model registry's name with its arguments, or a custom
``package.module:factory`` with its options. A model bundle records it; a study asks
for it (`architecture_from_study`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.study import FACTORY_PATTERN, Study, encoded_feature_names


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Architecture(_Section):
    """How to rebuild the network: a registry name with its arguments, or a custom
    ``package.module:factory`` called with ``options`` (the model registry)."""

    name: str | None = None
    custom: str | None = Field(default=None, pattern=FACTORY_PATTERN)
    in_features: int | None = Field(default=None, ge=1)
    in_channels: int | None = Field(default=None, ge=1)
    image_size: tuple[int, int] | None = None
    num_outputs: int = Field(ge=1)
    hidden: tuple[int, ...] = ()
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    options: dict[str, int | float | str | bool] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one(self) -> Architecture:
        if (self.name is None) == (self.custom is None):
            raise ValueError("exactly one of name and custom")
        return self


def architecture_from_study(study: Study) -> Architecture:
    """The architecture a study asks for; its input width follows from the encoding."""
    model = study.model
    tabular = study.data.kind == "table"
    return Architecture(
        name=model.name,
        custom=model.custom,
        in_features=len(encoded_feature_names(study)) if tabular else None,
        in_channels=None if tabular else study.data.channels,
        image_size=None if tabular else study.data.image_size,
        num_outputs=study.num_outputs,
        hidden=model.hidden if model.name == "mlp" else (),
        dropout=model.dropout,
        options=dict(model.options),
    )
