"""Model names and kinds, read from the network modules' file names (torch-free).

A network module (``common/models/tables/*.py`` or ``common/models/images/*.py``; names
starting with ``_`` are helpers, not networks) defines one keyword-only function:

* tables: ``build(*, in_features: int, outputs: int, params: Mapping[str, Any]) -> nn.Module``
* images: ``build(*, in_channels: int, image_size: int | Sequence[int] | None,
  outputs: int, params: Mapping[str, Any]) -> nn.Module``

``outputs`` is 1 for a binary task (one logit, BCE) and K for K classes; ``params`` are
the study's ``[model] options`` (``hidden``/``dropout`` for ``mlp``), checked by the
module with `check_params`. Every network must be Opacus-valid (no BatchNorm: its
running statistics mix samples, which breaks per-sample gradients and DP-SGD);
`common.models.build` checks that at build time.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from common.core.errors import ConfigError

Kind = Literal["table", "images"]
"""A model's data kind, as a study's ``[data] kind`` names it."""

Task = Literal["binary", "multiclass"]

CUSTOM = "custom"
"""The name of a hospital's own network (``custom = "package.module:factory"``)."""

PACKAGES: dict[Kind, str] = {"table": "tables", "images": "images"}
"""The folder of `common/models` holding each kind's network modules."""

@cache
def _modules() -> dict[str, tuple[Kind, str]]:
    """name -> (kind, module path), from the file names of the two network folders."""
    root = Path(__file__).parent
    found: dict[str, tuple[Kind, str]] = {}
    for kind, folder in PACKAGES.items():
        for info in pkgutil.iter_modules([str(root / folder)]):
            if info.name.startswith("_"):
                continue
            found[info.name.replace("_", "-")] = (kind, f"common.models.{folder}.{info.name}")
    return dict(sorted(found.items()))


def model_names(kind: Kind | None = None) -> tuple[str, ...]:
    """The built-in networks' names (of one kind, or all), sorted."""
    return tuple(name for name, (k, _) in _modules().items() if kind is None or k == kind)


def kind_of(name: str) -> Kind:
    """The data kind a built-in network takes; a `ConfigError` for an unknown name."""
    entry = _modules().get(name)
    if entry is None:
        raise ConfigError(
            "model",
            f"unknown model {name!r}; known: {list(model_names())}, or custom = "
            "'package.module:factory'",
        )
    return entry[0]


def module_of(name: str) -> str:
    """The module path of a built-in network (after `kind_of` accepted its name)."""
    kind_of(name)
    return _modules()[name][1]


def check_params(params: Mapping[str, Any], allowed: set[str], model: str) -> None:
    """A network's ``[model] options`` may name only the parameters it takes."""
    unknown = set(params) - allowed
    if unknown:
        raise ConfigError(
            "model.params",
            f"unknown parameter(s) {sorted(unknown)} for {model!r}; known: {sorted(allowed)}",
        )


@dataclass(frozen=True)
class ModelSpec:
    """What a study's ``[model]`` section says: a registry name and its parameters,
    or ``custom = "package.module:factory"`` for a hospital's own ``nn.Module``."""

    name: str = "mlp"
    params: Mapping[str, Any] = field(default_factory=dict)
    custom: str | None = None

    @classmethod
    def from_fields(
        cls,
        *,
        name: str | None,
        custom: str | None = None,
        hidden: Sequence[int] = (64, 32),
        dropout: float = 0.0,
        options: Mapping[str, Any] | None = None,
    ) -> ModelSpec:
        """From a study's ``[model]`` fields: mlp takes hidden/dropout, a custom factory
        its options; other built-ins take their options."""
        if custom is not None:
            return cls(name=CUSTOM, params=dict(options or {}), custom=custom)
        if (name or "mlp") == "mlp":
            return cls(name="mlp", params={"hidden": list(hidden), "dropout": dropout})
        if name == "logistic":
            return cls(name="logistic")
        return cls(name=str(name), params=dict(options or {}))

    @property
    def canonical_name(self) -> str:
        """The registry name ("custom" when a factory is named)."""
        if self.custom is not None:
            return CUSTOM
        return self.name


def output_units(*, task: Task, num_classes: int) -> int:
    """Output width: one logit for a binary task (BCE), K logits for K classes (CE)."""
    if task == "binary":
        if num_classes != 2:
            raise ConfigError("num_classes", f"a binary task has 2 classes, not {num_classes}")
        return 1
    if task == "multiclass":
        if num_classes < 3:
            raise ConfigError(
                "num_classes", f"multiclass needs >= 3 classes (got {num_classes}); use binary"
            )
        return num_classes
    raise ConfigError("task", f"unknown task {task!r}; known: binary, multiclass")


